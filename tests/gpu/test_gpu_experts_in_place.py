"""GPU machine: a kept W4A16 layer's share of remote experts computed in place (client.InPlace): Marlin reads the
stacks over PCIe from a mapped view of the host region, as the main stage does at the pod's steps with
HYBRID_EXPERTS_UVA_SHARE, or gathered into GPU memory first (HYBRID_EXPERTS_SHARE_READ=gather). On random int4 stacks of a Qwen3-235B-A22B layer's shape (54 of 128 experts remote), laid
out once (Marlin.lay_out); the results equal Marlin on a GPU copy of the same bytes, and the figures (GB/s of the
routed experts' bytes read in place at 1 and 4 tokens, the copy engine's GB/s for the whole stacks) go to
gpu_results.json. Run in vLLM's CUDA build (HYBRID_GPU_PYTHONPATH), in a child process."""
import pytest
from gpu_results import record, run_child

pytestmark = pytest.mark.gpu

CHILD = r"""
import itertools, json, sys, time, types
import torch
from compressed_tensors.quantization import QuantizationArgs
from vllm_hybrid.cpupod import memops
from vllm_hybrid.strategies.experts import client as experts_client, quantized

hidden, inter, experts, remote_n, top_k = (int(a) for a in sys.argv[1:6])
torch.manual_seed(0)
dev = torch.device("cuda")
remote = sorted(torch.randperm(experts)[:remote_n].tolist())
words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32)
scales = lambda *shape: (torch.rand(*shape) * 0.002 + 0.001).bfloat16()
like = {"w13": words(remote_n, hidden // 8, 2 * inter), "w2": words(remote_n, inter // 8, hidden),
        "w13_scale": scales(remote_n, hidden // 128, 2 * inter), "w2_scale": scales(remote_n, inter // 128, hidden)}
client = experts_client.Client({0: remote}, device="cuda")
nbytes = sum(t.nbytes for t in like.values()) + 4096 * len(like)
client.flat = torch.empty(nbytes, dtype=torch.uint8)  # the region (here this process's memory), as open_weights maps it
client.wbytes, client.used = nbytes, 0
client.page_lock(client.flat, nbytes, mapped=True)
region = {role: client.take(t) for role, t in like.items()}
for role, t in like.items():
    region[role].copy_(t)
layer = types.SimpleNamespace(intermediate_size_per_partition=inter)
args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
held = experts_client.Held(remote, tuple(region.values()), fmt="w4a16", tensors=region, nearby=True,
                           num_experts=experts, large=quantized.Marlin(layer, args, remote, experts))
client.layers[0] = held
laid = held.large.lay_out(region, dev)
staged = {role: t.to(dev) for role, t in region.items()}  # the same bytes on the GPU
expert_bytes = sum(t[0].nbytes for t in region.values())

def ms(f, n=20):
    f(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3

out = {"laid_out": laid, "expert_mb": expert_bytes / 1e6, "remote": remote_n}
for path, share in itertools.product(("in_place", "gather"), (1.0, 0.5)):
    client.share_read = path  # HYBRID_EXPERTS_SHARE_READ
    assert client.share_in_place(share) == 1
    (_, ip), = held.in_place
    emap = torch.full((experts,), -1, dtype=torch.int32)
    emap[ip.ids] = torch.tensor([remote.index(e) for e in ip.ids], dtype=torch.int32)
    emap = emap.to(dev)
    for tokens in (1, 4):
        x = torch.randn(tokens, hidden, device=dev).bfloat16()
        # every slot on an expert computed in place (distinct ones where the tokens allow): the read is theirs
        pool = torch.tensor(ip.ids, device=dev)
        ids = torch.stack([pool[torch.randperm(len(pool), device=dev)[:top_k]] for _ in range(tokens)]).to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, top_k, device=dev), dim=-1)
        got = ip.compute(x, ids, weights)
        want = held.large(x, ids, weights, staged, expert_map=emap)
        read = len(set(ids.flatten().tolist())) * expert_bytes
        t = ms(lambda: ip.compute(x, ids, weights))
        key = f"{path}_share_{share}_tokens_{tokens}"
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        out[key] = {"equal": bool(torch.equal(got, want)), "rel_diff": rel, "ms": t, "experts_read": read // expert_bytes,
                    "gbs_in_place": read / t / 1e6, "ms_on_gpu_copy": ms(lambda: held.large(x, ids, weights, staged,
                                                                                           expert_map=emap)),
                    "pod_ids_skip_shared": bool((ip.for_pod(ids) == experts).all())}
# the gathered share in a CUDA graph, as a decode step captures it: replayed on other routings, it equals eager
client.share_read = "gather"
client.share_in_place(0.5)
(_, ip), = held.in_place
pool, replays = torch.tensor(ip.ids + remote[:4], device=dev), []
x = torch.randn(4, hidden, device=dev).bfloat16()
weights = torch.softmax(torch.randn(4, top_k, device=dev), dim=-1)
route = lambda: torch.stack([pool[torch.randperm(len(pool), device=dev)[:top_k]] for _ in range(4)]).to(torch.int32)
ids = route()
ip.compute(x, ids, weights)  # Triton's compile and Marlin's workspace outside the capture
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = ip.compute(x, ids, weights)
for _ in range(3):
    ids.copy_(route())
    graph.replay()
    want = held.large(x, ids, weights, staged, expert_map=held.large.map_of(ip.ids).to(dev))
    replays.append(((captured.float() - want.float()).norm() / want.float().norm()).item())
out["gather_graph_rel_diffs"] = replays
copy = ms(lambda: [s.copy_(r, non_blocking=True) for s, r in zip(staged.values(), region.values())])
out["copy_gbs_whole_stacks"] = remote_n * expert_bytes / copy / 1e6
# close unpins the range: the next client's region, mapped at the same addresses, registers (bench/experts_serving's
# second variant failed there with cudaErrorHostMemoryAlreadyRegistered)
client.close()
memops.register(client.flat.data_ptr(), nbytes, mapped=True)
memops.unregister(client.flat.data_ptr())
out["registers_again_after_close"] = True
print(json.dumps(out))
"""


