"""What the GPU's in-place share costs on this node, for `auto`'s cost model (issue 48, item 4): measured at start by
the node's gpu part (node.measure_gpu) on kept W4A16 experts of the model's shape, in Marlin's layout in page-locked,
mapped host memory, computed by Marlin over PCIe as client.InPlace computes the share at the pod's steps.

The model read the share at pcie_gbs (48.5, a streamed step's fitted rate) before. Marlin in place read 42.2-42.9 GB/s
of a 235B layer's experts on an H200 (tests/gpu/results/h200-2026-12-02-experts-in-place.json) against the copy
engine's 55.3; on one H100 box `auto` sized a 4-token share at the faster rate, and an A/B there cost it 15% of the
step (bench/results, 2026-12-07c). A call is fitted as rates.CallCost: a fixed cost (the launches, the routing's
sort) plus each distinct routed expert's bytes at in_place_gbs. Both reads of the share (io.SHARE_READS) are timed:
Marlin in place, and the routed experts gathered into GPU memory first (gather.share: 1.08-1.11x in place on 12-07e's
H100 box, where Marlin in place read 43 GB/s; another box's read 18.2); the faster one's call is the share's
(in_place_read: its index), and the launcher has the main stage read that way. Pure but for `measure` and the calls
it times."""
from __future__ import annotations

import math

from .io import SHARE_READS
from .rates import fit

TOKENS = (1, 2, 4, 8)  # the pod's small steps, where the cost model weighs a share against the pod's call
CALLS = 24  # timed calls per token count, routings in turn (each call's experts read from host memory)
GROUP = 128  # the w4a16 group the pod's formats hold (quantized.FORMATS); Marlin's layout in place needs the
# intermediate size a multiple of lcm(64, GROUP) (experts.marlin_in_place)


def shape_of(spec: str | None) -> tuple[int, int, int, int] | None:
    """(hidden, intermediate, experts, top_k) of rates.SPEC_ENV's value where the main stage would share in place:
    W4A16 experts Marlin lays out over their own stacks; else None (nothing to measure)."""
    if not spec:
        return None
    fmt, *dims = spec.split(":")
    hidden, inter, experts, top_k = map(int, dims)
    return (hidden, inter, experts, top_k) if fmt == "w4a16" and inter % math.lcm(64, GROUP) == 0 else None


