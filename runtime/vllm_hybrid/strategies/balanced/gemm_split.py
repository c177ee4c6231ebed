"""A CPU stage's matrix products, split row-wise with a GPU (strategy `balanced`).

A CPU stage is bound by reading its weights from DRAM; a GPU can read host RAM over PCIe at the same
time. So every linear layer of the stage computes rows [n0, N) of its output on the CPU while the GEMM
helper (gemm_helper.py, run by a GPU stage's launcher in the GPU pod) streams rows [0, n0) of the same
weights to the GPU and computes them there. n0 follows the batch: at decode both
links share the bytes, in prefill (thousands of rows) the GPU takes nearly everything.

One copy of the weights: the stage's loader writes them into a memfd (place_weights; cpupod/hostmem.py, 2 MiB
pages where the pod has them) that the CPU computes from and the helper maps and registers with CUDA
to stream from.

(the protocol: io.py)
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch
import torch.nn.functional as F

from ...cpupod import hostmem
from ...cpupod.wire import recv_exact, recv_msg, send_msg
from .io import PROFILE_ENV, RATES_ENV, REPLY, REQUEST, SHARE_ENV, SOCKET_ENV, Rates, gpu_rows, io_layout

log = logging.getLogger("vllm_hybrid.gemm_split")


class SplitClient:
    """One CPU worker's side: its weights stay where vLLM put them; calls go through `linear`."""

    def __init__(self, path: str, rates: Rates, share: float | None):
        self.path, self.rates, self.share = path, rates, share
        self.sock: socket.socket | None = None
        self.seq = 0
        self.lock = threading.Lock()
        # HYBRID_SPLIT_PROFILE=N: log where the time of the last N split calls went
        self.profile_every = int(os.environ.get(PROFILE_ENV, "0"))
        self.spent = [0.0, 0.0, 0]  # seconds computing the CPU rows, seconds waiting for the helper, calls

    def connect(self, timeout: float) -> None:
        deadline, next_note = time.monotonic() + timeout, time.monotonic() + 30
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(self.path)
                return
            except OSError as e:
                self.sock.close()
                self.sock = None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"GEMM helper at {self.path} unreachable after {timeout:.0f}s ({e}); "
                                       "it runs in the GPU stage's pod, which must share /dev/shm with this one") from e
                if time.monotonic() > next_note:
                    log.info("waiting for the GEMM helper at %s", self.path)
                    next_note += 30
                time.sleep(0.5)

    def publish(self, layers: list[torch.nn.Module], max_rows: int, placed: Placed | None = None) -> str:
        """Hand the helper every layer's weight in one shared region and map the io region. Weights that
        were loaded into `placed` (place_weights) stay where they are; otherwise each is moved into a new
        region (its private copy freed layer by layer, so host memory never holds both)."""
        shapes = [tuple(layer.weight.shape) for layer in layers]
        dtype, elem = layers[0].weight.dtype, layers[0].weight.element_size()
        offsets = placed.offsets([layer.weight for layer in layers]) if placed else None
        self.in_place = offsets is not None
        if offsets is not None:
            self.region = placed.region
        else:
            total = sum(n * k for n, k in shapes)
            self.region = hostmem.allocate(f"hybrid-weights-{os.getpid()}", total * elem)
            flat = torch.frombuffer(self.region.map, dtype=dtype, count=total)
            offsets, off = [], 0
            for layer, (n, k) in zip(layers, shapes):
                view = flat[off:off + n * k].view(n, k)
                view.copy_(layer.weight.data)
                layer.weight.data = view  # the last reference to the private copy: freed here
                offsets.append(off)
                off += n * k
        self.weights = [layer.weight.data for layer in layers]
        self.shapes, self.dtype, self.elem, self.max_rows = shapes, dtype, elem, max_rows
        nx, ny = io_layout(max_rows, shapes)
        self.io = hostmem.allocate(f"hybrid-io-{os.getpid()}", (nx + ny) * elem, pages="shmem")
        io = torch.frombuffer(self.io.map, dtype=dtype, count=nx + ny)
        self.io_x, self.io_y = io[:nx], io[nx:]
        # the helper prefetches each weight's decode share before the first call
        decode = [gpu_rows(1, n, k, elem, self.rates, self.share) for n, k in shapes]
        send_msg(self.sock, {"dtype": str(dtype).removeprefix("torch."), "max_rows": max_rows, "shapes": shapes,
                             "offsets": offsets, "prefetch_rows": decode}, fds=[self.region.fd, self.io.fd])
        answer = recv_msg(self.sock)
        if not answer.get("ok"):
            raise RuntimeError(f"GEMM helper at {self.path} refused the weights: {answer.get('error')}")
        return answer["device"]

    def linear(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        w = self.weights[layer]
        shape, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        outs = [self._rows(x2[i:i + self.max_rows], w, layer) for i in range(0, max(1, x2.shape[0]), self.max_rows)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(*shape, w.shape[0])

    def _rows(self, x: torch.Tensor, w: torch.Tensor, layer: int) -> torch.Tensor:
        m, (n, k) = x.shape[0], w.shape
        n0 = gpu_rows(m, n, k, self.elem, self.rates, self.share) if m else 0
        if n0 == 0:
            return F.linear(x, w)
        with self.lock:  # one call in flight per connection
            self.io_x[: m * k].view(m, k).copy_(x)
            self.seq += 1
            try:
                t0 = time.perf_counter()
                self.sock.sendall(REQUEST.pack(layer, m, n0, self.seq))
                cpu = F.linear(x, w[n0:]) if n0 < n else None
                t1 = time.perf_counter()
                seq, status = REPLY.unpack(recv_exact(self.sock, REPLY.size))
            except OSError as e:
                raise RuntimeError(f"GEMM helper at {self.path} failed: {e}") from e
            if self.profile_every:
                self._profile(t1 - t0, time.perf_counter() - t1, m)
            if status or seq != self.seq:
                raise RuntimeError(f"GEMM helper at {self.path} answered status {status} for call {seq} "
                                   f"(expected {self.seq}); see its log in the GPU stage")
            gpu = self.io_y[: m * n0].view(m, n0)
            return torch.cat([gpu, cpu], dim=1) if cpu is not None else gpu.clone()

    def _profile(self, cpu_s: float, wait_s: float, rows: int) -> None:
        self.spent[0] += cpu_s
        self.spent[1] += wait_s
        self.spent[2] += 1
        if self.spent[2] >= self.profile_every:
            cpu, wait, calls = self.spent
            # warning: vLLM shows its own loggers' INFO only, and this is asked for explicitly
            log.warning("split GEMMs: %d calls (last %d rows), CPU rows %.3f ms/call, then waiting for the "
                        "helper %.3f ms/call", calls, rows, 1e3 * cpu / calls, 1e3 * wait / calls)
            self.spent = [0.0, 0.0, 0]


class Placed:
    """A shared region that weights were loaded into (place_weights): the one copy from the start."""

    def __init__(self, region: hostmem.Region, flat: torch.Tensor):
        self.region, self.flat = region, flat

    def offsets(self, weights: list[torch.Tensor]) -> list[int] | None:
        """Each weight's element offset in the region; None unless every one lies inside it, contiguous."""
        base, end, out = self.flat.data_ptr(), self.flat.data_ptr() + self.flat.numel() * self.flat.element_size(), []
        for w in weights:
            if w.dtype != self.flat.dtype or not w.is_contiguous() or not base <= w.data_ptr() < end:
                return None
            out.append((w.data_ptr() - base) // w.element_size())
        return out


def place_weights(model: torch.nn.Module, linear_types: tuple[type, ...]) -> Placed | None:
    """Before the weights are loaded: the 2-D weights of the model's linear layers (the ones split with
    the helper) become views of one shared region, so the loader writes the one copy in place and host
    memory never holds a private copy as well (which huge pages, reserved up front, would double)."""
    params, seen = [], set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, linear_types) and isinstance(w, torch.Tensor) and w.ndim == 2 and not w.is_meta \
                and id(w) not in seen:
            seen.add(id(w))
            params.append(w)
    params = [p for p in params if p.dtype == params[0].dtype] if params else []
    if not params:
        return None
    total = sum(p.numel() for p in params)
    region = hostmem.allocate(f"hybrid-weights-{os.getpid()}", total * params[0].element_size())
    flat = torch.frombuffer(region.map, dtype=params[0].dtype, count=total)
    off = 0
    for p in params:
        p.data = flat[off:off + p.numel()].view(p.shape)  # not loaded yet: nothing to copy
        off += p.numel()
    return Placed(region, flat)


_CLIENT: SplitClient | None = None
_PLACED: Placed | None = None
LAYERS: list[torch.nn.Module] = []  # the stage's linear layers in load order, whose GEMMs are split


@torch.library.custom_op("hybrid::split_linear", mutates_args=())
def split_linear(x: torch.Tensor, weight: torch.Tensor, layer: int) -> torch.Tensor:
    # opaque to torch.compile: the CPU stage's traced graph calls it like any GEMM kernel
    assert _CLIENT is not None, "split_linear called before the GEMM helper was connected"
    return _CLIENT.linear(x, layer)


@split_linear.register_fake
def _(x, weight, layer):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def register_layer(layer: torch.nn.Module) -> None:
    """Called at weight-processing time for each linear layer of the stage (patches.py)."""
    index = len(LAYERS)
    LAYERS.append(layer)

    def cpu_linear(x, weight, bias, _i=index):
        out = torch.ops.hybrid.split_linear(x, weight, _i)
        return out if bias is None else out + bias

    layer.cpu_linear = cpu_linear


def enabled(env=os.environ) -> bool:
    return bool(env.get(SOCKET_ENV))


def connect_and_publish(max_rows: int, env=os.environ) -> str:
    """After the model is loaded: hand every registered layer's weight to the helper in the shared region."""
    global _CLIENT
    share = float(env[SHARE_ENV]) if env.get(SHARE_ENV) else None
    client = SplitClient(env[SOCKET_ENV], Rates.decode(env.get(RATES_ENV)), share)
    client.connect(float(env.get("HYBRID_GEMM_CONNECT_TIMEOUT", "900")))
    device = client.publish(LAYERS, max_rows, _PLACED)
    _CLIENT = client
    return f"{device}, weights {client.region.describe()}, " + ("loaded in place" if client.in_place else "moved")


def place_model_weights(model: torch.nn.Module, linear_types: tuple[type, ...]) -> None:
    """Called with the model built and its weights not yet loaded (patches.patch_split_gemm, in this folder)."""
    global _PLACED
    _PLACED = place_weights(model, linear_types)
