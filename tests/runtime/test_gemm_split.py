"""Split GEMMs (strategy balanced) without vLLM: a real GEMM helper process (on the CPU here, the same
protocol as on a GPU) and the CPU stage's client give the products of one plain F.linear."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from vllm_hybrid.gemm_split import SplitClient
from vllm_hybrid.strategy import ALIGN, Hardware, Rates, gpu_rows, split_pass_s, split_rates

SHAPES = [(96, 64), (64, 96), (40, 64)]  # three layers; the last is narrower than three 16-row blocks


@pytest.fixture
def helper(tmp_path):
    path = str(tmp_path / "h.gemm")
    proc = subprocess.Popen([sys.executable, "-m", "vllm_hybrid.gemm_helper", "--socket", path, "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield path, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def connected(path, share, weights, max_rows=32):
    client = SplitClient(path, Rates(), share)
    client.connect(timeout=30)
    assert client.publish(weights, max_rows).startswith("cpu")
    return client


def test_split_products_equal_one_linear(helper, tmp_path):
    path, _ = helper
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    client = connected(path, 0.5, weights)
    # the transport files are gone once the helper has its copy; only the socket stays
    assert sorted(os.listdir(tmp_path)) == ["h.gemm"]
    for rows in (1, 3, 17, 32, 70):  # 70 > max_rows: three round trips
        for layer, w in enumerate(weights):
            x = torch.randn(rows, w.shape[1])
            torch.testing.assert_close(client.linear(x, layer), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 64)  # leading batch dims are kept
    assert client.linear(x3, 0).shape == (2, 5, 96)


def test_all_rows_on_the_helper_and_none(helper):
    path, _ = helper
    weights = [torch.randn(n, k) for n, k in SHAPES]
    for share in (1.0, 0.0):
        client = connected(path, share, weights)
        x = torch.randn(4, 64)
        torch.testing.assert_close(client.linear(x, 2), F.linear(x, weights[2]), rtol=1e-5, atol=1e-5)


def test_a_dead_helper_fails_the_call_with_its_address(helper):
    path, proc = helper
    client = connected(path, 0.5, [torch.randn(n, k) for n, k in SHAPES])
    proc.kill()
    proc.wait()
    with pytest.raises(RuntimeError, match=f"GEMM helper at {path} failed"):
        client.linear(torch.randn(2, 64), 0)


def test_an_absent_helper_is_named_after_the_timeout(tmp_path):
    client = SplitClient(str(tmp_path / "none.gemm"), Rates(), None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="none.gemm unreachable after 1s.*share /dev/shm"):
        client.connect(timeout=1)
    assert time.monotonic() - t0 < 5


def test_a_failed_call_on_the_helper_stops_the_stage(helper):
    path, proc = helper
    client = connected(path, 0.9, [torch.randn(n, k) for n, k in SHAPES])
    client.weights[0] = torch.randn(200, 64)  # asks for 176 rows of a weight the helper has 96 rows of
    with pytest.raises(RuntimeError, match="answered status 1 for call 1"):
        client.linear(torch.randn(2, 64), 0)
    assert proc.poll() is None  # the helper lives on for the stage's restart


def test_the_gpu_share_follows_the_batch():
    r = Rates(pcie_gbs=50, cpu_gbs=55, cpu_tflops=3)
    share = {m: gpu_rows(m, 28672, 4096, 2, r) / 28672 for m in (1, 16, 64, 512, 4096)}
    assert 0.4 < share[1] < 0.55  # decode: the links share the bytes about by their rates
    assert share[1] <= share[64] < share[512] < share[4096]
    assert share[4096] > 0.85  # prefill: the CPU's FLOPs are the bottleneck, the GPU takes nearly all
    assert gpu_rows(1, 100, 64, 2, r, share=0.5) % ALIGN == 0
    assert gpu_rows(1, 20, 64, 2, r, share=0.5) == 0      # under one block: all on the CPU
    assert gpu_rows(1, 100, 64, 2, r, share=0.97) == 100  # under one block left: all on the GPU
    assert Rates.decode(r.encode()) == r


def test_a_split_pass_beats_either_side_alone():
    r = split_rates(Hardware(), cores=15)
    w = 6.98e9
    both = split_pass_s(w, 4096, 1, 2, r)
    gpu_only, cpu_only = w / (r.pcie_gbs * 1e9), w / (r.cpu_gbs * 1e9)
    assert both == pytest.approx(1 / (1 / gpu_only + 1 / cpu_only), rel=0.01)
