"""The GEMM helper: the GPU side of a CPU stage's split matrix products (see gemm_split.py).

Run by a GPU stage's launcher in the GPU pod (`python -m vllm_hybrid.strategies.balanced.gemm_helper --socket PATH`).
Each connection is one CPU worker: the helper maps the worker's weight region (the one copy the CPU
computes from, gemm_split.py) and registers it with CUDA, then every call computes rows [0, n0) of one
layer's output. The weights do not depend on the input, so a copy stream runs ahead through a ring of
device buffers in call order (the stage calls its layers in load order, step after step) while the
CPU computes its rows; the input is read in place from the io region by a kernel, since a DMA copy
would queue behind the weight stream. `--device cpu` runs the same protocol
without a GPU (tests).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading

import torch

from ...cpupod import hostmem
from ...cpupod.wire import recv_exact, recv_msg, send_msg
from .io import HELPER_RING as RING  # the planner leaves the GPU memory for it
from .io import REPLY, REQUEST, io_layout

log = logging.getLogger("vllm_hybrid.gemm_helper")


class _HostView:
    """__cuda_array_interface__ of registered host memory: with unified addressing a kernel reads it in place."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3, "strides": None}


class Connection:
    """One CPU worker's weights, io region and (on a GPU) streams and weight ring."""

    def __init__(self, manifest: dict, device: torch.device):
        self.device, self.registered = device, []
        dtype = getattr(torch, manifest["dtype"])
        self.shapes = [tuple(s) for s in manifest["shapes"]]
        fds = manifest["fds"]
        try:
            if len(fds) != 2:
                raise ValueError(f"expected the weights' and the io region's descriptors, got {len(fds)}")
            (self.wmap, wbytes), (self.io_map, io_bytes) = (hostmem.open_fd(fd) for fd in fds)
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the regions
        offsets = manifest["offsets"]
        total = max(off + n * k for off, (n, k) in zip(offsets, self.shapes))
        if total * dtype.itemsize > wbytes:
            raise ValueError(f"weights region has {wbytes} bytes, the shapes need {total * dtype.itemsize}")
        flat = torch.frombuffer(self.wmap, dtype=dtype, count=total)
        self.weights = [flat[off:off + n * k].view(n, k) for off, (n, k) in zip(offsets, self.shapes)]
        io = torch.frombuffer(self.io_map, dtype=dtype, count=io_bytes // dtype.itemsize)
        self.max_rows = manifest["max_rows"]
        nx, _ = io_layout(self.max_rows, self.shapes)
        self.io_x, self.io_y = io[:nx], io[nx:]
        if device.type == "cuda":
            try:
                self._register(flat, 0)  # page-locked for DMA: the copy stream reads the CPU stage's own pages
                self._register(io, 2)    # also mapped: a kernel reads inputs in place
                self._init_gpu(manifest["prefetch_rows"])
            except Exception:
                self.close()
                raise

    def _register(self, t: torch.Tensor, flags: int) -> None:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), flags)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size() / 1e9:.2f} GB failed ({rc})")
        self.registered.append(t.data_ptr())

    def close(self) -> None:
        """Unpin before the mappings go: pinned pages would outlive the CPU worker's region."""
        if self.registered:
            torch.cuda.synchronize(self.device)
            for ptr in self.registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self.registered = []

    def _init_gpu(self, prefetch_rows: list[int]) -> None:
        try:
            self.io_x_dev = torch.as_tensor(_HostView(self.io_x), device=self.device).view(self.io_x.dtype)
        except (RuntimeError, TypeError) as e:  # no device view of host memory here: copy inputs by DMA
            log.warning("inputs cannot be read in place (%s); copying them", e)
            self.io_x_dev = None
        self.copy_stream, self.stream = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        biggest = max(n * k for n, k in self.shapes)
        new = lambda: torch.empty(biggest, dtype=self.io_x.dtype, device=self.device)  # noqa: E731
        self.ring = [new() for _ in range(min(RING, len(self.shapes)))]
        self.miss = new()                                      # a call out of load order fetches here
        self.free = [torch.cuda.Event() for _ in self.ring]    # the slot's last GEMM is done
        self.loaded = [torch.cuda.Event() for _ in self.ring]  # the slot's prefetch has landed
        self.expect = list(prefetch_rows)                      # rows to prefetch per layer: its last n0
        self._restart(0)

    def _restart(self, layer: int) -> None:
        """Prefetch the next len(ring) layers from `layer` on, in load order."""
        self.pending: dict[int, tuple[int, int]] = {}  # layer -> (slot, rows) on its way or landed
        self.owner = [-1] * len(self.ring)
        self.next_layer, self.next_slot = layer, 0
        for _ in self.ring:
            self._prefetch_next()

    def _prefetch_next(self) -> None:
        layer, s = self.next_layer, self.next_slot
        self.pending.pop(self.owner[s], None)  # a layer skipped by the calls loses its slot
        rows, k = self.expect[layer], self.shapes[layer][1]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.free[s])
            if rows:
                self.ring[s][: rows * k].view(rows, k).copy_(self.weights[layer][:rows], non_blocking=True)
            self.loaded[s].record(self.copy_stream)
        self.pending[layer], self.owner[s] = (s, rows), layer
        self.next_layer, self.next_slot = (layer + 1) % len(self.shapes), (s + 1) % len(self.ring)

    def gemm(self, layer: int, m: int, n0: int) -> None:
        if not 0 <= layer < len(self.shapes):
            raise ValueError(f"layer {layer}: the stage sent {len(self.shapes)} weights")
        n, k = self.shapes[layer]
        if not (0 < n0 <= n and 0 < m <= self.max_rows):
            raise ValueError(f"layer {layer}: rows {m} (max {self.max_rows}), n0 {n0} (weight has {n} rows)")
        y = self.io_y[: m * n0].view(m, n0)
        if self.device.type != "cuda":
            torch.mm(self.io_x[: m * k].view(m, k), self.weights[layer][:n0].t(), out=y)
            return
        s, held = self.pending.pop(layer, (None, 0))
        buf = self.miss if s is None else self.ring[s]
        w = buf[: n0 * k].view(n0, k)
        with torch.cuda.stream(self.stream):
            if s is not None:
                self.stream.wait_event(self.loaded[s])
            if held < n0:  # the batch grew, or a miss: fetch the rows the prefetch did not cover
                w[held:].copy_(self.weights[layer][held:n0], non_blocking=True)
            if self.io_x_dev is not None:
                x = self.io_x_dev[: m * k].view(m, k).mul(1)  # one read of the input over PCIe
            else:
                x = self.io_x[: m * k].view(m, k).to(self.device, non_blocking=True)
            y.copy_(x @ w.t(), non_blocking=True)
            if s is not None:
                self.free[s].record(self.stream)
        self.expect[layer] = n0
        if s is None:
            self._restart((layer + 1) % len(self.shapes))  # follow the calls' order from here
        else:
            self.owner[s] = -1
            self._prefetch_next()
        self.stream.synchronize()


