"""strategy experts, the main stage's side: the routed experts that do not fit its device live once in the CPU pod's
region; its loader writes them there (patches.py) and keeps only its own experts in the layer's parameters, under an
expert map in which the remote ones are -1 (vLLM's expert-parallel path skips them). Decode-sized steps hand the
remote experts' tokens to the CPU pod (io.py); larger steps compute them here from the region. On CUDA the hand-over
is stream memory operations (memops), so CUDA graphs capture it; on CPU (tests) the same protocol with plain stores."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ...cpupod import hostmem
from ...cpupod.packed import unpack
from ...cpupod.server import RegionClient, closed
from . import gather, quantized
from .io import (
    BYTES_ENV,
    COUNTS_ENV,
    COUNTS_EVERY_ENV,
    DEFAULT_MAX_ROWS,
    DONE,
    KEEP_ENV,
    LAYER,
    LINE,
    MAX_ROWS_ENV,
    REMOTE_ENV,
    REQ,
    SHARE_READ_ENV,
    SHARE_READS,
    SOCKET_ENV,
    UVA_SHARE_ENV,
    IoLayout,
    IoViews,
    load_counts,
    parse_placement,
    parse_shares,
)
from .kernels import compute

log = logging.getLogger("vllm_hybrid.experts")


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
        from ...cpupod import memops
        self.io, self.memops = io, memops
        self.dev, (self.req, self.layer, self.done) = memops.device_words(io.raw, LINE, (REQ, LAYER, DONE))

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
    # quantized experts (quantized.FORMATS' name): the region holds their tensors by role (w13, w13_scale, ...) as
    # vLLM's loader writes them (also `stacks`, in that order); the server prepares its own copy. Kept (`nearby`):
    # large steps copy them to the GPU and compute them there (`large`); else the server frees these pages and computes
    # every step of the layer, large ones in parts
    fmt: str | None = None
    tensors: dict[str, torch.Tensor] | None = None
    nearby: bool = False
    dtype: torch.dtype = torch.bfloat16  # the activations' (dequantized experts are computed in it)
    large: quantized.Marlin | None = None  # kept, on CUDA: f(x, ids, weights, the staged tensors by role)
    # shares of the experts the main stage computes at the pod's steps too: (steps of up to this many tokens, InPlace;
    # None: that size's share took none of the layer's)
    in_place: list[tuple[int, InPlace | None]] = field(default_factory=list)
    num_experts: int = 0  # the layer's, global ids 0 .. num_experts - 1

    @property
    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(w13, w2) in the region, per remote expert."""
        return list(zip(*self.stacks))

    def plain(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(w13, w2) per expert on `device`, unpacked if the server packed them."""
        if self.packed is None and self.fmt is None and device.type == "cpu":
            return self.weights
        return self.unpacked(self.copy_to(device))

    def copy_to(self, device: torch.device) -> list[torch.Tensor]:
        """The stacks copied to `device` on the current stream (the region is page-locked where it is CUDA)."""
        return [s.to(device, non_blocking=True) for s in self.stacks]

    def unpacked(self, stacks: Sequence[torch.Tensor]) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
        """(w13, w2) per expert of the stacks' copies: unpacked if the server packed them, dequantized if quantized."""
        if self.fmt is not None:
            return quantized.Dequantized(self.fmt, dict(zip(self.tensors, stacks)), self.dtype)
        return Unpacked(stacks, self.packed) if self.packed else list(zip(*stacks))


def spread(ids: Sequence[int], share: float) -> list[int]:
    """About `share` of ids, evenly through the list (the placement orders them by routing counts where it had any)."""
    return [e for i, e in enumerate(ids) if int((i + 1) * share + 1e-9) > int(i * share + 1e-9)]


@dataclass
class InPlace:
    """Some of a layer's remote experts, computed by the main stage at the CPU pod's steps, from their stacks where
    they are (on CUDA: Marlin's layout in the region, read over PCIe through a mapped view; elsewhere the region's
    plain weights), while the pod computes the others: at a decode step both read DRAM at once, where either alone
    reached half of it (the 235B's pod: 45 GB/s at one token on a 90-120 GB/s box)."""
    ids: list[int]
    pod_skips: torch.Tensor  # bool over the layer's global ids: the pod is sent these as one id it does not hold
    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # f(x, ids, weights): their sum
    absent: int = 0  # the id the pod is sent instead (past every remote id: its local index maps it to -1)

    def for_pod(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pod_skips.device != ids.device:
            self.pod_skips = self.pod_skips.to(ids.device)
        return ids.masked_fill(self.pod_skips[ids.long()], self.absent)


class Unpacked:
    """A layer's packed stacks as (w13, w2) per expert, each unpacked when kernels.compute reads it: one expert's copy
    at a time, not the layer's (the planner stages two layers' stacks and one expert on the GPU)."""

    def __init__(self, stacks: Sequence[torch.Tensor], kernel: str):
        self.stacks, self.kernel = stacks, kernel

    def __len__(self) -> int:
        return self.stacks[0].shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(unpack(s[i], self.kernel) for s in self.stacks)


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
        self.keep = False  # the plan leaves the CPU pod room to keep W4A16 stacks for large steps here (KEEP_ENV)
        self.uva_shares: list[tuple[int, float]] = []  # UVA_SHARE_ENV, parsed
        self.dev_flat: torch.Tensor | None = None  # the region as the GPU reads it in place (mapped: InPlace)
        self.share_read = "in_place"  # SHARE_READ_ENV
        self.gathered: torch.Tensor | None = None  # gather's GPU buffer: one, every layer's share in turn (one stream)
        self.layers: dict[int, Held] = {}
        self.local: dict[int, Callable] = {}  # layer -> its main-stage experts: f(x, topk_weights, topk_ids)
        self.side: CpuSide | GpuSide | None = None
        self.dtype = self.top_k = self.hidden = None
        self.counts = RoutingCounts(None)
        # large steps on CUDA: the next layer's remote experts copied in on a side stream while this one computes,
        # into two fixed slots taken in turn (a fresh buffer a layer let torch's allocator hold one for every layer
        # the launches ran ahead of the GPU: an H200 lease's 235B main stage read 100 GB with an 80 GiB budget)
        self.copy_stream = None
        self.slots: list[list[torch.Tensor]] = []  # per slot, a byte buffer per stack, as large as the largest layer's
        self.next_slot = 0
        self.staged: tuple[int, list[torch.Tensor], object] | None = None

    def open_weights(self, nbytes: int, page_lock: bool | None = None) -> str:
        lock = self.device == "cuda" if page_lock is None else page_lock  # large steps copy from it
        mapped = lock and any(share > 0 for _, share in self.uva_shares)  # InPlace reads it
        return super().open_weights(nbytes, lock, mapped=mapped)

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
        self.layers[layer] = Held(ids, (w13, w2), num_experts=num_experts)
        return self.layers[layer]

    def hold_quantized(self, layer: int, fmt: str, roles: dict[str, torch.Tensor], hidden: int, dtype: torch.dtype,
                       top_k: int, num_experts: int) -> dict[str, torch.Tensor]:
        """Region storage for layer's remote experts in a quantized format: one stack per role, like `roles` (meta
        tensors of E x ...), which the loader fills in place."""
        self.dtype, self.top_k, self.hidden = dtype, top_k, hidden
        self.counts.track(layer, num_experts, self.device)
        tensors = {role: self.take(like) for role, like in roles.items()}
        self.layers[layer] = Held(self.remote[layer], tuple(tensors.values()), fmt=fmt, tensors=tensors,
                                  nearby=self.keeps(fmt), dtype=dtype, num_experts=num_experts)
        return tensors

    def keeps(self, fmt: str) -> bool:
        """Large steps of `fmt` layers computed here from the region (kept, page-locked) rather than by the pod."""
        return self.keep and self.device == "cuda" and fmt in quantized.DEQUANTIZED

    def expert(self, layer: int, gid: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.layers[layer]
        return held.weights[held.ids.index(gid)]

    def publish(self) -> int:
        """Tell the CPU pod where each remote expert's weights are; map the io region it returns. Its threads."""
        base = self.flat.data_ptr()
        loc = lambda t: [t.data_ptr() - base, *t.shape]

        def entry(layer: int, h: Held) -> dict:
            if h.fmt is None:
                return {"layer": layer, "experts": [{"id": e, "w13": loc(w13), "w2": loc(w2)}
                                                    for e, (w13, w2) in zip(h.ids, h.weights)]}
            return {"layer": layer, "ids": h.ids, "format": h.fmt, "keep": h.nearby,
                    "tensors": {role: [str(t.dtype).removeprefix("torch."), *loc(t)] for role, t in h.tensors.items()}}
        reply, self.io_map, nbytes = self._ask_region({
            "dtype": str(self.dtype).removeprefix("torch."), "max_rows": self.max_rows, "top_k": self.top_k,
            "hidden": self.hidden, "layers": [entry(layer, h) for layer, h in sorted(self.layers.items())]})
        for layer, kernel in reply.get("packed", {}).items():
            self.layers[int(layer)].packed = kernel
        raw = torch.frombuffer(self.io_map, dtype=torch.uint8)
        io = IoViews(raw, IoLayout(self.max_rows, self.hidden, self.top_k, self.dtype.itemsize), self.dtype)
        if self.device == "cuda":
            self.page_lock(raw, nbytes)
            self.side = GpuSide(io)
        else:
            self.side = CpuSide(io, alive=lambda: not closed(self.sock))
        return reply["threads"]

    def lay_out_kept(self) -> tuple[int, float]:
        """After publish (the CPU pod has prepared its own copy of every layer, and reads the region's no more): kept
        layers' stacks rewritten in their large steps' kernel layout (Marlin.lay_out), so a step copies and computes.
        (layers laid out, seconds)."""
        t0, kept = time.perf_counter(), [h for h in self.layers.values() if h.large is not None]
        done = sum(h.large.lay_out(h.tensors, torch.device(self.device)) for h in kept)
        if kept:
            torch.cuda.empty_cache()  # the layers' transient copies: not the memory profile's to keep
        return done, time.perf_counter() - t0

    def share_in_place(self, shares: float | list[tuple[int, float]] | None = None) -> int:
        """After lay_out_kept: a share of each layer's remote experts computed here at the pod's steps (InPlace), by
        the step's tokens (parse_shares; a number: every step), where the main stage reads their stacks: on CUDA, the
        layers laid out for Marlin; on CPU (tests), bf16 layers and kept ones. A step size whose share takes none of a
        layer's experts keeps None there (its steps are the pod's alone, not the next size's). The layers given a
        share."""
        shares = self.uva_shares if shares is None else shares
        shares = [(self.max_rows, shares)] if isinstance(shares, float | int) else shares
        if self.device == "cuda" and self.share_read == "gather":  # one buffer, as large as the largest share's
            # (grown layer by layer instead, the earlier layers' slots would hold each smaller buffer alive)
            need = max((gather.slot_bytes(h.tensors, len(spread(h.ids, share)))
                        for h in self.layers.values() if h.large is not None and h.large.laid_out is not None
                        for _, share in shares), default=0)
            self.gathered = torch.empty(need, dtype=torch.uint8, device=self.device) if need else None
        done = 0
        for held in self.layers.values():
            held.in_place = []
            for rows, share in shares:
                ids = spread(held.ids, share)
                held.in_place.append((rows, self.in_place_of(held, ids) if ids else None))
            done += any(ip for _, ip in held.in_place)
        return done

    def in_place_of(self, held: Held, ids: list[int]) -> InPlace | None:
        skips = torch.zeros(held.num_experts, dtype=torch.bool)
        skips[ids] = True
        absent = held.num_experts
        if self.device == "cuda":
            if held.large is None or held.large.laid_out is None:
                return None
            from ...cpupod import memops
            if self.dev_flat is None:
                self.dev_flat = memops.as_device(self.flat)  # the region registered mapped (open_weights)
            base = self.flat.data_ptr()
            views = {role: self.dev_flat[t.data_ptr() - base:][:t.nbytes].view(t.dtype).view(held.large.laid_out[role])
                     for role, t in held.tensors.items()}
            if self.share_read == "gather":
                return InPlace(ids, skips, self.gathered_share(held, ids, views), absent)
            large, emap = held.large, held.large.map_of(ids).to(self.device)
            return InPlace(ids, skips, lambda x, i, w: large(x, i, w, views, expert_map=emap), absent)
        if held.fmt is not None and not held.nearby:
            return None  # the pod gave the region's pages back
        picked = [held.ids.index(e) for e in ids]

        def compute_here(x, topk_ids, topk_weights):
            plain = held.plain(x.device)
            return compute(x, topk_ids, topk_weights, [plain[i] for i in picked], ids)
        return InPlace(ids, skips, compute_here, absent)

    def gathered_share(self, held: Held, ids: list[int], views: dict[str, torch.Tensor]) -> Callable:
        """InPlace's compute with SHARE_READ_ENV=gather (gather.share): a step's routed experts of `ids` gathered
        from the mapped region (views) into one slot each of the GPU buffer, then Marlin reads them there."""
        need = gather.slot_bytes(views, len(ids))
        if self.gathered is None or self.gathered.numel() < need:  # share_in_place sized it, else
            self.gathered = torch.empty(need, dtype=torch.uint8, device=self.device)
        return gather.share(held.large, views, [held.ids.index(e) for e in ids], ids, held.num_experts, self.gathered)

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
            stacks = [dst.copy_(src, non_blocking=True) for dst, src in zip(self.slot(layer, x.device), held.stacks)]
        following = min((n for n in self.layers if n > layer), default=None)
        if following is not None:
            self.staged = self.prefetch(following, x.device)
        if held.large is not None:
            return held.large(x, ids, weights, dict(zip(held.tensors, stacks)))
        return compute(x, ids, weights, held.unpacked(stacks), held.ids)

    def slot(self, layer: int, device: torch.device) -> list[torch.Tensor]:
        """The next staging slot, as views shaped like layer's stacks (the slots are made at the first large step:
        vLLM's memory profile counts them)."""
        if not self.slots:
            stacks = [h.stacks for h in self.layers.values()]
            sizes = [max(s[i].nbytes for s in stacks if i < len(s)) for i in range(max(map(len, stacks)))]
            self.slots = [[torch.empty(n, dtype=torch.uint8, device=device) for n in sizes] for _ in range(2)]
        buffers, self.next_slot = self.slots[self.next_slot], 1 - self.next_slot
        return [b[:s.nbytes].view(s.dtype).view(s.shape) for b, s in zip(buffers, self.layers[layer].stacks)]

    def prefetch(self, layer: int, device: torch.device) -> tuple[int, list[torch.Tensor], object]:
        """Start copying layer's remote experts in on the side stream: (layer, the copies, their event)."""
        main = torch.cuda.current_stream()
        self.copy_stream = self.copy_stream or torch.cuda.Stream()
        stacks = self.slot(layer, device)
        self.copy_stream.wait_stream(main)  # the slot's last reader, two layers back, is queued there by now
        with torch.cuda.stream(self.copy_stream):
            for dst, src in zip(stacks, self.layers[layer].stacks):
                dst.copy_(src, non_blocking=True)
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
        if self.side is None:
            raise RuntimeError("strategy experts: the manifest was not published (a model loader without "
                               "BaseModelLoader.load_model?)")
        if not 0 < rows <= self.max_rows:
            self.counts.add(layer, topk_ids)
            if self.layers[layer].fmt is not None and not self.layers[layer].nearby:
                return self.in_parts(layer, x, topk_weights, topk_ids, local)
            return local(x, topk_weights, topk_ids) + self.nearby(layer, x, topk_ids, topk_weights)
        # the step's share by its tokens (a CUDA graph is captured per step size: one branch each)
        in_place = next((ip for most, ip in self.layers[layer].in_place if rows <= most), None)
        if in_place is not None and len(in_place.ids) == len(self.layers[layer].ids):  # nothing left for the pod
            self.counts.add(layer, topk_ids)
            return local(x, topk_weights, topk_ids) + in_place.compute(x, topk_ids, topk_weights)
        self.side.submit(layer, x, topk_ids if in_place is None else in_place.for_pod(topk_ids), topk_weights)
        self.counts.add(layer, topk_ids)  # after the hand-over: the pod starts its step a few kernels sooner
        out = local(x, topk_weights, topk_ids)
        if in_place is not None:  # while the pod computes the rest
            out = out + in_place.compute(x, topk_ids, topk_weights)
        return out + self.side.collect(layer, rows)

    def in_parts(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 local: Callable) -> torch.Tensor:
        """A large step of a quantized layer: the CPU pod computes its remote experts max_rows tokens at a time (only
        it holds them), the first part while the main stage computes its own experts over all the tokens."""
        parts = [slice(start, start + self.max_rows) for start in range(0, x.shape[0], self.max_rows)]
        if not parts:  # no tokens
            return local(x, topk_weights, topk_ids)
        send = lambda part: self.side.submit(layer, x[part], topk_ids[part], topk_weights[part])  # noqa: E731
        send(parts[0])
        out = local(x, topk_weights, topk_ids)
        for i, part in enumerate(parts):
            out[part] += self.side.collect(layer, x[part].shape[0])  # read before the next part reuses the buffer
            if i + 1 < len(parts):
                send(parts[i + 1])
        return out


CLIENT: Client | None = None


def client_from_env(device: str, env=os.environ) -> Client:
    """The process's client, connected on first use (the first MoE layer with remote experts)."""
    global CLIENT
    if CLIENT is None:
        client = Client(parse_placement(env.get(REMOTE_ENV, "")), int(env.get(MAX_ROWS_ENV, DEFAULT_MAX_ROWS)), device)
        client.keep = env.get(KEEP_ENV) == "1"
        client.uva_shares = parse_shares(env.get(UVA_SHARE_ENV, ""))
        client.share_read = env.get(SHARE_READ_ENV) or "in_place"
        if client.share_read not in SHARE_READS:
            raise ValueError(f"{SHARE_READ_ENV}={client.share_read!r}: one of {', '.join(SHARE_READS)}")
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
