"""kt-kernel's layers for the bench (the runtime's vllm_hybrid.cpupod.kt), FP8 quantized from bf16 by the expert
server's own quantizer so that both kernels are timed on the same weights."""
from __future__ import annotations

import torch
from vllm_hybrid.cpupod import kt
from vllm_hybrid.cpupod.kt import AVAILABLE_METHODS, CHECKPOINT_INT4, FP8_BLOCK, kt_variant  # noqa: F401 (the bench's names)


def fp8_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E x N x K bf16 -> (e4m3 E x N x K, fp32 scale_inv E x N/128 x K/128) with w ~= q * scale_inv per block."""
    from vllm_hybrid.strategies.experts.quantized import quantize
    q = quantize("fp8-block", w)
    return q["w"], q["scale"].contiguous()


def KtLayer(method: str, w13: torch.Tensor, w2: torch.Tensor, **kw) -> kt.KtLayer:  # noqa: N802 (the class it makes)
    """kt.KtLayer, FP8 from bf16 w13 / w2 block-quantized here where no e4m3 tensors are given."""
    if method == "FP8" and "w13_fp8" not in kw:
        (q13, s13), (q2, s2) = fp8_block_quant(w13), fp8_block_quant(w2)
        kw |= {"w13_fp8": q13, "w13_scale_inv": s13, "w2_fp8": q2, "w2_scale_inv": s2}
    return kt.KtLayer(method, w13, w2, **kw)


_ext = kt._ext
