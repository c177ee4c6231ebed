"""strategy coprocessor, the GPU worker's side. The GPU stage runs every layer; the CPU pods are matrix-product
co-processors.

The CPU-resident layers' weights live once, in a region the CPU pod owns (hostmem: a memfd on its NUMA
node, 2 MiB pages where it has them). The GPU process maps and registers that region, and vLLM's prefetch
offloader streams those layers from it (patches.py). For a step of at most `max_rows`
tokens, each product of such a layer is split by rows: the offloader copies only rows [0, n0) of the
weight and the GPU computes them, while the CPU pod computes rows [n0, N) from the same memory. Larger
steps (prompt chunks) stream every row, as the plain offloader does; attention, norms and the KV cache
stay on the GPU for every token (docs/design-gpu-prefill.md, design B).

W8A8 INT8 checkpoints (int8.py): each int8 weight gets a room of N x (K + 4) bytes, which the CPU pod packs in place
for its int8 GEMM; the offloader's GPU buffer is that room's size, the layer's weight the plain rows at its start
(unpacked after each copy), and the GPU computes its rows as vLLM's CUTLASS W8A8 kernel does.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ...cpupod import packed
from ...cpupod.server import RegionClient
from . import int8
from .io import DONE, LINE, MAX_ROWS, PRODUCT, REQ, TUNE_ENV, IoLayout, IoViews, encode
from .shares import DEFAULT_SHARES, measured_shares, parse_shares, rows_of, shape_key, share_for

log = logging.getLogger("vllm_hybrid.coprocessor")


class GpuSide:
    """The GPU process's end of an io region: device pointers of the words, in-place device views of x, y."""

    def __init__(self, io: IoViews):
        from ...cpupod import memops
        self.io, self.memops = io, memops
        self.dev, (self.req, self.product, self.done) = memops.device_words(io.raw, LINE, (REQ, PRODUCT, DONE))

    def linear(self, j: int, x: torch.Tensor, w_rows: torch.Tensor, n: int,
               scale_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T for product j, W's rows [0, n0) given on the GPU (w_rows; int8 ones with their scales), the rest
        computed by the CPU pod."""
        rows, k = x.shape
        n0 = w_rows.shape[0]
        mo = self.memops
        torch.mul(x, 1, out=self.io.x(j, rows, k, self.dev))  # a kernel writes host memory; copy_ might take the DMA engine
        mo.write(self.product, j)
        mo.write(self.req, encode(rows, n0))
        y0 = None if not n0 else (torch.nn.functional.linear(x, w_rows) if scale_rows is None
                                  else int8_mm(x, w_rows, scale_rows))
        mo.wait(self.done, 1)
        mo.write(self.done, 0)
        y = self.io.y(j, rows, n - n0, self.dev)
        return torch.cat([y0, y], dim=-1) if n0 else y.clone()  # the io buffer is the next product but one's


def int8_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W.T for int8 W (rows x K) with a scale per row, as vLLM's CUTLASS W8A8 kernel computes it
    (CutlassInt8ScaledMMLinearKernel.apply_weights: x quantized per token, symmetric)."""
    from vllm import _custom_ops as ops
    xq, xs, _ = ops.scaled_int8_quant(x.contiguous(), None, None, symmetric=True)
    return ops.cutlass_scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale, out_dtype=x.dtype)