def test_marlin_reads_a_shared_layer_in_place_and_equals_it_on_a_gpu_copy():
    shape = ("4096", "1536", "128", "54", "8")  # Qwen3-235B-A22B's MoE layer; 54 remote: 5125 / 94 rounded up
    figures = run_child(CHILD, shape, VLLM_USE_FLASHINFER_SAMPLER="0")
    record({"experts_in_place": figures})
    assert figures["laid_out"] and figures["registers_again_after_close"], figures
    cases = [v for k, v in figures.items() if "_share_" in k]
    # the same kernel on the same bytes (Marlin may split a product's inputs over blocks and add them atomically:
    # the order of those bf16 adds is free, so equal to rounding, not always bit for bit); read in place or gathered
    # into GPU memory first (HYBRID_EXPERTS_SHARE_READ=gather), also when replayed from a CUDA graph
    assert len(cases) == 8 and all(c["rel_diff"] < 5e-3 and c["pod_ids_skip_shared"] for c in cases), figures
    assert len(figures["gather_graph_rel_diffs"]) == 3 and max(figures["gather_graph_rel_diffs"]) < 5e-3, figures
    # read over PCIe: slower than the GPU's own memory, but a read at all (not a copy of the layer a step)
    assert all(0 < c["ms_on_gpu_copy"] < c["ms"] for c in cases), figures


NODE_CHILD = r"""
import contextlib, io, json, time
from vllm_hybrid import node
out = {}
# one process, one shape after the other: each measurement must leave nothing pinned behind for the next
for name, spec in (("mixtral", "w4a16:4096:14336:8:2"), ("qwen3_235b", "w4a16:4096:1536:128:8")):
    t0, said = time.perf_counter(), io.StringIO()
    with contextlib.redirect_stderr(said):  # why a measurement was left out (node.measure_gpu says it there)
        out[name] = node.measure_gpu(1 << 30, spec) | {"seconds": round(time.perf_counter() - t0, 2)}
    out[name]["stderr"] = said.getvalue()[-600:]
print(json.dumps(out))
"""


def test_the_node_gpu_part_measures_marlins_call_on_experts_read_in_place():
    """node.measure_gpu with the model's W4A16 experts (experts.in_place.measure): Marlin's call fitted over 1-8
    tokens on experts read in place over PCIe, or gathered into GPU memory first (the faster read is the share's), as the cost model weighs the GPU's share of the pod's steps. A read
    over PCIe: above nothing and below what the copy engine moves (it reads whole stacks at full width), the fit
    close to the calls, in seconds of the stage's start."""
    figures = run_child(NODE_CHILD, (), VLLM_USE_FLASHINFER_SAMPLER="0")
    record({"node_in_place": figures})
    for name, f in figures.items():
        assert "in_place_gbs" in f, (name, figures)
        assert 0 < f["in_place_gbs"] < 1.2 * f["copy_gbs"], (name, figures)
        assert f["in_place_fit_error"] < 0.3 and f["in_place_call_s"] < 1e-3 and f["seconds"] < 60, (name, figures)
        # both reads timed (in place, gathered first); the share's figures are the faster one's
        reads = {"in_place": f["in_place_in_place_one_token_ms"], "gather": f["in_place_gather_one_token_ms"]}
        assert f["in_place_read"] in (0.0, 1.0) and 0 < f["in_place_gather_gbs"] < 1.2 * f["copy_gbs"], (name, figures)
        assert f["in_place_one_token_ms"] == reads[("in_place", "gather")[int(f["in_place_read"])]], (name, figures)
    assert figures["mixtral"]["in_place_experts_held"] == 8 and figures["qwen3_235b"]["in_place_experts_held"] >= 100
