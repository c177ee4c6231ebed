"""`make demo`: a small generated model served by a 2-stage pipeline on this machine."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .local import LocalPipeline, local_ports, post_json
from .plan import plan_from_dict
from .planner import model_shape, read_model_config, split_layers
from .tinymodel import make_tiny_llama


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


def demo_plan(model: Path, gpu: bool) -> dict:
    cpus = os.cpu_count() or 2
    first = ({"name": "gpu", "device": "gpu", "layers": 1, "gpu_memory_utilization": 0.3} if gpu else
             {"name": "cpu-a", "device": "cpu", "layers": 1, "cpus": 1, "memory": "4Gi"})
    second = {"name": "cpu" if gpu else "cpu-b", "device": "cpu", "layers": 3,
              "cpus": max(1, cpus - 1 if gpu else cpus // 2), "memory": "4Gi"}
    return {"model": str(model), "served_model_name": "tiny-llama", "dtype": "float32", "max_model_len": 512,
            "block_size": 128, "max_num_seqs": 8, "max_num_batched_tokens": 512,
            "extra_args": ["--enforce-eager"], "stages": [first, second], **local_ports()}


def run_demo(workdir: str, force_cpu: bool = False) -> int:
    work = Path(workdir)
    model = make_tiny_llama(work / "tiny-llama", layers=4)
    envs = None if force_cpu else gpu_setup()
    plan = demo_plan(model, gpu=envs is not None)
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
        reply = post_json(pipe.url + "/v1/chat/completions", {
            "model": "tiny-llama", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "hello pipeline, which stage serves the answer?"}]})
        print("request: hello pipeline, which stage serves the answer?")
        print("answer (random weights, so words without meaning):", repr(reply["choices"][0]["message"]["content"]))
        print(f"usage: {reply['usage']}")
    print(f"shut down cleanly; total {time.monotonic() - t0:.0f}s")
    return 0