def tune_split(forced: bool) -> bool:
    """HYBRID_COPROC_TUNE: unset, tune a measured split on timed passes (tune.py), not one HYBRID_COPROC_SHARES
    forced; 1: tune that one too (it is where the search starts); 0: never."""
    value = os.environ.get(TUNE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{TUNE_ENV}={value!r}: 0 or 1 (unset: tune a measured split)")
    return value == "1" or (value == "" and not forced)


def measure_copy(flat: torch.Tensor, nbytes: int, chunk: int = 64 << 20) -> float:
    """GB/s the GPU copies from the (page-locked) region at, over up to 1 GiB of its first `nbytes`: what the
    offloader's prefetch does."""
    chunk = max(1, min(chunk, nbytes, flat.numel()))
    count, span = max(1, min(nbytes, 1 << 30) // chunk), min(nbytes, flat.numel()) - chunk + 1
    dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    dst.copy_(flat[:chunk], non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(count):
        off = i * chunk % span
        dst.copy_(flat[off:off + chunk], non_blocking=True)
    end.record()
    end.synchronize()
    return round(count * chunk / (start.elapsed_time(end) / 1e3) / 1e9, 2)


@dataclass
class Product:
    cpu: torch.Tensor   # the weight in the shared region (int8: its room, N x (K + 4) bytes)
    boundary: bool      # prefetched across steps: always n0_fixed rows ahead
    n0_fixed: int
    table: list[tuple[int, float]]  # its shares by step size
    layer: int = 0      # the streamed layer it belongs to (the offloader copies a layer's products together)
    buffer: torch.Tensor | None = None  # the offloader's GPU buffer it is copied into (slot layer % prefetch_step)
    plain_rows: int = 0  # rows of the buffer unpacked ahead (unpack_ahead) for its next use; 0: unpack at use
    scale: torch.Tensor | None = None      # int8: its rows' scales in the region (N float32)
    gpu_scale: torch.Tensor | None = None  # int8: the layer's weight_scale (the offloader's GPU copy of those)
    act_dtype: torch.dtype | None = None   # int8: the layer's activations (the io buffers')

    @property
    def n(self) -> int:
        return self.cpu.shape[0]

    @property
    def is_int8(self) -> bool:
        return self.scale is not None

    @property
    def shape(self) -> tuple[int, int]:
        """N x K of the product (an int8 room's extra 4 bytes a row are not K)."""
        return self.n, self.cpu.shape[1] - (packed.INT8_EXTRA if self.is_int8 else 0)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (x and y in the io region)."""
        return self.act_dtype or self.cpu.dtype

    @property
    def nbytes(self) -> int:
        n, k = self.shape
        return n * k * (1 if self.is_int8 else self.cpu.element_size())


class Client(RegionClient):
    """The GPU worker's session with its CPU pod: the weights region it loads into, the io region, the split."""
    server = "strategy coprocessor: the product server"

    def __init__(self, shares: str | None = None):
        super().__init__()
        self.forced = shares is not None  # HYBRID_COPROC_SHARES: no measured split
        self.shares = parse_shares(shares or DEFAULT_SHARES)
        self.max_rows = self.shares[-1][0]  # the io buffers' rows: no step larger than this is ever split
        self.rows = MAX_ROWS + 1  # the current step's tokens (set by every split product; larger: stream all)
        self.products: list[Product] = []
        self.gpu: GpuSide | None = None
        self.measured: dict = {}
        self.packed: str | None = None  # the CPU pod packed the products for this kernel: the GPU unpacks its copies
        self.tuned = None  # tune.Tuned: the passes timed at start
        self.unpack_stream: torch.cuda.Stream | None = None  # unpack_ahead's
        self.int8_rooms: dict[int, torch.Tensor] = {}  # an int8 weight's room in the region, by its data pointer

    def open_weights(self, nbytes: int) -> str:
        return super().open_weights(nbytes, page_lock=True)  # the copy stream DMAs from it

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """Room in the region for a tensor like `like` (contiguous, 4 KiB aligned); None when it is full. An int8
        weight (whole 32-row blocks, K in quads) gets room for its packed layout (int8.py), its plain rows first."""
        if not like.is_contiguous():
            return None
        n, k = like.shape if like.ndim == 2 else (0, 0)
        if like.dtype != torch.int8 or not n or n % packed.INT8_BLOCK or k % 4:
            return self.room(like)
        room = self.room(torch.empty(n, k + packed.INT8_EXTRA, dtype=torch.int8, device="meta"))
        if room is None:
            return None
        self.int8_rooms[room.data_ptr()] = room
        return packed.int8_plain_rows(room)

    def int8_room(self, t: torch.Tensor) -> torch.Tensor | None:
        """The room an int8 weight given out by take() lies at (t: those plain rows, or their transpose)."""
        return self.int8_rooms.get(t.data_ptr()) if t.dtype == torch.int8 else None

    def holds(self, t: torch.Tensor) -> bool:
        base = self.flat.data_ptr()
        return t.device.type == "cpu" and base <= t.data_ptr() < base + self.wbytes

    def add_product(self, weight_cpu: torch.Tensor, boundary: bool, layer: int = 0,
                    buffer: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                    gpu_scale: torch.Tensor | None = None, act_dtype: torch.dtype | None = None) -> int:
        """A split product: its weight in the region (an int8 one's room, with its scales there and on the GPU)."""
        self.products.append(Product(weight_cpu, boundary, 0, self.shares, layer, buffer, 0, scale, gpu_scale,
                                     act_dtype))
        self.fix_boundary(self.products[-1])
        return len(self.products) - 1

    @staticmethod
    def fix_boundary(p: Product) -> None:
        # prefetched before the next step's size is known: the decode share (one token), or every row if decode
        # steps are not split
        share = share_for(p.table, 1)
        p.n0_fixed = p.n if share is None else rows_of(p.n, share)

    def publish(self, depth: int = 1) -> int:
        """Tell the CPU pod where each product's weight is; map the io region it returns; split by what both ends
        measured (the CPU pod's rates come with the reply), then tune that split on passes timed with the copy
        `depth` layers ahead (tune.py). Its thread count."""
        dtype, is_int8 = self.products[0].dtype, self.products[0].is_int8
        base = self.flat.data_ptr()
        reply, self.io_map, nbytes = self._ask_region({
            "dtype": str(dtype).removeprefix("torch."), "max_rows": self.max_rows,
            **({"format": int8.FORMAT} if is_int8 else {}),
            "products": [[p.cpu.data_ptr() - base, *p.shape, *([p.scale.data_ptr() - base] if is_int8 else [])]
                         for p in self.products]})
        raw = torch.frombuffer(self.io_map, dtype=torch.uint8)
        self.page_lock(raw, nbytes)
        layout = IoLayout.for_shapes([p.shape for p in self.products], self.max_rows, dtype.itemsize)
        self.gpu = GpuSide(IoViews(raw, layout, dtype))
        self.measured = dict(reply.get("measured") or {})
        self.packed = reply.get("packed")
        if self.measured:
            self.measured["copy_gbs"] = measure_copy(self.flat, self.used)
        self.split_by_measured()
        if self.measured and tune_split(self.forced):
            self.tune(depth)
        return reply["threads"]

    def tune(self, depth: int) -> None:
        from .tune import tune
        if any(p.table for p in self.products) and all(p.buffer is not None for p in self.products):
            self.tuned = tune(self, depth)  # else nothing is split: every step streams

    def split_by_measured(self) -> None:
        """Each product's shares from the measured copy and CPU rates of its shape (unless forced)."""
        rates, copy = self.measured.get("products_gbs") or {}, self.measured.get("copy_gbs")
        if self.forced or not copy:
            return
        for p in self.products:
            if (by_rows := rates.get(shape_key(*p.shape))) is not None:
                p.table = [(b, s) for b, s in measured_shares(copy, {int(t): v for t, v in by_rows.items()})
                           if b <= self.max_rows]
                self.fix_boundary(p)

    def tables(self) -> dict[str, list[tuple[int, float]]]:
        """The split per product shape (for the log)."""
        return {shape_key(*p.shape): p.table for p in self.products}

    def n0(self, j: int, rows: int) -> int | None:
        """Rows [0, n0) of product j the GPU copies and computes in a step of `rows` tokens; None: not split."""
        p = self.products[j]
        share = share_for(p.table, rows)
        if share is None:
            return None
        return p.n0_fixed if p.boundary else rows_of(p.n, share)

    def prefetch_rows(self, j: int) -> int:
        """Rows of product j's weight the offloader copies ahead for the current step."""
        p = self.products[j]
        return p.n0_fixed if p.boundary else (self.n0(j, self.rows) or p.n)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, j: int) -> torch.Tensor:
        rows = x.shape[0]
        self.rows = rows
        p = self.products[j]
        if (n0 := self.n0(j, rows)) is not None and n0 < p.n:
            return self.gpu.linear(j, x, self.plain(weight[:n0], j), p.n)
        if p.boundary:  # its prefetch held n0_fixed rows: the rest now, on this stream
            weight[p.n0_fixed:].copy_(p.cpu[p.n0_fixed:], non_blocking=True)
        return torch.nn.functional.linear(x, self.plain(weight, j))

    def linear_int8(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """linear() for an int8 product: its weight is the buffer's plain rows (unpacked after the copy), its scales
        the layer's weight_scale."""
        rows = x.shape[0]
        self.rows = rows
        p = self.products[j]
        if (n0 := self.n0(j, rows)) is not None and n0 < p.n:
            return self.gpu.linear(j, x, self.plain_int8(j, n0), p.n, p.gpu_scale[:n0])
        if p.boundary:  # its prefetch held n0_fixed rows: the rest now, on this stream
            src, dst = self.copy_views(j, p.n, p.n0_fixed)
            dst.copy_(src, non_blocking=True)
        return int8_mm(x, self.plain_int8(j, p.n), p.gpu_scale)

    def pass_linear(self, j: int, x: torch.Tensor, n0: int) -> torch.Tensor:
        """Product j with its first n0 rows on the GPU (as copied into its buffer; n0 = N: every row there), for
        tuning's timed passes."""
        p = self.products[j]
        if p.is_int8:
            w = self.plain_int8(j, n0)
            return self.gpu.linear(j, x, w, p.n, p.gpu_scale[:n0]) if n0 < p.n else int8_mm(x, w, p.gpu_scale)
        if n0 < p.n:
            return self.gpu.linear(j, x, self.plain(p.buffer[:n0]), p.n)
        return torch.nn.functional.linear(x, self.plain(p.buffer))

    def copy_views(self, j: int, stop: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, stop) of product j in the region and in its GPU buffer, as the copy takes them: an int8 room
        kept plain (torch's kernel on the CPU pod) has its rows in the room's first N x K bytes."""
        p = self.products[j]
        if p.is_int8 and self.packed != "sgl-int8":
            return packed.int8_plain_rows(p.cpu)[start:stop], packed.int8_plain_rows(p.buffer)[start:stop]
        return p.cpu[start:stop], p.buffer[start:stop]

    def plain_int8(self, j: int, rows: int) -> torch.Tensor:
        """Product j's first `rows` rows, plain, where they lie in its buffer: unpacked in place unless unpack_ahead
        did it for this use."""
        p = self.products[j]
        view = packed.int8_plain_rows(p.buffer)[:rows]
        if self.packed != "sgl-int8" or not rows:
            return view
        if ahead := p.plain_rows:
            p.plain_rows = 0
            if ahead != rows:  # never: prefetch and use take the same step's rows
                raise RuntimeError(f"coprocessor: product {j}: {ahead} rows unpacked ahead, {rows} used")
            return view
        return packed.unpack_int8_in_place(p.buffer[:rows])

    def plain(self, rows: torch.Tensor, j: int | None = None) -> torch.Tensor:
        """Rows of a weight as copied, in the plain layout (whole blocks of a packed one: cpupod/packed.py); those of
        product j unpacked ahead for this use (unpack_ahead) as they are."""
        if not self.packed or not rows.shape[0]:
            return rows
        if j is not None and (ahead := self.products[j].plain_rows):
            self.products[j].plain_rows = 0
            if ahead != rows.shape[0]:  # never: prefetch and use take the same step's rows
                raise RuntimeError(f"coprocessor: product {j}: {ahead} rows unpacked ahead, {rows.shape[0]} used")
            return rows
        return packed.unpack(rows, self.packed)

    def unpacks_ahead(self, j: int, rows: int) -> bool:
        """Whether the offloader's copy of product j's first `rows` rows, this step, is unpacked on unpack_ahead's
        stream: a packed region's, except the boundary layers' (prefetched for a step of a size not known yet)."""
        return bool(self.packed) and rows > 0 and not self.products[j].boundary

    def unpack_ahead(self, copies: list[tuple[int, torch.Tensor]], copy_stream: torch.cuda.Stream
                     ) -> torch.cuda.Stream:
        """Unpack rows of a packed region the copy stream just fetched (product j, its buffer rows) in place, on a
        stream of their own once the copy lands: the compute stream only waits for them (at 64 tokens a step the
        GPU unpacking every streamed weight itself cost 3-4% against the offloader), and the copy stream goes on
        to the next layer. Returns the stream whose work the layer's copy-done event must follow."""
        if self.unpack_stream is None:
            self.unpack_stream = torch.cuda.Stream()
        copied = torch.cuda.Event()
        copied.record(copy_stream)
        self.unpack_stream.wait_event(copied)
        with torch.cuda.stream(self.unpack_stream):
            for j, rows in copies:
                if self.packed == "sgl-int8":
                    packed.unpack_int8_in_place(rows)
                else:
                    packed.unpack_in_place(rows, self.packed)
                self.products[j].plain_rows = rows.shape[0]
        return self.unpack_stream


CLIENT: Client | None = None


@torch.library.custom_op("hybrid::coproc_linear", mutates_args=())
def coproc_linear(x: torch.Tensor, weight: torch.Tensor, product: int) -> torch.Tensor:
    # opaque to torch.compile; under CUDA graphs its memops and kernels are captured and replayed
    x2 = x.reshape(-1, x.shape[-1])
    return CLIENT.linear(x2, weight, product).view(*x.shape[:-1], weight.shape[0])


@coproc_linear.register_fake
def _(x, weight, product):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hybrid::coproc_linear_int8", mutates_args=())
def coproc_linear_int8(x: torch.Tensor, weight: torch.Tensor, product: int) -> torch.Tensor:
    # weight: the layer's (K x N, vLLM's CUTLASS layout), for its shape; the product's buffer holds the rows
    x2 = x.reshape(-1, x.shape[-1])
    return CLIENT.linear_int8(x2, product).view(*x.shape[:-1], weight.shape[1])


@coproc_linear_int8.register_fake
def _(x, weight, product):
    return x.new_empty((*x.shape[:-1], weight.shape[1]))
