"""The co-processor mechanism alone (strategy: coprocessor, runtime/vllm_hybrid/strategies/coprocessor/), torch only, no vLLM.

The 16 decoder layers' products of the Llama-3.1-8B shape live in one memfd (the CPU pod's region). A server
process pinned to cores 1..15 runs coproc_server.serve on it; this process registers the region and runs one
16-layer pass per CUDA graph replay: a copy stream prefetches each layer's rows [0, n0) a layer ahead (as
vLLM's prefetch offloader does), the GPU computes them, the server the rest, meeting through memops.
Reported per rows T and GPU share: ms per pass (graph replay), against the same pass streaming every row
(the prefetch offloader's cost), and the largest error against the GPU's full product.
Usage: python bench/coproc.py OUT.json      (on the GPU machine; PYTHONPATH=runtime)
"""
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from vllm_hybrid.cpubind import parse_cpulist as cpus
from vllm_hybrid.cpupod import hostmem
from vllm_hybrid.strategies.coprocessor import client as coproc_client
from vllm_hybrid.strategies.coprocessor import io as coproc_io
from vllm_hybrid.strategies.coprocessor import server as coproc_server

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: (N, K)
LAYERS = int(os.environ.get("HYBRID_BENCH_LAYERS", 16))
ROWS = [int(m) for m in os.environ.get("HYBRID_BENCH_MS", "1,4,16,64").split(",")]
SHARES = [float(s) for s in os.environ.get("HYBRID_BENCH_SHARES", "0.4,0.5,0.6,0.7").split(",")]
SERVER_CPUS = os.environ.get("HYBRID_BENCH_SERVER_CPUS", "1-15")
DT = torch.bfloat16


def views(buf, shapes):
    flat = torch.frombuffer(buf, dtype=DT, count=sum(n * k for n, k in shapes))
    ws, off = [], 0
    for n, k in shapes:
        ws.append(flat[off:off + n * k].view(n, k))
        off += n * k
    return flat, ws


def serve_child(wfd: int, iofd: int, max_rows: int) -> None:
    """A fresh process, as in a CPU pod (a forked one would inherit a broken OpenMP pool)."""
    os.sched_setaffinity(0, cpus(SERVER_CPUS))
    torch.set_num_threads(len(cpus(SERVER_CPUS)))
    shapes = SHAPES * LAYERS
    wmap, _ = hostmem.open_fd(wfd)
    iomap, _ = hostmem.open_fd(iofd)
    _, ws = views(wmap, shapes)
    layout = coproc_io.IoLayout.for_shapes(shapes, max_rows)
    io = coproc_io.IoViews(torch.frombuffer(iomap, dtype=torch.uint8), layout, DT)
    print(f"server: {len(ws)} products on {torch.get_num_threads()} threads", flush=True)
    parent = os.getppid()
    print("server: served", coproc_server.serve(ws, io, stop=lambda: os.getppid() != parent),
          flush=True)


