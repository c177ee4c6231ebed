"""What both halves of the coprocessor agree on: the environment names the launcher sets, the io region's words and
buffers, and the setup messages.

Per product, GPU stream and CPU pod meet through three words of a small shared io region, with no host
thread on the GPU side, so CUDA graphs capture the decode step (cpupod/memops.py):
  GPU  writes x (T x K) into the io region (a kernel: a DMA copy would queue behind the weight stream),
       stores product = j, then req = encode(T, n0); computes x @ W[:n0].T from the prefetched rows;
       waits for done == 1, stores done = 0; reads y in place and concatenates.
  CPU  spins on req; computes x @ W[n0:].T into y from the region; stores done = 1.
Products are strictly sequential on the GPU stream, so one slot serves them all.

Setup (Unix socket in the replica's shared /dev/shm; JSON messages, descriptors by SCM_RIGHTS):
  GPU -> CPU {"weights_bytes"}             CPU -> GPU {"page"} + the weights region's fd
  (the GPU's loader fills the region; vLLM builds the model)
  GPU -> CPU {"dtype", "max_rows", "products": [[offset, n, k], ...]}
                                           CPU -> GPU {"threads", "measured"} + the io region's fd
  ("measured": the rates the CPU pod computes each product shape at, per step size, and its DRAM read rate,
  timed on the weights at hand; the GPU times its copies from the region too and splits by both: the node is
  measured at every start, no fitted figures)
  The connection stays open; when it closes (the GPU stage went), the server exits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the GPU stage's (the launcher sets them): the product server's socket, the weights region's size, and overrides
SOCKET_ENV, BYTES_ENV, SHARES_ENV = "HYBRID_COPROC_SOCKET", "HYBRID_COPROC_BYTES", "HYBRID_COPROC_SHARES"
TUNE_ENV = "HYBRID_COPROC_TUNE"  # client.tune_split
KERNEL_ENV = "HYBRID_COPROC_KERNEL"  # the cpu stage's: the product server's kernel (server.kernel_choice)

ALIGN = 32          # n0 is whole 32-row blocks: the sgl kernel's packed blocks (the request word stores n0 / ALIGN)

LINE = 64           # one cache line per word: the GPU's stores and the CPU's spins do not share lines

T_BITS = 13         # request word: (n0 / ALIGN) << T_BITS | T

MAX_ROWS = (1 << T_BITS) - 1

REQ, PRODUCT, DONE = 0, 1, 2  # the words, in lines


def encode(rows: int, n0: int) -> int:
    assert 0 < rows <= MAX_ROWS and n0 % ALIGN == 0 and n0 // ALIGN < 1 << (31 - T_BITS)
    return (n0 // ALIGN) << T_BITS | rows


def decode(word: int) -> tuple[int, int]:
    return word & MAX_ROWS, (word >> T_BITS) * ALIGN


@dataclass(frozen=True)
class IoLayout:
    """Byte offsets in the io region: three words, then two x and two y buffers (products alternate
    between them, so product j+1's input can land while j's output is still being read)."""
    max_rows: int
    max_k: int
    max_n: int
    elem: int = 2

    flags_bytes = 3 * LINE

    @property
    def x_bytes(self) -> int:
        return self.max_rows * self.max_k * self.elem

    @property
    def y_bytes(self) -> int:
        return self.max_rows * self.max_n * self.elem

    @property
    def nbytes(self) -> int:
        return self.flags_bytes + 2 * (self.x_bytes + self.y_bytes)

    def x_offset(self, j: int) -> int:
        return self.flags_bytes + (j % 2) * self.x_bytes

    def y_offset(self, j: int) -> int:
        return self.flags_bytes + 2 * self.x_bytes + (j % 2) * self.y_bytes

    @classmethod
    def for_shapes(cls, shapes: list[tuple[int, int]], max_rows: int, elem: int = 2) -> IoLayout:
        return cls(max_rows, max(k for _, k in shapes), max(n for n, _ in shapes), elem)


class IoViews:
    """Views of an io region (`raw`: a CPU uint8 tensor over the shared mapping)."""

    def __init__(self, raw: torch.Tensor, layout: IoLayout, dtype: torch.dtype):
        self.raw, self.layout, self.dtype = raw, layout, dtype
        # numpy views: the server spins on these words, and a numpy read costs a tenth of a tensor index
        self.words = raw[:layout.flags_bytes].numpy().view("int32")[::LINE // 4]

    def x(self, j: int, rows: int, k: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        """Product j's input buffer, in `raw` (default: the host mapping; the GPU passes its device view)."""
        return self._matrix(raw, self.layout.x_offset(j), rows, k)

    def y(self, j: int, rows: int, n: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        return self._matrix(raw, self.layout.y_offset(j), rows, n)

    def _matrix(self, raw: torch.Tensor | None, offset: int, rows: int, cols: int) -> torch.Tensor:
        raw = self.raw if raw is None else raw
        return raw[offset:offset + rows * cols * self.layout.elem].view(self.dtype).view(rows, cols)
