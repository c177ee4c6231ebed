"""The co-processor's CPU side against its protocol: a thread plays the GPU stream (stores x and the request
word, waits for done, reads y), the server computes rows [n0, N) from a shared memfd region in another
process, as it does in a CPU pod. The GPU's end (memops in CUDA graphs) runs in tests/gpu."""
import subprocess
import sys
import time

import pytest
import torch
from vllm_hybrid import coproc, hostmem

SHAPES = [(96, 64), (64, 96), (160, 64)]


SERVER = """
import os, sys, torch
from vllm_hybrid import coproc, hostmem
wfd, iofd, shapes, max_rows = int(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3]), int(sys.argv[4])
wmap, _ = hostmem.open_fd(wfd)
iomap, _ = hostmem.open_fd(iofd)
flat = torch.frombuffer(wmap, dtype=torch.float32, count=sum(n * k for n, k in shapes))
ws, off = [], 0
for n, k in shapes:
    ws.append(flat[off:off + n * k].view(n, k))
    off += n * k
io = coproc.IoViews(torch.frombuffer(iomap, dtype=torch.uint8), coproc.IoLayout.for_shapes(shapes, max_rows, 4),
                    torch.float32)
print(coproc.serve(ws, io, list(range(len(shapes))), stop=lambda: io.raw[-1].item() == 7, idle_check=0.05))
"""


def _gpu_play(io, j, x, n, n0, timeout=20.0):
    """What the GPU stream does for product j (GpuSide.linear, without the GPU rows)."""
    rows, k = x.shape
    io.x(j, rows, k).copy_(x)
    io.req[j] = coproc.encode(rows, n0)
    end = time.monotonic() + timeout
    while io.done[j] != 1:
        assert time.monotonic() < end, "server did not answer"
    io.done[j] = 0
    return io.y(j, rows, n - n0).clone()


def test_encode_round_trip_and_bounds():
    assert coproc.decode(coproc.encode(1, 0)) == (1, 0)
    assert coproc.decode(coproc.encode(coproc.MAX_ROWS, 28672)) == (coproc.MAX_ROWS, 28672)
    with pytest.raises(AssertionError):
        coproc.encode(0, 16)
    with pytest.raises(AssertionError):
        coproc.encode(4, 17)


def test_io_layout_keeps_buffers_apart():
    lay = coproc.IoLayout.for_shapes([(6144, 4096), (4096, 14336)], max_rows=64)
    assert lay.x_offset(0) >= lay.flags_bytes
    assert lay.x_offset(1) - lay.x_offset(0) == 64 * 14336 * 2
    assert lay.y_offset(0) == lay.x_offset(0) + 2 * lay.x_bytes
    assert lay.y_offset(1) + lay.y_bytes == lay.nbytes


def test_server_computes_the_cpu_rows_of_every_product_in_order():
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    wreg = hostmem.allocate("test-coproc-w", sum(n * k for n, k in SHAPES) * 4, pages="shmem")
    flat = torch.frombuffer(wreg.map, dtype=torch.float32, count=sum(n * k for n, k in SHAPES))
    flat.copy_(torch.cat([w.flatten() for w in weights]))
    layout = coproc.IoLayout.for_shapes(SHAPES, max_rows=8, elem=4)
    ioreg = hostmem.allocate("test-coproc-io", layout.nbytes + 1, pages="shmem")
    io = coproc.IoViews(torch.frombuffer(ioreg.map, dtype=torch.uint8), layout, torch.float32)
    # a fresh process, as in a CPU pod, given the two regions' descriptors
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(wreg.fd), str(ioreg.fd), repr(SHAPES), "8"],
                            pass_fds=(wreg.fd, ioreg.fd), stdout=subprocess.PIPE, text=True)
    try:
        calls = 0
        for step, rows in enumerate([1, 8, 3, 1]):  # steps of different sizes, the same order of products
            for j, (n, k) in enumerate(SHAPES):
                x = torch.randn(rows, k)
                n0 = [16, 48, 0, 32][(j + step) % 4]
                y = _gpu_play(io, j, x, n, n0)
                torch.testing.assert_close(y, x @ weights[j][n0:].t())
                calls += 1
        io.raw[-1] = 7  # tell the server to stop at its next idle check
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and int(out) == calls
