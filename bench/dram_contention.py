"""How the copy engine and the CPU share the host's DRAM (GPU machine; torch only, no vLLM): GB/s read by the CPU's
threads (a max over 2 GB of bytes, and torch's bf16 GEMM at one row on 8B-shaped weights) and by host-to-GPU copies from
page-locked memory, each alone and each CPU read beside the copy. Why it matters: the coprocessor splits each product
between the two, and the split pays only if together they read faster than the CPU alone (strategies/coprocessor/tune.py).

    PYTHONPATH=runtime taskset -c 2-15 python bench/dram_contention.py OUT.json   # THREADS (default: the affinity's cores)
"""
from __future__ import annotations

import json
import os
import sys
import threading

import torch
from vllm_hybrid.cpupod.server import window_gbs

GB = 1.5  # of weights per shape: more than any cache


def gbs(step, nbytes: int, seconds: float) -> float:
    """GB/s of step(0), step(1), ... (each reads nbytes) over a window of `seconds`, after one untimed call: the
    servers' own timing (cpupod_server.window_gbs)."""
    step(0)
    return window_gbs(lambda i: (step(i), nbytes)[1], seconds)  # steps return tensors: the bytes are nbytes


def main(path: str) -> dict:
    torch.set_num_threads(int(os.environ.get("THREADS", len(os.sched_getaffinity(0)))))
    n, k = 28672, 4096  # the 8B shape's gate_up product, the largest of a layer
    count = max(2, int(GB * 1e9 / (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16).pin_memory() for _ in range(count)]
    nbytes = n * k * 2
    x, y = torch.randn(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
    flat = torch.ones(2 << 30, dtype=torch.uint8)  # bytes, as the product server times its DRAM read (a bf16 max is
    # bound by its conversions: 53-61 GB/s on the box where this one read 90-101)
    reads = {"max": (lambda i: flat.max(), flat.numel()),
             "gemm_1row": (lambda i: torch.matmul(x, weights[i % count].t(), out=y), nbytes)}
    gpu, stream = torch.empty(n, k, dtype=torch.bfloat16, device="cuda"), torch.cuda.Stream()

    def copies(seconds: float) -> float:
        def one(i: int) -> None:
            with torch.cuda.stream(stream):
                gpu.copy_(weights[i % count], non_blocking=True)
            stream.synchronize()  # one copy in flight, as a layer's prefetch
        return gbs(one, nbytes, seconds)

    out = {"threads": torch.get_num_threads(), "copy_alone_gbs": copies(0.6)}
    for name, (step, size) in reads.items():
        alone = gbs(step, size, 0.6)
        beside: dict[str, float] = {}
        copier = threading.Thread(target=lambda: beside.update(copy=copies(1.0)))
        copier.start()
        cpu = gbs(step, size, 0.8)
        copier.join()
        out[name] = {"alone_gbs": alone, "beside_copy_gbs": cpu, "copy_gbs": beside["copy"],
                     "together_gbs": round(cpu + beside["copy"], 1)}
        print(name, out[name], flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdout")
