"""How a product's rows are shared between the GPU and the CPU pod, by step size: the client splits by it, the
tuning searches around it."""
from __future__ import annotations

from .io import ALIGN, MAX_ROWS, SHARES_ENV

MEASURE_ROWS = (1, 4, 16, 64)  # the step sizes the split is chosen for (DEFAULT_SHARES' bounds)

SGL_MIN_ROWS = 5  # sgl's GEMM takes its brgemm path from 5 rows: on one AMX box it read the weights faster at 1-4

MIN_CPU_GAIN = 0.15  # split only where the CPU adds this share of the copy's rate (each split has a hand-over)


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def measured_shares(copy_gbs: float, cpu_gbs: dict[int, float]) -> list[tuple[int, float]]:
    """The GPU's share of a product's rows per step size, so the copy of rows [0, n0) and the CPU's rows end
    together: copy / (copy + cpu). Step sizes where the CPU adds less than MIN_CPU_GAIN of the copy's rate, and
    all larger ones, are not split: they stream every row, as the offloader alone would."""
    out, sizes = [], sorted(cpu_gbs)
    for i, rows in enumerate(sizes):
        # a smaller step reads the same bytes with fewer flops: never slower than a larger one (a short timing
        # window at 4 rows read 28.8 GB/s beside 46.4 at 1 and 52.7 at 16 on the H100 box)
        cpu = max(cpu_gbs[r] for r in sizes[i:])
        if cpu < MIN_CPU_GAIN * copy_gbs:
            break
        out.append((rows, round(copy_gbs / (copy_gbs + cpu), 3)))
    return out


# GPU share of each split product's rows, by step size: T <= bound -> share; larger steps are not split. Measured at
# start on CUDA (measured_shares); this where nothing is measured, and HYBRID_COPROC_SHARES forces one for all.
# (bench/coproc.py on the H200 box: one 16-layer pass is fastest near these.)
DEFAULT_SHARES = "4:0.5,16:0.55,64:0.6"


def parse_shares(text: str) -> list[tuple[int, float]]:
    try:
        out = sorted((int(b), float(s)) for b, s in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise ValueError(f"{SHARES_ENV}={text!r}: expected ROWS:SHARE,... (e.g. {DEFAULT_SHARES})") from None
    if not out or any(not 0 <= s < 1 or b < 1 for b, s in out) or out[-1][0] > MAX_ROWS:
        raise ValueError(f"{SHARES_ENV}={text!r}: shares in [0, 1) (0: the CPU pod computes every row), rows in "
                         f"[1, {MAX_ROWS}]")
    return out


def rows_of(n: int, share: float) -> int:
    """n0: whole blocks, at least one on each side; share 0: none on the GPU (the CPU computes every row)."""
    if share <= 0:
        return 0
    return min(n - ALIGN, max(ALIGN, int(n * share) // ALIGN * ALIGN))


def share_for(table: list[tuple[int, float]], rows: int) -> float | None:
    """The GPU's share for a step of `rows` tokens; None: the step is not split (it streams every row)."""
    return next((s for bound, s in table if rows <= bound), None)
