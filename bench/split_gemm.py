"""Can the CPU and the GPU share one CPU stage's GEMMs, each reading its own rows of the weights from
host RAM at the same time (CPU: DRAM reads; GPU: PCIe DMA)? Torch only, no vLLM; run on the GPU machine.

The 16 decoder layers of the Llama-3.1-8B shape live in one /dev/shm segment registered with CUDA (the
prototype of gemm_split/gemm_helper, in one process). Measured, each alone and together:
  - pinned host -> GPU copy bandwidth from that segment; CPU read bandwidth (torch sum, all threads)
  - one 16-layer pass of the four GEMMs per layer at M rows with the GPU taking the first share of
    each weight's rows (streamed on a copy stream), the CPU the rest (torch F.linear), for several shares
  - the CPU-only pass again on private copies of the weights (shm's 4 KiB pages cost the CPU reads)
Usage: python bench/split_gemm.py OUT.json   (OMP threads placed by the caller, e.g. OMP_PLACES)
"""
import json
import mmap
import os
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: (N, K)
LAYERS = int(os.environ.get("HYBRID_BENCH_LAYERS", 16))
MS = [int(m) for m in os.environ.get("HYBRID_BENCH_MS", "1,4,16,64,512,4096").split(",")]
SHARES = [float(s) for s in os.environ.get("HYBRID_BENCH_SHARES", "0,0.3,0.4,0.5,0.6,1").split(",")]


def shm_weights(path: str):
    per = [n * k for n, k in SHAPES]
    total = LAYERS * sum(per) * 2
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, total)
    buf = mmap.mmap(fd, total)
    os.close(fd)
    flat = torch.frombuffer(buf, dtype=torch.bfloat16)
    flat.uniform_(-0.01, 0.01) if os.environ.get("HYBRID_BENCH_RANDOM") else flat.fill_(1e-3)
    ws, off = [], 0
    for _ in range(LAYERS):
        for (n, k), size in zip(SHAPES, per):
            ws.append(flat[off:off + size].view(n, k))
            off += size
    return buf, flat, ws


def read_gbs(flat) -> float:
    x = flat[: 1 << 30]  # 2 GB
    x.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * x.numel() * 2 / (time.perf_counter() - t0) / 1e9


def h2d_gbs(ws, dev, stream) -> float:
    bufs = [torch.empty_like(w, device=dev) for w in ws[:4]]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for i, w in enumerate(ws):
            bufs[i % 4].copy_(w, non_blocking=True)
    stream.synchronize()
    return sum(w.numel() * 2 for w in ws) / (time.perf_counter() - t0) / 1e9


X_MODE = os.environ.get("HYBRID_BENCH_X", "mapped")


class _HostView:
    """__cuda_array_interface__ of pinned host memory: with unified addressing the GPU reads it in place."""

    def __init__(self, t):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<i2", "data": (t.data_ptr(), False),
                                         "version": 3, "strides": None}


def mapped(t):
    return torch.as_tensor(_HostView(t), device="cuda").view(torch.bfloat16)


