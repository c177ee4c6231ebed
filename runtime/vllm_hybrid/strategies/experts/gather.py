"""strategy experts: a layer's routed shared experts brought from the mapped host region into GPU memory, for the GPU's
share of the pod's steps (client.InPlace with HYBRID_EXPERTS_SHARE_READ=gather). Marlin reading the region in place
ran 18.2 GB/s on a 235B layer on one H100 box (its tiles' small reads over PCIe), where the copy engine moved 55; a
gather kernel reads each routed expert's rows whole, then Marlin reads them from HBM. The kernel takes fixed slots
(a captured step's shapes are fixed) and skips the empty ones (-1): only routed experts cross PCIe.
rows() on CUDA is a Triton kernel; elsewhere (tests on CPU) torch's indexing, the reference."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

BLOCK = 4096  # 4-byte words a program moves (16 KiB: reads wide enough to keep PCIe busy)


def words(t: torch.Tensor) -> torch.Tensor:
    """A stack (experts first, contiguous) as experts x 4-byte words."""
    return t.reshape(t.shape[0], -1).view(torch.int32)


@functools.cache
def _kernel():
    """The Triton gather, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather(src, dst, pick, row_words, BLOCK: tl.constexpr):
        slot, chunk = tl.program_id(0), tl.program_id(1)
        e = tl.load(pick + slot).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        keep = (offs < row_words) & (e >= 0)  # an empty slot reads nothing
        tl.store(dst + slot.to(tl.int64) * row_words + offs, tl.load(src + e * row_words + offs, mask=keep), mask=keep)

    return gather, triton.cdiv


def rows(src: torch.Tensor, dst: torch.Tensor, pick: torch.Tensor) -> None:
    """dst[j] = src[pick[j]] for every slot j with pick[j] >= 0; the others left as they were. src and dst are stacks
    of one row shape (experts first); pick is int, one per dst row."""
    s, d = words(src), words(dst)
    if s.shape[1] != d.shape[1] or pick.numel() > d.shape[0]:
        raise ValueError(f"gather: rows of {s.shape[1]} and {d.shape[1]} words, {pick.numel()} slots of {d.shape[0]}")
    kernel = _kernel() if dst.is_cuda else None
    if kernel is None:  # the reference: not capturable (its indices depend on the values)
        keep = pick >= 0
        d[:pick.numel()][keep] = s[pick[keep].long()].to(d.device)
        return
    gather, cdiv = kernel
    gather[(pick.numel(), cdiv(s.shape[1], BLOCK))](s, d, pick, s.shape[1], BLOCK=BLOCK)


def slots_in(buf: torch.Tensor, views: dict[str, torch.Tensor], laid_out: dict[str, torch.Size], n: int) -> dict:
    """n slots a role in `buf` (uint8, at least that large: slot_bytes), the region's dtypes in Marlin's shapes."""
    at, slots = 0, {}
    for role, shape in laid_out.items():
        size = views[role][:n].nbytes
        slots[role] = buf[at:at + size].view(views[role].dtype).view(n, *shape[1:])
        at += size
    return slots


def slot_bytes(views: dict[str, torch.Tensor], n: int) -> int:
    """The GPU buffer n slots take (slots_in)."""
    return sum(v[:n].nbytes for v in views.values())


def share(large, views: dict[str, torch.Tensor], stack_rows: list[int], ids: list[int], num_experts: int,
          buf: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """f(x, topk_ids, topk_weights): Marlin (`large`, laid out) over the shared experts `ids` a step routes to, each
    gathered first from the mapped region (views: the region's stacks on the device, expert `ids[j]` at row
    `stack_rows[j]`) into slot j of `buf` (a GPU buffer of slot_bytes(views, len(ids)) or more). Fixed shapes: a CUDA
    graph captures it."""
    dev, n = buf.device, len(ids)
    slots = slots_in(buf, views, large.laid_out, n)
    gids = torch.tensor(ids, device=dev)
    picks = torch.tensor(stack_rows, dtype=torch.int32, device=dev)
    emap = torch.full((num_experts,), -1, dtype=torch.int32)
    emap[ids] = torch.arange(n, dtype=torch.int32)
    emap = emap.to(dev)

    def compute(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        routed = torch.zeros(num_experts, dtype=torch.bool, device=dev)
        # index_fill_/masked_fill take the value as a scalar: `routed[ids] = True` copies a CPU tensor, which a
        # CUDA graph's capture refuses
        routed.index_fill_(0, topk_ids.flatten().long(), True)
        pick = picks.masked_fill(~routed[gids], -1)  # a slot per shared expert; the unrouted ones stay empty
        for role, slot in slots.items():
            rows(views[role], slot, pick)
        return large(x, topk_ids, topk_weights, slots, expert_map=emap)
    return compute