def main(path: str) -> None:
    shapes = SHAPES * LAYERS
    total = sum(n * k for n, k in shapes) * 2
    wregion = hostmem.allocate("coproc-bench-weights", total)
    flat, ws = views(wregion.map, shapes)
    g = torch.Generator().manual_seed(0)
    block = torch.empty(1 << 24, dtype=DT).uniform_(-0.02, 0.02, generator=g)
    for i in range(0, flat.numel(), block.numel()):
        part = flat[i:i + block.numel()]
        part.copy_(block[:part.numel()])
    layout = coproc_io.IoLayout.for_shapes(shapes, max(ROWS))
    ioregion = hostmem.allocate("coproc-bench-io", layout.nbytes, pages="shmem")
    # its threads one per core, as the launcher places them (strategies.coprocessor.server_env)
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(wregion.fd), str(ioregion.fd),
                               str(max(ROWS))], pass_fds=(wregion.fd, ioregion.fd),
                              env={**os.environ, "GOMP_CPU_AFFINITY": " ".join(map(str, cpus(SERVER_CPUS)))})
    faulthandler.dump_traceback_later(float(os.environ.get("HYBRID_BENCH_WATCHDOG", 300)), exit=True)
    out = {"weights": wregion.describe(), "server_cpus": SERVER_CPUS}
    from vllm_hybrid.cpupod import memops
    os.sched_setaffinity(0, [0])
    t0 = time.perf_counter()
    memops.register(flat.data_ptr(), total, mapped=False)
    io_raw = torch.frombuffer(ioregion.map, dtype=torch.uint8)
    memops.register(io_raw.data_ptr(), layout.nbytes)
    out["register_s"] = round(time.perf_counter() - t0, 2)
    io = coproc_io.IoViews(io_raw, layout, DT)
    gpu = coproc_client.GpuSide(io)
    # the memops alone first: a store the host sees, a wait the host releases
    probe, word = gpu.done, coproc_io.DONE
    # allocated and its kernel loaded before the wait: a cudaMalloc or a first (lazy) module load behind a
    # pending wait blocks the host until the wait is released, here by this very thread
    marker = torch.zeros(1, device="cuda").add_(0)
    torch.cuda.synchronize()
    memops.write(probe, 5)
    torch.cuda.synchronize()
    assert io.words[word] == 5, io.words[word]
    memops.wait(probe, 6)
    marker.add_(1)
    time.sleep(0.2)
    assert not torch.cuda.current_stream().query(), "the stream did not wait"
    io.words[word] = 6
    torch.cuda.synchronize()
    io.words[word] = 0
    print("memops: write and wait work", float(marker), flush=True)
    dev = torch.device("cuda")
    copy = torch.cuda.Stream()
    depth = int(os.environ.get("HYBRID_BENCH_PREFETCH", 1))  # layers the copy stream runs ahead (--offload-prefetch-step)
    out["prefetch_step"] = depth
    bufs = [[torch.empty(n, k, dtype=DT, device=dev) for n, k in SHAPES] for _ in range(depth + 1)]
    ready = [torch.cuda.Event() for _ in bufs]

    def one_pass(xs, n0s, outs):
        cur = torch.cuda.current_stream()

        def prefetch(layer):
            fork = torch.cuda.Event()
            cur.record_event(fork)
            copy.wait_event(fork)
            with torch.cuda.stream(copy):
                for p, (n, _) in enumerate(SHAPES):
                    j = layer * 4 + p
                    bufs[layer % len(bufs)][p][:n0s[j]].copy_(ws[j][:n0s[j]], non_blocking=True)
            ready[layer % len(bufs)].record(copy)

        for layer in range(min(depth, LAYERS)):
            prefetch(layer)
        for layer in range(LAYERS):
            cur.wait_event(ready[layer % len(bufs)])
            if layer + depth < LAYERS:
                prefetch(layer + depth)
            for p, (n, k) in enumerate(SHAPES):
                j = layer * 4 + p
                w = bufs[layer % len(bufs)][p][:n0s[j]]
                y = gpu.linear(j, xs[k], w, n) if n0s[j] < n else F.linear(xs[k], w)
                if layer == LAYERS - 1:
                    outs[p].copy_(y)

    res = {}
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, dtype=DT, device=dev) * 0.5 for k in {k for _, k in SHAPES}}
        refs = [F.linear(xs[k], ws[(LAYERS - 1) * 4 + p].to(dev)) for p, (_, k) in enumerate(SHAPES)]
        row = {}
        for share in [1.0] + SHARES:
            n0s = [n if share >= 1 else min(n - coproc_io.ALIGN, int(n * share) // coproc_io.ALIGN * coproc_io.ALIGN)
                   for n, _ in shapes]
            outs = [torch.full((rows, n), float("nan"), dtype=DT, device=dev) for n, _ in SHAPES]
            one_pass(xs, n0s, outs)  # eager once: warms cuBLAS up, and checks the protocol outside a graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                one_pass(xs, n0s, outs)
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            err = max(float((o.float() - r.float()).norm() / r.float().norm()) for o, r in zip(outs, refs))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 5
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            row[str(share)] = {"ms": round(start.elapsed_time(end) / reps, 1), "rel_err": round(err, 5)}
            del graph
        res[str(rows)] = row
        print(rows, json.dumps(row), flush=True)
    out["pass"] = res
    best = {r: min((v["ms"], s) for s, v in row.items() if s != "1.0") for r, row in res.items()}
    out["speedup_over_streaming"] = {r: round(res[r]["1.0"]["ms"] / ms, 2) for r, (ms, _) in best.items()}
    print(json.dumps(out["speedup_over_streaming"]), flush=True)
    json.dump(out, open(path, "w"), indent=1)
    server.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        faulthandler.register(signal.SIGUSR1)
        serve_child(*map(int, sys.argv[2:]))
    else:
        huge = -(-sum(n * k for n, k in SHAPES) * LAYERS * 2 // hostmem.HUGE_PAGE) + 8
        with hostmem.reserved_huge_pages(huge if os.environ.get("HYBRID_BENCH_PAGES") == "huge" else 0):
            main(sys.argv[1])
