"""How fast a GPU step can bring a layer's routed experts over from the pod's host memory (issue 48: the GPU's share of
the pod's experts at small steps). Marlin reading them in place ran 18.2 GB/s on a 235B layer on an H100 box and 34.5 on
Mixtral's (the node's in_place_gbs), against the copy engine's 55; a share pays only where the GPU's part is short.
Per expert count k (distinct experts, picked at random from as many as HYBRID_BENCH_HELD_GB holds, so each call reads
host memory): ms a call and GB/s of expert bytes for
  copy      the copy engine: one cudaMemcpyAsync an expert (host-side ids: not capturable with routing on the GPU)
  select    torch.index_select over the mapped region (a kernel reading PCIe in place; ids on the GPU, capturable)
  triton    gather.rows, the share's gather (HYBRID_EXPERTS_SHARE_READ=gather): a Triton kernel that skips empty
            slots (-1), as a captured step's fixed slots need
An expert is one contiguous blob of its W4A16 bytes (in_place.roles: the region keeps each role in a stack of its
own, so an expert there is 4 such blobs). On the GPU box, in vLLM's CUDA environment:
    python bench/uva_gather.py OUT.json   (HYBRID_BENCH_MODEL=qwen3-235b|mixtral, HYBRID_BENCH_EXPERTS=1,2,4,8)
"""
import json
import mmap
import os
import sys

import torch
from vllm_hybrid.cpupod import memops
from vllm_hybrid.strategies.experts import gather, in_place

SHAPES = {"qwen3-235b": (4096, 1536, 128, 8), "mixtral": (4096, 14336, 8, 2)}  # hidden, intermediate, experts, top-k
MODEL = os.environ.get("HYBRID_BENCH_MODEL", "qwen3-235b")
EXPERTS = [int(k) for k in os.environ.get("HYBRID_BENCH_EXPERTS", "1,2,4,8").split(",")]
HELD_GB = float(os.environ.get("HYBRID_BENCH_HELD_GB", "4"))
CALLS = 20


def timed(fn, calls: list) -> float:
    """Seconds a call, by CUDA events over the calls in turn (one warm-up)."""
    fn(calls[-1])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        fn(c)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / len(calls)


def main(out: str) -> None:
    hidden, inter, num_experts, top_k = SHAPES[MODEL]
    size = -(-in_place.expert_bytes(hidden, inter) // 16) * 16
    n = max(max(EXPERTS) * 2, int(HELD_GB * 1e9) // size)
    buf = mmap.mmap(-1, n * size)  # page-aligned, as the region's shared memory is
    host = torch.frombuffer(buf, dtype=torch.uint8).view(n, size)
    host.fill_(7)
    memops.register(host.data_ptr(), host.numel(), mapped=True)
    result = {"model": MODEL, "expert_mb": round(size / 1e6, 3), "experts_held": n, "gpu": torch.cuda.get_device_name(),
              "rows": []}
    try:
        words = host.view(torch.int64).view(n, size // 8)  # index_select moves 8-byte elements
        mapped = memops.as_device(words)
        dst = torch.empty(2 * max(EXPERTS), size // 8, dtype=torch.int64, device="cuda")
        g = torch.Generator().manual_seed(0)
        for k in EXPERTS:
            picks = [torch.randperm(n, generator=g)[:k] for _ in range(CALLS)]
            on_gpu = [p.to("cuda") for p in picks]
            half = [torch.cat([p, torch.full((k,), -1)]).to("cuda") for p in picks]
            methods = {
                "copy": (lambda i: [dst[j].copy_(words[e], non_blocking=True) for j, e in enumerate(picks[i].tolist())]),
                "select": (lambda i: torch.index_select(mapped, 0, on_gpu[i], out=dst[:k])),
            }
            if gather._kernel() is not None:
                methods["triton"] = lambda i: gather.rows(mapped, dst, on_gpu[i])
                # half the fixed slots empty, as a captured step's are: the empty ones must cost nothing
                methods["triton_half_empty"] = lambda i: gather.rows(mapped, dst, half[i])
            row = {"experts": k}
            for name, fn in methods.items():
                try:
                    dst.zero_()
                    s = timed(fn, list(range(CALLS)))
                    # the last call's experts, where that method put them
                    row[name] = {"ms": round(s * 1e3, 4), "gbs": round(k * size / s / 1e9, 2),
                                 "equal": torch.equal(dst[:k].cpu(), words[picks[-1]])}
                except Exception as e:  # noqa: BLE001 - the other methods go on
                    row[name] = {"error": repr(e)[:300]}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        torch.cuda.synchronize()
        memops.unregister(host.data_ptr())
    try:  # Marlin reading them in place, as the node's gpu part times it (its fitted call)
        result["marlin_in_place"] = in_place.measure(f"w4a16:{hidden}:{inter}:{num_experts}:{top_k}", 1 << 30)
    except Exception as e:  # noqa: BLE001
        result["marlin_in_place"] = {"error": repr(e)[:300]}
    print(json.dumps(result["marlin_in_place"]), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
