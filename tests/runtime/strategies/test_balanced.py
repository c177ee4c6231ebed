"""Split GEMMs (strategy balanced) without vLLM: a real GEMM helper process (on the CPU here, the same
protocol as on a GPU) and the CPU stage's client give the products of one plain F.linear."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from no_skips import unavailable
from strategy_plans import CPU, GPU, SHAPE, bench_run, planned
from vllm_hybrid.cpubind import CpuBinding
from vllm_hybrid.cpupod import hostmem
from vllm_hybrid.identity import Identity
from vllm_hybrid.launcher import helper_command, resolve_stage, vllm_command, vllm_env
from vllm_hybrid.planner import split_layers
from vllm_hybrid.strategies import Hardware, get, resolve
from vllm_hybrid.strategies.balanced import HELPER_CONTEXT, split_pass_s, split_rates
from vllm_hybrid.strategies.balanced.gemm_split import SplitClient, place_weights
from vllm_hybrid.strategies.balanced.io import ALIGN, Rates, gpu_rows

SHAPES = [(96, 64), (64, 96), (40, 64)]  # three layers; the last is narrower than three 16-row blocks


@pytest.fixture
def helper(tmp_path):
    path = str(tmp_path / "h.gemm")
    proc = subprocess.Popen([sys.executable, "-m", "vllm_hybrid.strategies.balanced.gemm_helper", "--socket", path, "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield path, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def linears(shapes=SHAPES):
    return [torch.nn.Linear(k, n, bias=False) for n, k in shapes]


def connected(path, share, layers, max_rows=32):
    client = SplitClient(path, Rates(), share)
    client.connect(timeout=30)
    assert client.publish(layers, max_rows).startswith("cpu")
    return client


def test_split_products_equal_one_linear(helper, tmp_path):
    path, _ = helper
    torch.manual_seed(0)
    layers = linears()
    weights = [layer.weight.detach().clone() for layer in layers]
    client = connected(path, 0.5, layers)
    # weights and io travel as descriptors: nothing is left in the shared directory but the socket
    assert sorted(os.listdir(tmp_path)) == ["h.gemm"]
    for rows in (1, 3, 17, 32, 70):  # 70 > max_rows: three round trips
        for layer, w in enumerate(weights):
            x = torch.randn(rows, w.shape[1])
            torch.testing.assert_close(client.linear(x, layer), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 64)  # leading batch dims are kept
    assert client.linear(x3, 0).shape == (2, 5, 96)


def test_all_rows_on_the_helper_and_none(helper):
    path, _ = helper
    layers = linears()
    weights = [layer.weight.detach().clone() for layer in layers]
    for share in (1.0, 0.0):
        client = connected(path, share, layers)
        x = torch.randn(4, 64)
        torch.testing.assert_close(client.linear(x, 2), F.linear(x, weights[2]), rtol=1e-5, atol=1e-5)


def test_a_dead_helper_fails_the_call_with_its_address(helper):
    path, proc = helper
    client = connected(path, 0.5, linears())
    proc.kill()
    proc.wait()
    with pytest.raises(RuntimeError, match=f"GEMM helper at {path} failed"):
        client.linear(torch.randn(2, 64), 0)


def rss_kb(field: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])


def test_the_stage_and_the_helper_share_one_copy_of_the_weights(helper):
    path, _ = helper
    torch.manual_seed(1)
    layers = linears([(3072, 4096)] * 3)  # 3 x 48 MiB: big enough that freed copies go back to the kernel
    weights = [layer.weight.detach().clone() for layer in layers]
    anon, shmem = rss_kb("RssAnon"), rss_kb("RssShmem")
    client = connected(path, 0.5, layers)
    # the private copies are gone and the region holds the weights once
    assert anon - rss_kb("RssAnon") > 0.9 * 3 * 48 * 1024
    assert rss_kb("RssShmem") - shmem > 0.9 * 3 * 48 * 1024
    assert client.region.map.size() >= 3 * 3072 * 4096 * 4
    for layer, w in zip(layers, weights):
        torch.testing.assert_close(layer.weight.data, w, rtol=0, atol=0)
    x = torch.randn(2, 4096)
    layers[1].weight.data[:100].mul_(2)  # what the stage writes, the helper's rows read
    weights[1][:100].mul_(2)
    gpu_rows_only = client.linear(x, 1)[:, :100]
    torch.testing.assert_close(gpu_rows_only, F.linear(x, weights[1][:100]), rtol=1e-4, atol=1e-4)


def test_weights_loaded_into_the_region_are_handed_over_in_place(helper):
    path, _ = helper
    torch.manual_seed(2)
    layers = linears([(3072, 4096)] * 3)
    model = torch.nn.Sequential(*layers, torch.nn.LayerNorm(4096))  # the norm's 1-D weight stays private
    placed = place_weights(model, (torch.nn.Linear,))
    assert placed.region.map.size() >= 3 * 3072 * 4096 * 4
    weights = [torch.randn(3072, 4096) for _ in layers]
    anon = rss_kb("RssAnon")
    for layer, w in zip(layers, weights):
        layer.weight.data.copy_(w)  # what vLLM's loaders do: write the parameter in place
    client = SplitClient(path, Rates(), 0.5)
    client.connect(timeout=30)
    client.publish(layers, 32, placed)
    assert client.in_place and client.region is placed.region
    assert rss_kb("RssAnon") - anon < 0.1 * 3 * 48 * 1024  # no private copy was ever made
    for i, w in enumerate(weights):
        x = torch.randn(3, 4096)
        torch.testing.assert_close(client.linear(x, i), F.linear(x, w), rtol=1e-4, atol=1e-4)
    # a weight outside the region (a loader that replaced it) makes publish move them all
    layers[1].weight.data = weights[1].clone()
    assert placed.offsets([layer.weight for layer in layers]) is None


@pytest.fixture
def huge_pages():
    """Reserve 2 MiB pages for the test (root, as CI runs)."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(hostmem.reserved_huge_pages(64))
        except OSError as e:
            unavailable(f"cannot reserve huge pages here ({e})")
        yield