def serve_connection(conn: socket.socket, device: torch.device) -> None:
    c = None
    try:
        manifest = recv_msg(conn, max_fds=2)
        try:
            c = Connection(manifest, device)
        except Exception as e:  # noqa: BLE001 - reported to the CPU stage, which fails with it
            log.exception("setup failed")
            send_msg(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            return
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        send_msg(conn, {"ok": True, "device": f"{device} {name}"})
        log.info("serving %d weights (%.2f GB) on %s", len(c.shapes),
                 sum(n * k for n, k in c.shapes) * c.io_x.element_size() / 1e9, name)
        while True:
            layer, m, n0, seq = REQUEST.unpack(recv_exact(conn, REQUEST.size))
            status = 0
            try:
                c.gemm(layer, m, n0)
            except Exception:  # noqa: BLE001 - the CPU stage gets a status and stops
                log.exception("call %d (layer %d, %d rows, n0 %d) failed", seq, layer, m, n0)
                status = 1
            conn.sendall(REPLY.pack(seq, status))
    except ConnectionError:
        log.info("CPU worker disconnected")
    finally:
        if c is not None:
            c.close()
        conn.close()


def serve(path: str, device: torch.device) -> None:
    if os.path.exists(path):
        os.unlink(path)  # left by a previous run of this stage
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen()
    log.info("GEMM helper listening on %s (%s)", path, device)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve_connection, args=(conn, device), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="vllm_hybrid.strategies.balanced.gemm_helper", description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (tests)")
    p.add_argument("--cpus", help="CPU list to run on (the launcher gives it a core of its own)")
    p.add_argument("--reserve-bytes", type=int, default=0,
                   help="GPU memory to take before listening, kept in torch's cache for the weight rings")
    args = p.parse_args(argv)
    if args.cpus:
        from ...cpubind import parse_cpulist
        os.sched_setaffinity(0, parse_cpulist(args.cpus))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # "cuda": the first visible GPU
        torch.cuda.set_device(device)
        if args.reserve_bytes:
            # one segment, freed to torch's caching allocator, which carves the rings from it later; the
            # socket appears only after, and the stage starts vLLM only then (supervise.run_supervised)
            torch.empty(args.reserve_bytes, dtype=torch.uint8, device=device)  # freed at once, kept by the cache
            log.info("reserved %.2f GiB of GPU memory", torch.cuda.memory_reserved(device) / (1 << 30))
    else:
        torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher stops us with SIGTERM
    try:
        serve(args.socket, device)
    except KeyboardInterrupt:
        sys.exit(0)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(args.socket)


if __name__ == "__main__":
    main()
