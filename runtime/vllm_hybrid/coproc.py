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
                                           CPU -> GPU {"threads"} + the io region's fd
  The connection stays open; when it closes (the GPU stage went), the server exits.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

import torch

from .cpu_server import RegionClient, closed, io_region, serve_one_session, wait_request, weights_and_manifest

log = logging.getLogger("vllm_hybrid.coproc")
ALIGN = 16          # n0 is whole 16-row blocks (the request word stores n0 / ALIGN)
LINE = 64           # one cache line per word: the GPU's stores and the CPU's spins do not share lines
T_BITS = 13         # request word: (n0 / ALIGN) << T_BITS | T
MAX_ROWS = (1 << T_BITS) - 1
REQ, PRODUCT, DONE = 0, 1, 2  # the words, in lines


def encode(rows: int, n0: int) -> int:
    assert 0 < rows <= MAX_ROWS and n0 % ALIGN == 0 and n0 >> 4 < 1 << (31 - T_BITS)
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


def serve(weights: list[torch.Tensor], io: IoViews, stop=lambda: False, idle_check: float = 0.5,
          served: Served | None = None) -> int:
    """The CPU pod's loop: wait for a request, compute its rows [n0, N) of product j into y, raise done.
    Returns the number of products served once `stop()` turns true (asked while idle)."""
    words = io.words
    served = served or Served()
    while word := wait_request(words, stop, idle_check):
        t0 = time.perf_counter()
        words[REQ] = 0
        j = int(words[PRODUCT])
        rows, n0 = decode(word)
        w = weights[j]
        n, k = w.shape
        torch.matmul(io.x(j, rows, k), w[n0:].t(), out=io.y(j, rows, n - n0))
        words[DONE] = 1  # x86 stores are ordered: y is visible before the flag
        served.products += 1
        served.busy_s += time.perf_counter() - t0
    return served.products


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
        y0 = torch.nn.functional.linear(x, w_rows)
        mo.wait(self.done, 1)
        mo.write(self.done, 0)
        return torch.cat([y0, self.io.y(j, rows, n - n0, self.dev)], dim=-1)


# --- the CPU pod's server --------------------------------------------------------------------------

def handle(conn: socket.socket, pages: str | None = None, served: Served | None = None) -> int:
    """One GPU stage's session: regions, manifest, then products until the connection closes."""
    flat, manifest = weights_and_manifest(conn, "hybrid-coproc", pages)
    dtype = getattr(torch, manifest["dtype"])
    ws = [flat[off:off + n * k * dtype.itemsize].view(dtype).view(n, k) for off, n, k in manifest["products"]]
    layout = IoLayout.for_shapes([(n, k) for _, n, k in manifest["products"]], manifest["max_rows"], dtype.itemsize)
    io = IoViews(io_region(conn, "hybrid-coproc", layout.nbytes), layout, dtype)
    log.info("serving %d products (%.2f GB) on %d threads", len(ws), sum(w.numel() for w in ws) * dtype.itemsize / 1e9,
             torch.get_num_threads())
    return serve(ws, io, stop=lambda: closed(conn), served=served)


def serve_metrics(port: int, served: Served) -> None:
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    from .stage_metrics import StageMetrics, stage_labels
    m = StageMetrics(stage_labels())
    m.info.info({"device": "cpu", "layers": "", "strategy": "coprocessor"})
    reg: CollectorRegistry = m.registry
    labels = list(m.labels)
    Gauge("hybrid_coproc_products", "Matrix products this CPU stage computed rows of for its GPU stage",
          labels, registry=reg).labels(**m.labels).set_function(lambda: served.products)
    Gauge("hybrid_coproc_busy_seconds", "Time this CPU stage spent computing products (else waiting for the GPU)",
          labels, registry=reg).labels(**m.labels).set_function(lambda: served.busy_s)
    start_http_server(port, registry=reg)


def main(argv: list[str] | None = None) -> int:
    served = Served()
    serve_one_session("coproc", "strategy coprocessor: the CPU pod's product server", argv,
                      lambda conn, pages: handle(conn, pages, served), lambda port: serve_metrics(port, served))
    log.info("the GPU stage closed the connection after %d products", served.products)
    return 0


