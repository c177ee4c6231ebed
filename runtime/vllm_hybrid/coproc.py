"""strategy: coprocessor. The GPU stage runs every layer; the CPU pods are matrix-product co-processors.

The CPU-resident layers' weights live once, in a region the CPU pod owns (hostmem: a memfd on its NUMA
node, 2 MiB pages where it has them). The GPU process registers that region and vLLM's prefetch offloader
streams those layers from it (patches.py). For a step of at most `max_rows` tokens, each product of such
a layer is split by rows: the offloader copies only rows [0, n0) of the weight and the GPU computes them,
while the CPU pod computes rows [n0, N) from the same memory. Larger steps (prompt chunks) stream every
row, as the plain offloader does, so attention, norms and KV stay on the GPU for every token.

The two meet through words in a small shared io region, with no host thread on the GPU side, so CUDA graphs
capture the step (memops.py). For product j of a step of T tokens the GPU stream:
  1. writes x (T x K) into the io region (a kernel: a DMA copy would queue behind the weight stream)
  2. stores req[j] = encode(T, n0)           -> the CPU pod computes x @ W[n0:].T into y, then done[j] = 1
  3. computes x @ W[:n0].T from the prefetched rows
  4. waits for done[j] == 1, stores done[j] = 0
  5. reads y in place and concatenates.
Products arrive in the same order every step, so the server watches one slot at a time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

ALIGN = 16          # n0 is whole 16-row blocks (and the request code stores n0 / ALIGN)
FLAG_WORDS = 16     # one 64-byte line per flag: the GPU's stores and the CPU's spins do not share lines
T_BITS = 13         # request word: (n0 / ALIGN) << T_BITS | T
MAX_ROWS = (1 << T_BITS) - 1


def encode(rows: int, n0: int) -> int:
    assert 0 < rows <= MAX_ROWS and n0 % ALIGN == 0
    return (n0 // ALIGN) << T_BITS | rows


def decode(word: int) -> tuple[int, int]:
    return word & MAX_ROWS, (word >> T_BITS) * ALIGN


@dataclass(frozen=True)
class IoLayout:
    """Byte offsets in the io region: flags, then two x and two y buffers (products alternate between them,
    so product j+1's input can land while j's output is still being read)."""
    products: int
    max_rows: int
    max_k: int
    max_n: int
    elem: int = 2

    @property
    def flags_bytes(self) -> int:
        return 2 * self.products * FLAG_WORDS * 4

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
        return cls(len(shapes), max_rows, max(k for _, k in shapes), max(n for n, _ in shapes), elem)


class IoViews:
    """Tensor views of an io region (a CPU tensor of bytes over the shared mapping)."""

    def __init__(self, raw: torch.Tensor, layout: IoLayout, dtype: torch.dtype):
        self.raw, self.layout, self.dtype = raw, layout, dtype
        # numpy views: the server spins on these words, and a numpy read costs a tenth of a tensor index
        words = raw[:layout.flags_bytes].numpy().view("int32").reshape(2, layout.products, FLAG_WORDS)
        self.req, self.done = words[0, :, 0], words[1, :, 0]

    def flag_offset(self, which: int, j: int) -> int:
        return (which * self.layout.products + j) * FLAG_WORDS * 4

    def x(self, j: int, rows: int, k: int) -> torch.Tensor:
        o = self.layout.x_offset(j)
        return self.raw[o:o + rows * k * self.layout.elem].view(self.dtype).view(rows, k)

    def y(self, j: int, rows: int, n: int) -> torch.Tensor:
        o = self.layout.y_offset(j)
        return self.raw[o:o + rows * n * self.layout.elem].view(self.dtype).view(rows, n)


def serve(weights: list[torch.Tensor], io: IoViews, order: list[int], stop=lambda: False,
          idle_check: float = 0.5) -> int:
    """The CPU pod's loop: for each product of `order` in turn, wait for its request, compute its rows
    [n0, N) into y, raise done. Returns the number of products served when `stop()` turns true."""
    req, done = io.req, io.done
    served, i = 0, 0
    while True:
        j = order[i]
        spins, since = 0, time.monotonic()
        while (word := int(req[j])) == 0:
            spins += 1
            if spins % 4096 == 0 and time.monotonic() - since > idle_check:
                if stop():
                    return served
                since = time.monotonic()
        req[j] = 0
        rows, n0 = decode(word)
        w = weights[j]
        n, k = w.shape
        torch.matmul(io.x(j, rows, k), w[n0:].t(), out=io.y(j, rows, n - n0))
        done[j] = 1  # x86 stores are ordered: y is visible before the flag
        served += 1
        i = (i + 1) % len(order)


class GpuSide:
    """The GPU process's end of an io region: device pointers of the flags, in-place device views of x and y."""

    def __init__(self, io: IoViews):
        from . import memops
        self.io, self.memops = io, memops
        self.base = memops.device_pointer(io.raw.data_ptr())
        self.dev = memops.as_device(io.raw)

    def linear(self, j: int, x: torch.Tensor, w_rows: torch.Tensor, n: int) -> torch.Tensor:
        """x @ W.T for product j, W's rows [0, n0) given on the GPU (w_rows), the rest computed by the CPU pod."""
        rows, k = x.shape
        n0 = w_rows.shape[0]
        lay, mo = self.io.layout, self.memops
        xo, yo = lay.x_offset(j), lay.y_offset(j)
        xd = self.dev[xo:xo + rows * k * lay.elem].view(x.dtype).view(rows, k)
        torch.mul(x, 1, out=xd)  # a kernel writes host memory; copy_ might take the DMA engine
        mo.write(self.base + self.io.flag_offset(0, j), encode(rows, n0))
        y0 = torch.nn.functional.linear(x, w_rows)
        done = self.base + self.io.flag_offset(1, j)
        mo.wait(done, 1)
        mo.write(done, 0)
        y1 = self.dev[yo:yo + rows * (n - n0) * lay.elem].view(x.dtype).view(rows, n - n0)
        return torch.cat([y0, y1], dim=-1)