def test_weights_on_huge_pages_when_the_pod_has_them(helper, huge_pages):
    path, _ = helper
    layers = linears()
    weights = [layer.weight.detach().clone() for layer in layers]
    client = connected(path, 0.5, layers)
    assert (client.region.kind, client.region.page_size) == ("hugetlb", 2 << 20)
    for layer, w in enumerate(weights):
        x = torch.randn(5, w.shape[1])
        torch.testing.assert_close(client.linear(x, layer), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_without_huge_pages_the_weights_go_to_shmem(helper, monkeypatch):
    path, _ = helper
    monkeypatch.setenv(hostmem.PAGES_ENV, "shmem")
    client = connected(path, 0.5, linears())
    assert client.region.kind == "shmem" and client.region.page_size in (4096, 2 << 20)
    assert "KiB pages (shmem)" in client.region.describe()
    monkeypatch.setenv(hostmem.PAGES_ENV, "big")
    with pytest.raises(ValueError, match="HYBRID_WEIGHT_PAGES='big': use huge or shmem"):
        hostmem.allocate("x", 10)


def test_a_region_is_allocated_by_the_process_that_asks_for_it():
    """Pages are charged to the cgroup that first touches them: the cpu pod allocates its weight region
    whole, before the GPU pod page-locks or fills it (an unbacked memfd would be charged to the GPU pod)."""
    region = hostmem.allocate("allocated", 64 << 20, pages="shmem")
    try:
        assert os.fstat(region.fd).st_blocks * 512 >= region.nbytes
    finally:
        region.close()


def test_an_absent_helper_is_named_after_the_timeout(tmp_path):
    client = SplitClient(str(tmp_path / "none.gemm"), Rates(), None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="none.gemm unreachable after 1s.*share /dev/shm"):
        client.connect(timeout=1)
    assert time.monotonic() - t0 < 5


def test_a_failed_call_on_the_helper_stops_the_stage(helper):
    path, proc = helper
    client = connected(path, 0.9, linears())
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


def test_a_pod_with_too_few_huge_pages_fails_with_the_sizes(tmp_path, monkeypatch):
    limit = tmp_path / "hugetlb.2MB.max"
    limit.write_text("max\n")
    assert hostmem.pod_huge_page_limit([str(limit)]) is None
    limit.write_text(str(4 << 20))
    assert hostmem.pod_huge_page_limit([str(tmp_path / "none"), str(limit)]) == 4 << 20
    monkeypatch.setattr(hostmem, "HUGETLB_LIMITS", (str(limit),))
    monkeypatch.setattr(hostmem, "_hugetlb", lambda name, nbytes: None)  # as when the pool or the limit is short
    with pytest.raises(RuntimeError, match=r"weights need 10 MiB of 2 MiB pages, but the pod's hugepages-2Mi "
                                           r"limit is 4 MiB"):
        hostmem.allocate("w", 10 << 20)
    assert hostmem.allocate("w", 10 << 20, pages="shmem").kind == "shmem"  # asked for shmem: no huge pages needed


# --- the strategy's plans (from the former tests/runtime/test_strategy.py) ---


@pytest.mark.parametrize("stages,cpu", [([GPU, CPU], 1), ([CPU, GPU], 0)])
def test_balanced_splits_the_cpu_stages_gemms_with_the_gpu_stages_helper(stages, cpu):
    plan, _ = planned(stages, strategy="balanced")
    split = split_layers(plan, SHAPE, strat=get("balanced"))  # as resolve_split re-splits for balanced
    lay, _ = resolve(plan, split)
    gpu = 1 - cpu
    # every stage runs its own layers; nothing moves to the GPU stage's --cpu-offload-gb
    assert (lay.stages, lay.layers, lay.offload_bytes) == ((0, 1), (16, 16), (0, 0))
    assert lay.helper_of(cpu) == gpu and lay.helper_of(gpu) is None and lay.helped_by(gpu) == [cpu]
    base = {"HYBRID_INSTANCE": "llama", "HYBRID_SHM_DIR": "/dev/shm"}
    ids = {i: Identity(i, 2, "10.0.0.1", None) for i in (cpu, gpu)}
    recs = {i: resolve_stage(plan, split, ids[i], base, lay) for i in (cpu, gpu)}
    cpu_env = vllm_env(plan, recs[cpu], ids[cpu], CpuBinding("1-2", 2, None, [1, 2]), base)
    assert cpu_env["HYBRID_GEMM_SOCKET"] == f"/dev/shm/hybrid-llama-r2-s{gpu}.gemm"
    assert Rates.decode(cpu_env["HYBRID_SPLIT_RATES"]) == split_rates(Hardware(), 15)
    helper = helper_command(recs[gpu], python="py")
    # the helper takes the planner's GPU memory (less the CUDA context it makes anyway) before vLLM starts
    reserve = split.stages[gpu].beside_vllm_bytes - HELPER_CONTEXT
    assert reserve > 9 * 14336 * 4096 * 2  # its ring: 9 slots of the 8B shape's biggest split weight
    assert helper == ["py", "-m", "vllm_hybrid.strategies.balanced.gemm_helper", "--socket", cpu_env["HYBRID_GEMM_SOCKET"],
                      "--device", "cuda", "--reserve-bytes", str(reserve)]
    assert helper_command(recs[cpu]) is None
    gpu_argv = vllm_command(plan, recs[gpu], ids[gpu], python="py")
    assert "--cpu-offload-gb" not in gpu_argv
    pipe = resolve(*planned(stages, strategy="pipeline"))[0]
    assert "HYBRID_GEMM_SOCKET" not in vllm_env(plan, resolve_stage(plan, split, ids[cpu], base, pipe), ids[cpu],
                                                CpuBinding("1", 1, None, [1]), base)
    assert helper_command(resolve_stage(plan, split, ids[gpu], base, pipe)) is None


def test_the_balanced_cost_model_matches_the_bench():
    # bench/results/gpu_bench-onecopy.json: one H200 lease, CPU stage first (14 CPUs), one copy of its
    # weights on 2 MiB pages, DRAM measured there
    run = bench_run("gpu_bench-onecopy.json")
    hw = Hardware(dram_gbs=run["dram_read_gbs"])
    cpu = {**CPU, "cpus": 14}
    for w, prefetch in zip(run["d-balanced-huge"]["waves"], run["b-prefetch-plain"]["waves"]):
        plan, split = planned([cpu, GPU], strategy="auto", expected_concurrency=w["concurrency"],
                              expected_prompt_tokens=128, expected_output_tokens=128)
        lay, est = resolve(plan, split, hw)
        assert w["tok_per_s"] > prefetch["tok_per_s"]  # the best measured at every concurrency of that run
        assert lay.strategy == "balanced"
        assert est["balanced"] == pytest.approx(w["tok_per_s"], rel=0.1)
