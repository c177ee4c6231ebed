"""What the page size of the CPU stage's weight region costs (strategy balanced keeps one copy of the
weights in a shared region, runtime/vllm_hybrid/cpupod/hostmem.py). Torch only, no vLLM.

The Llama-3.1-8B shape's decoder GEMMs (HYBRID_BENCH_LAYERS layers, default 16 = 6.98 GB bf16) are
placed, one placement at a time, in
  private  the stage's own memory, as vLLM loads it (no sharing: the old two-copy layout)
  shmem    a memfd on 4 KiB pages (hostmem's fallback)
  hugetlb  a memfd on 2 MiB pages (hostmem's default when the pod has them; pages reserved here)
and timed: one CPU pass of F.linear over every weight at M rows (all threads), and on a GPU machine
the registration and the host-to-GPU copy bandwidth of the region.
Usage: python bench/page_size.py OUT.json   (root: reserves and then returns the huge pages)
"""
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from vllm_hybrid.cpupod import hostmem

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: (N, K)
LAYERS = int(os.environ.get("HYBRID_BENCH_LAYERS", 16))
MS = [int(m) for m in os.environ.get("HYBRID_BENCH_MS", "1,4,16,64").split(",")]
# which placements run (huge pages are reserved only for hugetlb); private is torch's own memory, on transparent huge
# pages where THP_MEM_ALLOC_ENABLE=1 (cpubind.THP_ENV)
PLACEMENTS = os.environ.get("HYBRID_BENCH_PLACEMENTS", "private,shmem,hugetlb").split(",")


def layout(flat: torch.Tensor) -> list[torch.Tensor]:
    ws, off = [], 0
    for _ in range(LAYERS):
        for n, k in SHAPES:
            ws.append(flat[off:off + n * k].view(n, k))
            off += n * k
    return ws


def cpu_pass_ms(ws: list[torch.Tensor], m: int, reps: int = 3) -> float:
    xs = {k: torch.randn(m, k, dtype=ws[0].dtype) for _, k in SHAPES}
    for w in ws:
        F.linear(xs[w.shape[1]], w)
    t0 = time.perf_counter()
    for _ in range(reps):
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    return 1e3 * (time.perf_counter() - t0) / reps


def gpu_figures(flat: torch.Tensor) -> dict:
    if not torch.cuda.is_available():
        return {}
    nbytes = flat.numel() * flat.element_size()
    t0 = time.perf_counter()
    rc = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0))
    reg_s = time.perf_counter() - t0
    chunk = 256 << 20
    dev = torch.empty(chunk // 2, dtype=flat.dtype, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev.copy_(flat[: chunk // 2], non_blocking=True)
    stream.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for off in range(0, flat.numel() - chunk // 2 + 1, chunk // 2):
            dev.copy_(flat[off:off + chunk // 2], non_blocking=True)
    stream.synchronize()
    gbs = (flat.numel() // (chunk // 2)) * chunk / (time.perf_counter() - t0) / 1e9
    torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
    return {"register_rc": rc, "register_s": round(reg_s, 2), "h2d_gbs": round(gbs, 1)}


def measure(kind: str, total: int, dtype: torch.dtype) -> dict:
    elem = torch.tensor([], dtype=dtype).element_size()
    region = None
    if kind == "private":
        flat = torch.empty(total, dtype=dtype)
    else:
        region = hostmem.allocate(f"bench-{kind}", total * elem, pages="huge" if kind == "hugetlb" else "shmem")
        if region.kind != kind:
            return {"error": f"asked for {kind}, got {region.describe()}"}
        flat = torch.frombuffer(region.map, dtype=dtype, count=total)
    flat.fill_(1e-3)  # fault every page in
    out = {"pages": region.describe() if region else "private (anonymous)",
           "cpu_pass_ms": {m: round(cpu_pass_ms(layout(flat), m), 1) for m in MS}, **gpu_figures(flat)}
    del flat
    if region:
        region.close()  # the memfd's pages go with its last descriptor and mapping
    out["cpu_read_gbs"] = {m: round(total * elem / 1e6 / ms, 1) for m, ms in out["cpu_pass_ms"].items()}
    print(kind, json.dumps(out), flush=True)
    return out


def main(path: str) -> None:
    dtype = torch.bfloat16
    total = LAYERS * sum(n * k for n, k in SHAPES)
    result = {"threads": torch.get_num_threads(), "weights_gb": round(total * 2 / 1e9, 2), "placements": {},
              "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "")}
    with contextlib.ExitStack() as stack:
        if "hugetlb" in PLACEMENTS:
            try:
                stack.enter_context(hostmem.reserved_huge_pages(total * 2 // hostmem.HUGE_PAGE + 8))
            except OSError as e:
                print(f"no huge pages reserved ({e})", flush=True)
        for kind in PLACEMENTS:
            result["placements"][kind] = measure(kind, total, dtype)
    if "private" in result["placements"]:
        base = result["placements"]["private"]["cpu_pass_ms"]
        result["slowdown_vs_private"] = {kind: {m: round(p["cpu_pass_ms"][m] / base[m], 2) for m in MS}
                                         for kind, p in result["placements"].items() if "cpu_pass_ms" in p}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result.get("slowdown_vs_private", {})))


if __name__ == "__main__":
    main(sys.argv[1])
