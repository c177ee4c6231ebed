"""What both halves of balanced agree on: the environment names, the call messages and io region, and how a product's
rows are split between the GPU and the CPU.

Protocol (one Unix-socket connection per CPU worker; the socket sits in the replica's shared /dev/shm):
  setup   client -> helper: JSON manifest (shapes, dtype, max rows) with two file descriptors
          (SCM_RIGHTS): the weights region and the io region; helper -> client: JSON
          {"ok": ..., "device"|"error"}.
  call    client writes x into the io region, sends REQUEST (layer, rows, n0, seq); the helper writes
          its rows of y into the io region and answers REPLY (seq, status).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

SOCKET_ENV = "HYBRID_GEMM_SOCKET"   # the cpu stage's: where its GEMM helper listens (set by the launcher)
RATES_ENV = "HYBRID_SPLIT_RATES"    # the cpu stage's: what each side reaches (Rates.encode)
SHARE_ENV = "HYBRID_SPLIT_SHARE"    # the cpu stage's: a fixed GPU share instead (experiments)
PROFILE_ENV = "HYBRID_SPLIT_PROFILE"  # the cpu stage's: log the split's timing every N calls
RING_ENV = "HYBRID_GEMM_RING"       # the helper's ring of weights in flight per CPU worker
REQUEST = struct.Struct("<iiii")  # layer, rows, n0 (rows of the weight on the GPU), seq
REPLY = struct.Struct("<ii")      # seq, status (0 ok)


def io_layout(max_rows: int, shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """Elements of the io region's two parts: x (rows x largest k), then y (rows x largest n)."""
    return max_rows * max(k for _, k in shapes), max_rows * max(n for n, _ in shapes)


ALIGN = 16  # a GPU share of a split GEMM is whole 16-row blocks; below one block the CPU does it all
# weights in flight in the GEMM helper's ring per CPU worker (about two decoder layers ahead), and with its
# miss buffer the device buffers it holds
HELPER_RING = int(os.environ.get(RING_ENV, "8"))
HELPER_RING_SLOTS = HELPER_RING + 1


@dataclass(frozen=True)
class Rates:
    """What each side reaches while both work (launcher: from the plan's hardware figures)."""
    pcie_gbs: float = 50.0    # host -> GPU, pinned weights
    cpu_gbs: float = 55.0     # CPU weight reads while the GPU streams (both load DRAM)
    cpu_tflops: float = 3.0   # CPU GEMM compute, large batches

    def encode(self) -> str:
        return f"{self.pcie_gbs},{self.cpu_gbs},{self.cpu_tflops}"

    @classmethod
    def decode(cls, text: str | None) -> Rates:
        return cls(*map(float, text.split(","))) if text else cls()

    def row_seconds(self, k: int, rows: int, elem: int) -> tuple[float, float]:
        """Time per weight row of a (n, k) product at `rows` rows on each side. GPU: the row and its
        outputs cross PCIe, (k + rows) * elem bytes. CPU: it reads the row at DRAM speed or, in large
        batches, computes it at its FLOP rate."""
        cpu_bps = min(self.cpu_gbs * 1e9, self.cpu_tflops * 1e12 * elem / (2 * rows))
        return (k + rows) * elem / (self.pcie_gbs * 1e9), k * elem / cpu_bps


def gpu_rows(rows: int, n: int, k: int, elem: int, rates: Rates, share: float | None = None) -> int:
    """Rows of an (n, k) weight the GPU computes for a batch of `rows`: both sides finish together
    (`share` fixes the GPU's fraction instead, for experiments)."""
    if share is None:
        t_gpu, t_cpu = rates.row_seconds(k, rows, elem)
        share = t_cpu / (t_gpu + t_cpu)
    n0 = int(n * share) // ALIGN * ALIGN
    return n if n - n0 < ALIGN else n0


