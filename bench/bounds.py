"""The memory bound of each strategy's decode step: how fast a step can be when each byte it needs is read once
at the speed of the memory that holds it (the copy engine and the CPU read the same DRAM).

    python bench/bounds.py --model mixtral-8x7b --gpu-gib 71.28 --dram-gbs 87.7 --pcie-gbs 55

A mixture of experts reads only the experts its tokens are routed to: of n experts of a layer held in one
memory, a step of c tokens (each routed to k of E, independently) reads n * (1 - (1 - k/E)^c) on average.
pipeline   cpu layers read from DRAM, then gpu layers from HBM (one batch in flight: one after the other).
offload    the streamed layers cross PCIe whole, every step (the prefetch offloader copies every expert).
experts    the gpu holds attention, norms, router, embeddings, the KV cache and as many experts as fit; the
           cpu reads its routed experts while the gpu computes its own (the longer of the two), after attention.
           Larger steps may stream the cpu experts instead (whichever is shorter).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import MODELS  # noqa: E402
from vllm_hybrid.planner import GiB, model_shape  # noqa: E402


def routed_share(shape, c: int) -> float:
    """Expected share of a layer's experts a step of c tokens reads (1 for a dense model)."""
    return 1 - (1 - shape.routed / shape.experts) ** c if shape.experts else 1.0


def bounds(shape, c: int, gpu_bytes: float, cpu_layers: int, kv_bytes: float, dram: float, hbm: float,
           pcie: float) -> dict[str, float]:
    """Seconds per decode step of c tokens under each strategy's bound."""
    layers, expert = shape.num_layers, shape.expert_bytes  # in the checkpoint's format (W4A16 9.73 MB, bf16 37.7)
    head = shape.embedding_bytes  # the LM head, read every step (the embedding lookup reads a row per token)
    dense = shape.layer_bytes - shape.layer_expert_bytes  # attention, norms, router of one layer
    read = dense + shape.experts * expert * routed_share(shape, c)  # a layer's bytes one step reads
    out = {"pipeline": cpu_layers * read / dram + ((layers - cpu_layers) * read + head) / hbm,
           "offload": cpu_layers * shape.layer_bytes / min(pcie, dram) + ((layers - cpu_layers) * read + head) / hbm}
    if shape.experts:
        fixed = layers * dense + 2 * shape.embedding_bytes + kv_bytes
        gpu_experts = min(shape.experts * layers, int((gpu_bytes - fixed) // expert))
        cpu_per_layer = shape.experts - gpu_experts / layers
        cpu_read = layers * cpu_per_layer * expert * routed_share(shape, c)
        gpu_read = layers * (shape.experts - cpu_per_layer) * expert * routed_share(shape, c)
        stream = layers * cpu_per_layer * expert / min(pcie, dram)
        out["experts"] = (layers * dense + head) / hbm + max(min(cpu_read / dram, stream), gpu_read / hbm)
        out["cpu expert share"] = cpu_per_layer / shape.experts
        out["cpu GB read at c"] = cpu_read / 1e9
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="mixtral-8x7b")
    p.add_argument("--gpu-gib", type=float, required=True, help="vLLM's GPU budget (the planner's, less its reserve)")
    p.add_argument("--cpu-layers", type=int, help="pipeline/offload: layers off the GPU (default: as few as fit)")
    p.add_argument("--dram-gbs", type=float, required=True, help="measured host DRAM read bandwidth")
    p.add_argument("--hbm-gbs", type=float, default=3350.0, help="GPU memory bandwidth (H100 SXM: 3350)")
    p.add_argument("--pcie-gbs", type=float, default=55.0, help="host-to-GPU copies of pinned memory")
    p.add_argument("--kv-tokens", type=int, default=16 * 768, help="experts: KV the GPU keeps (concurrency x tokens)")
    p.add_argument("--concurrency", default="1,4,16,64")
    a = p.parse_args(argv)
    shape = model_shape(MODELS[a.model], "bfloat16")
    gpu = a.gpu_gib * GiB
    kv = a.kv_tokens * shape.num_layers * shape.kv_bytes_per_token_per_layer
    cpu_layers = a.cpu_layers if a.cpu_layers is not None else max(
        0, math.ceil((shape.num_layers * shape.layer_bytes + 2 * shape.embedding_bytes + kv - gpu) / shape.layer_bytes))
    print(f"{a.model}: {shape.num_layers * shape.layer_bytes / 1e9:.1f} GB of layers; GPU {a.gpu_gib} GiB, DRAM "
          f"{a.dram_gbs} GB/s, HBM {a.hbm_gbs} GB/s, PCIe {a.pcie_gbs} GB/s; pipeline/offload: {cpu_layers} layers "
          f"off the GPU; experts: KV for {a.kv_tokens} tokens on the GPU")
    print("| concurrency | " + " | ".join(f"{s} bound tok/s" for s in ("pipeline", "offload", "experts"))
          + " | experts on cpu | cpu GB read per step |")
    print("|---|---|---|---|---|---|")
    for c in map(int, a.concurrency.split(",")):
        b = bounds(shape, c, gpu, cpu_layers, kv, a.dram_gbs * 1e9, a.hbm_gbs * 1e9, a.pcie_gbs * 1e9)
        rates = " | ".join(f"{c / b[s]:.1f}" if s in b else "-" for s in ("pipeline", "offload", "experts"))
        print(f"| {c} | {rates} | {b.get('cpu expert share', 0):.0%} | {b.get('cpu GB read at c', 0):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