def roles(hidden: int, inter: int) -> dict[str, tuple[tuple[int, int], str]]:
    """An expert's tensors as the loader writes a kept W4A16 layer's stacks (GPTQ's packing: 8 values a word)."""
    return {"w13": ((hidden // 8, 2 * inter), "int32"), "w2": ((inter // 8, hidden), "int32"),
            "w13_scale": ((hidden // GROUP, 2 * inter), "bfloat16"), "w2_scale": ((inter // GROUP, hidden), "bfloat16")}


def expert_bytes(hidden: int, inter: int) -> int:
    """One kept W4A16 expert's bytes over its roles."""
    import torch
    return sum(math.prod(s) * getattr(torch, dt).itemsize for s, dt in roles(hidden, inter).values())


def kept_marlin(inter: int, remote: list[int], num_experts: int):
    """quantized.Marlin for a kept W4A16 layer's stacks (symmetric int4, groups of GROUP), as patches.py keeps one:
    the vLLM module it reads is only its intermediate size (Marlin's padding)."""
    import types

    from compressed_tensors.quantization import QuantizationArgs

    from .quantized import Marlin
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    return Marlin(types.SimpleNamespace(intermediate_size_per_partition=inter), args, remote, num_experts)


def measure(spec: str | None, nbytes: int) -> dict[str, float]:
    """The fitted in-place call (in_place_call_s, in_place_gbs) on as many experts as `nbytes` holds (at least
    top_k; tokens routed among them at random, so a call's experts come from host memory, not the GPU's L2), and the
    fit's largest relative error; {} without CUDA or for experts the main stage does not share in place."""
    import torch
    if (shape := shape_of(spec)) is None or not torch.cuda.is_available():
        return {}
    import mmap

    from ...cpupod import memops
    hidden, inter, experts, top_k = shape
    layout = {r: (s, getattr(torch, dt)) for r, (s, dt) in roles(hidden, inter).items()}
    one = expert_bytes(hidden, inter)
    n = max(top_k, min(experts, nbytes // one))
    rooms = {r: -(-n * math.prod(s) * dt.itemsize // 4096) * 4096 for r, (s, dt) in layout.items()}
    buf = mmap.mmap(-1, sum(rooms.values()))  # page-aligned, as the region's shared memory is
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    memops.register(flat.data_ptr(), flat.numel(), mapped=True)  # as open_weights registers the region for a share
    try:
        by_read = _timed_calls(flat, rooms, layout, shape, n)
    finally:  # the mapping goes with this call: a pinned range left behind fails the next one's register
        torch.cuda.synchronize()
        memops.unregister(flat.data_ptr())
    if not by_read:
        return {}
    # the share reads the way its calls took least time in all (the small steps alike: a step's later part waits)
    read = min(by_read, key=lambda r: sum(s for _, _, s in by_read[r]))
    fits = {r: fit(p, one) for r, p in by_read.items()}
    points, cost = by_read[read], fits[read]
    error = max(abs(cost.seconds(e, p, one) / s - 1) for e, p, s in points)
    return {"in_place_call_s": cost.call_s, "in_place_gbs": cost.expert_gbs, "in_place_pair_s": cost.pair_s,
            "in_place_experts_held": float(n), "in_place_fit_error": round(error, 3),
            "in_place_one_token_ms": round(points[0][2] * 1e3, 4), "in_place_read": float(SHARE_READS.index(read)),
            **{f"in_place_{r}_gbs": f.expert_gbs for r, f in fits.items()},
            **{f"in_place_{r}_one_token_ms": round(p[0][2] * 1e3, 4) for r, p in by_read.items()}}


def _timed_calls(flat, rooms: dict, layout: dict, shape: tuple[int, int, int, int], n: int) -> dict[str, list]:
    """By the share's read (SHARE_READS), (distinct experts, routed pairs, seconds) of its call at each of TOKENS on n
    experts laid out in `flat` (registered and mapped), all n shared: Marlin reading them in place, or gathering the
    routed ones into GPU memory first (gather.share); {} where Marlin cannot lay them out in place."""
    import torch

    from ...cpupod import memops
    from . import gather
    hidden, inter, experts, top_k = shape
    g, region, at = torch.Generator().manual_seed(0), {}, 0
    for role, (dims, dt) in layout.items():
        region[role] = flat[at:at + n * math.prod(dims) * dt.itemsize].view(dt).view(n, *dims)
        if dt == torch.int32:  # one expert's random words in every one (the time does not depend on the values)
            region[role].copy_(torch.randint(-2**31, 2**31 - 1, (1, *dims), dtype=dt, generator=g).expand(n, *dims))
        else:
            region[role].fill_(0.001)
        at += rooms[role]
    dev = torch.device("cuda")
    marlin = kept_marlin(inter, list(range(n)), experts)
    if not marlin.lay_out(region, dev):
        return {}
    views = {role: memops.as_device(t) for role, t in region.items()}  # what InPlace reads: the region over PCIe
    everyone = list(range(n))
    buf = torch.empty(gather.slot_bytes(views, n), dtype=torch.uint8, device=dev)
    calls = {"in_place": lambda x, i, w: marlin(x, i, w, views),
             "gather": gather.share(marlin, views, everyone, everyone, experts, buf)}
    assert set(calls) == set(SHARE_READS)
    start, end, out = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), {}
    for tokens in TOKENS:
        routes = [torch.stack([torch.randperm(n, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
                  for _ in range(CALLS)]
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
        weights = torch.rand(tokens, top_k, generator=g).softmax(-1).to(dev)
        ids = [r.to(dev) for r in routes]
        distinct = sum(len(set(r.flatten().tolist())) for r in routes) / CALLS
        for read, call in calls.items():
            call(x, ids[-1], weights)  # warms up: Marlin's workspace, the map on the GPU, Triton's compile
            torch.cuda.synchronize()
            start.record()
            for i in ids:
                call(x, i, weights)
            end.record()
            end.synchronize()
            out.setdefault(read, []).append((distinct, tokens * top_k, start.elapsed_time(end) / 1e3 / CALLS))
    return out