# --- the GPU process's side (patches.patch_coprocessor calls these) ---------------------------------

SOCKET_ENV, BYTES_ENV, SHARES_ENV = "HYBRID_COPROC_SOCKET", "HYBRID_COPROC_BYTES", "HYBRID_COPROC_SHARES"
# GPU share of each split product's rows, by step size: T <= bound -> share. Larger steps are not split.
# (bench/coproc.py on the H200 box: one 16-layer pass is fastest near these.)
DEFAULT_SHARES = "4:0.5,16:0.55,64:0.6"
BOUNDARY_SHARE = 0.55  # layers the offloader prefetches across steps: one n0 whatever the next step's size


def parse_shares(text: str) -> list[tuple[int, float]]:
    try:
        out = sorted((int(b), float(s)) for b, s in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise ValueError(f"{SHARES_ENV}={text!r}: expected ROWS:SHARE,... (e.g. {DEFAULT_SHARES})") from None
    if not out or any(not 0 < s < 1 or b < 1 for b, s in out) or out[-1][0] > MAX_ROWS:
        raise ValueError(f"{SHARES_ENV}={text!r}: shares in (0, 1), rows in [1, {MAX_ROWS}]")
    return out


def rows_of(n: int, share: float) -> int:
    """n0: whole blocks, at least one on each side."""
    return min(n - ALIGN, max(ALIGN, int(n * share) // ALIGN * ALIGN))


@dataclass
class Product:
    cpu: torch.Tensor   # the weight in the shared region
    boundary: bool      # prefetched across steps: always n0_fixed rows ahead
    n0_fixed: int


class Client(RegionClient):
    """The GPU worker's session with its CPU pod: the weights region it loads into, the io region, the split."""
    server = "strategy coprocessor: the product server"

    def __init__(self, shares: str | None = None):
        super().__init__()
        self.shares = parse_shares(shares or DEFAULT_SHARES)
        self.max_rows = self.shares[-1][0]
        self.rows = MAX_ROWS + 1  # the current step's tokens (set by every split product; larger: stream all)
        self.products: list[Product] = []
        self.gpu: GpuSide | None = None

    def open_weights(self, nbytes: int) -> str:
        return super().open_weights(nbytes, page_lock=True)  # the copy stream DMAs from it

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """Room in the region for a tensor like `like` (contiguous, 4 KiB aligned); None when it is full."""
        return self.room(like) if like.is_contiguous() else None

    def holds(self, t: torch.Tensor) -> bool:
        base = self.flat.data_ptr()
        return t.device.type == "cpu" and base <= t.data_ptr() < base + self.wbytes

    def add_product(self, weight_cpu: torch.Tensor, boundary: bool) -> int:
        self.products.append(Product(weight_cpu, boundary, rows_of(weight_cpu.shape[0], BOUNDARY_SHARE)))
        return len(self.products) - 1

    def publish(self) -> int:
        """Tell the CPU pod where each product's weight is; map the io region it returns. Its thread count."""
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
        return reply["threads"]

    def n0(self, j: int, rows: int) -> int:
        p = self.products[j]
        if p.boundary:
            return p.n0_fixed
        share = next(s for bound, s in self.shares if rows <= bound)
        return rows_of(p.cpu.shape[0], share)

    def prefetch_rows(self, j: int) -> int:
        """Rows of product j's weight the offloader copies ahead for the current step."""
        p = self.products[j]
        return self.n0(j, self.rows) if p.boundary or self.rows <= self.max_rows else p.cpu.shape[0]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, j: int) -> torch.Tensor:
        rows = x.shape[0]
        self.rows = rows
        p = self.products[j]
        if rows <= self.max_rows:
            return self.gpu.linear(j, x, weight[:self.n0(j, rows)], weight.shape[0])
        if p.boundary:  # its prefetch held n0_fixed rows: the rest now, on this stream
            weight[p.n0_fixed:].copy_(p.cpu[p.n0_fixed:], non_blocking=True)
        return torch.nn.functional.linear(x, weight)


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
