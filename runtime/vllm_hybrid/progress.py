"""Stall detection: a stage whose pipeline makes no progress while work is pending restarts.

A hung worker (a stuck kernel, a deadlock, a receive that never completes) leaves its launcher
beating, so the heartbeat never notices, and vLLM waits for the step forever. So each stage's
first worker publishes a progress record (ProgressWriter, from the step hook in vllm_patches/worker.py) in a
small shared-memory file, and the launcher, which runs on while the worker is frozen, reads it
(StallWatch): requests pending and no step finished for `stall_timeout` seconds -> the stage stops
its vLLM (stage 0's API, so /health fails and in-flight requests end) and exits non-zero, which
takes the other stages down through the heartbeat and lets the group restart run.

Every stage sees the same scheduler output, so "pending" (requests scheduled and not finished) is
known on each: the stages around a hung one detect the stall too, each on its own.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
import time
from dataclasses import dataclass

# version (odd while the writer is mid-update), last progress (monotonic s), pending requests,
# whether the latest step is the first of its size (compile grace), steps so far
_RECORD = struct.Struct("<Qdqqq")
STALL_FLOOR_S = 60.0           # default stall timeout, at least
STEP_MARGIN = 20               # ... and this many times the slowest expected step (a CPU quota cut 10x survives)
COMPILE_GRACE_FLOOR_S = 300.0  # first step of a new batch size: vLLM/torch may compile for it


@dataclass(frozen=True)
class Progress:
    last_progress: float
    pending: int
    new_shape: bool
    steps: int


def size_bucket(tokens: int) -> int:
    """Batch sizes that may compile separately: powers of two cover the range in ~13 buckets."""
    return 1 << max(0, math.ceil(math.log2(max(1, tokens))))


class ProgressWriter:
    """Worker side: called at every step start and end (vllm_patches.worker.patch_worker_step_metrics)."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _RECORD.size)
            self._map = mmap.mmap(fd, _RECORD.size)
        finally:
            os.close(fd)
        self._version = 0
        self.running: set[str] = set()
        self.last_progress = time.monotonic()
        self.steps = 0
        self.new_shape = False
        self._seen: set[int] = set()

    def _publish(self) -> None:
        self._version += 1  # odd: a reader retries or keeps its last snapshot
        _RECORD.pack_into(self._map, 0, self._version, self.last_progress, len(self.running),
                          self.new_shape, self.steps)
        self._version += 1
        struct.pack_into("<Q", self._map, 0, self._version)

    def step_started(self, so) -> None:
        idle = not self.running
        for r in getattr(so, "scheduled_new_reqs", ()):
            self.running.add(r.req_id)
        cached = getattr(so, "scheduled_cached_reqs", None)
        self.running.update(getattr(cached, "req_ids", ()))
        # finished ones arrive with the next step, an empty one if nothing else runs
        self.running.difference_update(getattr(so, "finished_req_ids", ()))
        tokens = getattr(so, "total_num_scheduled_tokens", 0) or 0
        if tokens:
            bucket = size_bucket(tokens)
            self.new_shape = bucket not in self._seen
            self._seen.add(bucket)
        if idle:  # work just arrived: the clock starts now, not at the last step before the pause
            self.last_progress = time.monotonic()
        self._publish()

    def step_finished(self) -> None:
        self.last_progress = time.monotonic()
        self.steps += 1
        self._publish()

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress if self.running else 0.0


def read(path: str) -> Progress | None:
    """The record, or None while it does not exist or is mid-update."""
    try:
        with open(path, "rb") as f:
            data = f.read(_RECORD.size)
    except OSError:
        return None
    if len(data) < _RECORD.size:
        return None
    version, last, pending, new_shape, steps = _RECORD.unpack(data)
    if version % 2 or version == 0:
        return None
    return Progress(last, pending, bool(new_shape), steps)


class StallWatch:
    """Launcher side: is the stage's worker stalled? (checked from the supervisor loop)"""

    def __init__(self, path: str, timeout: float, compile_timeout: float):
        self.path, self.timeout, self.compile_timeout = path, timeout, compile_timeout
        self._last: Progress | None = None

    def create(self) -> None:
        """A fresh, empty record before vLLM starts (a previous run's would look stalled)."""
        with open(self.path, "wb") as f:
            f.write(b"\0" * _RECORD.size)

    def check(self, now: float | None = None) -> str | None:
        """Why the stage counts as stalled, or None. A torn or missing read keeps the last snapshot:
        a worker frozen mid-update must not hide the stall."""
        self._last = read(self.path) or self._last
        p = self._last
        if p is None or not p.pending or self.timeout <= 0:
            return None
        limit = self.compile_timeout if p.new_shape else self.timeout
        idle = (time.monotonic() if now is None else now) - p.last_progress
        if idle <= limit:
            return None
        grace = " (first step of a new batch size)" if p.new_shape else ""
        return f"no step finished for {idle:.0f}s with {p.pending} request(s) pending (limit {limit:.0f}s{grace})"

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


_WRITER: ProgressWriter | None = None


def current() -> ProgressWriter | None:
    return _WRITER


def start(tp_rank: int, env=os.environ) -> ProgressWriter | None:
    """In the stage's first worker (the others run the same steps), where the launcher asks for it."""
    global _WRITER
    path = env.get("HYBRID_PROGRESS_FILE")
    if _WRITER is None and path and tp_rank == 0:
        _WRITER = ProgressWriter(path)
    return _WRITER


def default_timeouts(slowest_step_s: float) -> tuple[float, float]:
    """(stall timeout, compile grace) from the slowest step the cost model expects."""
    timeout = max(STALL_FLOOR_S, STEP_MARGIN * slowest_step_s)
    return timeout, compile_grace(timeout)


def compile_grace(timeout: float) -> float:
    return max(COMPILE_GRACE_FLOOR_S, 5 * timeout) if timeout else 0.0
