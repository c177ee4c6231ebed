"""Cost of the per-stage metrics: the same CPU pipeline with HYBRID_STAGE_METRICS=1 and =0, side by
side, alternating A/B to spread machine noise; reports output tokens/s of each and the ratio.

    .venv/bin/python bench/metrics_overhead.py [--rounds 3] [--out bench/results/metrics_overhead.json]
"""
import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from vllm_hybrid.loadgen import wave
from vllm_hybrid.local import LocalPipeline, local_ports
from vllm_hybrid.tinymodel import make_tiny_llama


def measure(model, metrics_on: bool, waves: int) -> list[float]:
    cpus = os.cpu_count() or 2
    plan = {"model": str(model), "served_model_name": "tiny", "dtype": "float32", "max_model_len": 512,
            "block_size": 128, "max_num_seqs": 16, "max_num_batched_tokens": 512, "extra_args": ["--enforce-eager"],
            "stages": [{"name": "a", "device": "cpu", "layers": 2, "cpus": 1, "memory": "4Gi"},
                       {"name": "b", "device": "cpu", "layers": 2, "cpus": 1, "memory": "4Gi"}], **local_ports()}
    flag = {"HYBRID_STAGE_METRICS": "1" if metrics_on else "0"}
    envs = [{**flag, "HYBRID_CPUS": "0"}, {**flag, "HYBRID_CPUS": str(min(1, cpus - 1))}]
    with LocalPipeline(plan, tempfile.mkdtemp(), envs) as pipe:
        pipe.wait_ready()
        wave(pipe.url, "tiny", [f"warm {i}" for i in range(16)], 32)  # first batches: allocator warm-up
        return [wave(pipe.url, "tiny", [f"prompt {w} {i}" for i in range(16)], 128)["tok_per_s"] for w in range(waves)]


def hook_cost_us(steps: int = 20000) -> float:
    """What the metrics add to one step: begin/end (2 histograms, a counter, KV-block bookkeeping
    for 16 running requests) plus one send and one receive record."""
    import time
    from types import SimpleNamespace

    from vllm_hybrid.stage_metrics import StageMetrics

    m = StageMetrics({"pipeline": "b", "stage": "0", "stage_name": "s", "replica": "0"})
    cached = SimpleNamespace(req_ids=[f"r{i}" for i in range(16)], new_block_ids=[None] * 16, resumed_req_ids=set())
    so = SimpleNamespace(total_num_scheduled_tokens=16, scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                         finished_req_ids=set(), preempted_req_ids=None)
    t0 = time.perf_counter()
    for _ in range(steps):
        t = m.begin_step()
        m.transfer("recv", 65536, 1e-5)
        m.transfer("send", 65536, 1e-5)
        m.end_step(t, so)
    return (time.perf_counter() - t0) / steps * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--out", default="bench/results/metrics_overhead.json")
    args = ap.parse_args()
    per_step_us = hook_cost_us()
    model = make_tiny_llama(Path(tempfile.gettempdir()) / "hybrid-bench-tiny", layers=4)
    on, off = [], []
    for r in range(args.rounds):
        for enabled in ((True, False) if r % 2 == 0 else (False, True)):
            (on if enabled else off).extend(measure(model, enabled, args.waves))
    result = {"metrics_on_tok_s": on, "metrics_off_tok_s": off,
              "median_on": statistics.median(on), "median_off": statistics.median(off),
              "ratio_on_over_off": round(statistics.median(on) / statistics.median(off), 4),
              "hook_cost_us_per_step": round(per_step_us, 2),
              "setup": "2 CPU stages x 1 core, tiny 4-layer Llama fp32, 16 concurrent x 128 tokens per wave"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