def split_pass(ws, xs, share: float, dev, copy_stream, compute_stream, ring, staged):
    """One pass over every GEMM: GPU rows [0, n0) streamed + computed, CPU rows [n0, N)."""
    n0s = [int(round(w.shape[0] * share / 64)) * 64 for w in ws]
    done = []
    # weights do not depend on the input: the copy stream runs ahead through a ring of device buffers
    free = [torch.cuda.Event() for _ in ring]
    for i, (w, n0) in enumerate(zip(ws, n0s)):
        if not n0:
            done.append(None)
            continue
        s = i % len(ring)
        with torch.cuda.stream(copy_stream):
            if i >= len(ring):
                copy_stream.wait_event(free[s])
            dst = ring[s][: n0 * w.shape[1]].view(n0, w.shape[1])
            dst.copy_(w[:n0], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(copy_stream)
        done.append((dst, ev, s))
    outs = []
    for i, (w, n0) in enumerate(zip(ws, n0s)):
        x = xs[w.shape[1]]
        gpu_out = None
        if n0:
            dst, ev, s = done[i]
            with torch.cuda.stream(compute_stream):
                compute_stream.wait_event(ev)
                # pinned staging on both ends: the host thread must not block in a pageable copy
                xp = staged[("x", x.shape)]
                xp.copy_(x)
                # read in place over PCIe by the GEMM: a copy would queue behind the weight stream
                # (a kernel copies it once: GEMV kernels would re-read it from the host per block)
                xd = mapped(xp).mul(1) if X_MODE == "mapped" else xp.to(dev, non_blocking=True)
                yd = xd @ dst.t()
                gpu_out = staged[("y", x.shape[0], w.shape[0])].view(-1)[: x.shape[0] * n0].view(x.shape[0], n0)
                gpu_out.copy_(yd, non_blocking=True)
                free[s].record(compute_stream)
                fin = torch.cuda.Event()
                fin.record(compute_stream)
        cpu_out = F.linear(x, w[n0:]) if n0 < w.shape[0] else None
        if gpu_out is not None:
            fin.synchronize()
        outs.append(torch.cat([o for o in (gpu_out, cpu_out) if o is not None], dim=1))
    return outs


def main(path: str) -> None:
    dev = torch.device("cuda")
    copy_stream, compute_stream = torch.cuda.Stream(), torch.cuda.Stream()
    seg = os.environ.get("HYBRID_BENCH_SHM", "/dev/shm/hybrid-split-bench")
    buf, flat, ws = shm_weights(seg)
    out = {"threads": torch.get_num_threads(), "weights_gb": round(flat.numel() * 2 / 1e9, 2)}
    t0 = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel() * 2, 0)
    out["host_register"] = {"rc": int(rc), "s": round(time.perf_counter() - t0, 2)}
    out["cpu_read_gbs"] = round(read_gbs(flat), 1)
    out["h2d_gbs"] = round(h2d_gbs(ws, dev, copy_stream), 1)
    # both at once: the copy stream streams every weight twice while the CPU threads read
    with torch.cuda.stream(copy_stream):
        bufs = [torch.empty_like(w, device=dev) for w in ws[:4]]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for rep in range(2):
            for i, w in enumerate(ws):
                bufs[i % 4].copy_(w, non_blocking=True)
    cpu_during = read_gbs(flat)
    copy_stream.synchronize()
    out["together"] = {"cpu_read_gbs": round(cpu_during, 1),
                       "h2d_gbs": round(2 * flat.numel() * 2 / (time.perf_counter() - t0) / 1e9, 1)}
    del bufs
    print(json.dumps(out), flush=True)
    biggest = max(n * k for n, k in SHAPES)
    ring = [torch.empty(biggest, dtype=torch.bfloat16, device=dev) for _ in range(len(ws))]
    passes = {}
    for m in MS:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) * 0.1 for k in {k for _, k in SHAPES}}
        staged = {("x", x.shape): torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in xs.values()}
        staged.update({("y", m, n): torch.empty(m, n, dtype=torch.bfloat16, pin_memory=True) for n, _ in SHAPES})
        row = {}
        for share in SHARES:
            if share == 0 and m > 512:
                continue  # minutes of CPU prefill; cpu_kernels.py has it
            split_pass(ws, xs, share, dev, copy_stream, compute_stream, ring, staged)
            reps = 3 if m <= 64 else 1
            t0 = time.perf_counter()
            for _ in range(reps):
                res = split_pass(ws, xs, share, dev, copy_stream, compute_stream, ring, staged)
            row[str(share)] = round((time.perf_counter() - t0) / reps * 1e3, 1)
        ref = F.linear(xs[4096], ws[0])
        row["max_err_qkv"] = float((res[0].float() - ref.float()).abs().max())
        passes[str(m)] = row
        print(m, json.dumps(row), flush=True)
    out["pass_ms"] = passes
    # the same CPU-only pass on private (malloc'd, transparent-huge-page) copies of the weights
    private = [w.clone() for w in ws]
    for m in (1, 4, 16, 64):
        x = {k: torch.randn(m, k, dtype=torch.bfloat16) for _, k in SHAPES}
        for _ in range(2):
            [F.linear(x[w.shape[1]], w) for w in private]
        t0 = time.perf_counter()
        for _ in range(3):
            [F.linear(x[w.shape[1]], w) for w in private]
        out.setdefault("cpu_private_ms", {})[str(m)] = round((time.perf_counter() - t0) / 3 * 1e3, 1)
    print(json.dumps(out["cpu_private_ms"]), flush=True)
    json.dump(out, open(path, "w"), indent=1)
    os.unlink(seg)


if __name__ == "__main__":
    main(sys.argv[1])
