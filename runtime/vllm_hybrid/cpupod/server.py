"""A CPU pod's server and the main stage's session with it (strategies coprocessor and experts): the server
listens in the replica's shared /dev/shm and serves one main stage; the client asks it for regions (each reply
carries the region's descriptor) and carves the weights region into tensors the loader fills in place."""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable

import torch

from . import hostmem
from .wire import recv_msg, send_msg

log = logging.getLogger("vllm_hybrid.cpupod")


# --- the server's side -----------------------------------------------------------------------------

def closed(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (never blocks)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Counters:
    """A server's running totals as Prometheus counters (exposed as NAME_total; they only grow while it serves),
    read at each scrape: `totals` gives (name, doc, read), `by_label` (name, doc, label, read -> {value: total}).
    All are read under `lock` (the server holds it while a step updates them): a scrape sees whole steps, so ratios
    of two counters (the experts' remote share) are exact even over a window of two scrapes."""

    def __init__(self, labels: dict[str, str], totals=(), by_label=(), lock: threading.Lock | None = None):
        self.labels, self.totals, self.by_label = labels, totals, by_label
        self.lock = lock or contextlib.nullcontext()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        names, values = list(self.labels), list(self.labels.values())
        with self.lock:  # read everything first: a generator must not hold the lock across its yields
            totals = [(name, doc, read()) for name, doc, read in self.totals]
            by_label = [(name, doc, label, sorted(read().items())) for name, doc, label, read in self.by_label]
        for name, doc, total in totals:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, total)
            yield family
        for name, doc, label, items in by_label:
            family = CounterMetricFamily(name, doc, labels=[*names, label])
            for key, total in items:
                family.add_metric([*values, str(key)], total)
            yield family


def window_gbs(step: Callable[[int], int], seconds: float) -> float:
    """GB/s of step(0), step(1), ... (each runs one call and returns the bytes it read) over a window of `seconds`,
    one call at least: how both servers time their kernels at start (a window, not a best of a few calls)."""
    done, i, t0 = 0, 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or i == 0:
        done, i = done + step(i), i + 1
    return float(f"{done / elapsed / 1e9:.3g}")  # 3 digits: a tiny test's rate is not 0.0


def measure_dram_read(flat: torch.Tensor, nbytes: int = 2 << 30) -> float:
    """GB/s this process's threads read the region at (a max over up to `nbytes` of its bytes: vectorized and
    parallel in ATen, where an int32 sum ran at 5 GB/s on the H100 box's 14 threads)."""
    view = flat[:min(nbytes, flat.numel())]
    view[: 1 << 20].max()
    best = math.inf
    for _ in range(3):  # the best of three: one pass read 57-96 GB/s on one H100 box
        t0 = time.perf_counter()
        view.max()
        best = min(best, time.perf_counter() - t0)
    return float(f"{view.numel() / best / 1e9:.3g}")


def measure_dram(nbytes: int = 2 << 30) -> float:
    """GB/s this process's threads read DRAM: the faster of a float32 sum and measure_dram_read's uint8 max over
    `nbytes` of ones (touched, so every page is in DRAM). The node's start measure and the bench's bound both read
    it: the max alone read 65-81 GB/s at start on boxes where the bench, taking the faster pattern, read 89-107."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    x.sum()
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    summed = float(f"{x.numel() * 4 / best / 1e9:.3g}")
    return max(summed, measure_dram_read(x.view(torch.uint8), x.numel() * 4))


NAP_AFTER_S = 1.0  # idle this long (no step in flight: a decode step's products come within ms of each other)
NAP_S = 0.0002  # then poll every 0.2 ms instead of spinning: an idle pipeline's cpu pod leaves its core alone


def wait_request(words, stop: Callable[[], bool], idle_check: float = 0.5, nap_after: float = NAP_AFTER_S) -> int:
    """Spin on the request word (words[0]) until it is non-zero, napping between polls once idle for `nap_after`
    (the first product after that waits up to a nap longer); 0 once `stop()` turns true (asked while idle)."""
    spins, start = 0, time.monotonic()
    since, napping = start, False
    while (word := int(words[0])) == 0:
        spins += 1
        if napping:
            time.sleep(NAP_S)
        if spins % 4096 == 0 and (now := time.monotonic()) - since > idle_check:
            if stop():
                return 0
            since, napping = now, now - start > nap_after
    return word


def weights_and_manifest(conn: socket.socket, name: str, pages: str | None) -> tuple[torch.Tensor, dict]:
    """A session's start: the weights region the main stage asks for (its fd sent back), then the manifest that
    says where the weights lie in it. The region as a flat uint8 tensor, and the manifest."""
    first = recv_msg(conn)
    weights = hostmem.allocate(f"{name}-weights", int(first["weights_bytes"]), pages)
    send_msg(conn, {"page": weights.page_size, "describe": weights.describe()}, [weights.fd])
    log.info("weights region: %s", weights.describe())
    manifest = recv_msg(conn)
    flat = torch.frombuffer(weights.map, dtype=torch.uint8)
    if flat.numel():
        # this mapping's page tables for the pages the main stage wrote, filled now (0.02 s a GiB): a first pass
        # faults on each page and read at half speed, which the start measurements took for the CPU's rate
        flat[::4096].max()
    return flat, manifest


def io_region(conn: socket.socket, name: str, nbytes: int, extra: dict | None = None) -> torch.Tensor:
    """The io region (flags and buffers), its fd and this server's thread count (and `extra`) sent to the main stage."""
    region = hostmem.allocate(f"{name}-io", nbytes, "shmem")
    send_msg(conn, {"threads": torch.get_num_threads(), **(extra or {})}, [region.fd])
    return torch.frombuffer(region.map, dtype=torch.uint8)


# --- the main stage's side -------------------------------------------------------------------------


class RegionClient:
    server = "the server"  # what errors call it ("strategy coprocessor: the product server")

    def __init__(self):
        self.used, self.locked = 0, []  # locked: data pointers this client page-locked (close unpins them)

    def connect(self, path: str, timeout: float = 900.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        end = time.monotonic() + timeout
        while True:
            try:
                self.sock.connect(path)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > end:
                    raise RuntimeError(f"{self.server} at {path} not there after {timeout:.0f} s (is the cpu stage "
                                       "running, and does it share /dev/shm with this pod?)") from None
                time.sleep(0.5)

    def _ask_region(self, msg: dict) -> tuple[dict, object, int]:
        """Send `msg`; map the region whose descriptor comes with the reply."""
        send_msg(self.sock, msg)
        reply = recv_msg(self.sock, max_fds=1)
        (fd,) = reply["fds"]
        try:
            return (reply, *hostmem.open_fd(fd))
        finally:
            os.close(fd)  # the mapping keeps the region

    def open_weights(self, nbytes: int, page_lock: bool = True, mapped: bool = False) -> str:
        """page_lock: copies DMA from the region; mapped too: kernels read it in place (memops.as_device)."""
        reply, self.wmap, self.wbytes = self._ask_region({"weights_bytes": nbytes})
        self.flat = torch.frombuffer(self.wmap, dtype=torch.uint8)
        if page_lock:
            self.page_lock(self.flat, self.wbytes, mapped)
        return reply["describe"]

    def page_lock(self, t: torch.Tensor, nbytes: int, mapped: bool = True) -> None:
        from . import memops
        memops.register(t.data_ptr(), nbytes, mapped=mapped)
        self.locked.append(t.data_ptr())

    def close(self) -> None:
        """Unpin what this client page-locked, then hang up (the server stops at its next idle check). CUDA keeps a
        range pinned past its unmapping: another client in this process, its region mapped at the same addresses,
        would fail to register it (cudaErrorHostMemoryAlreadyRegistered)."""
        if self.locked:
            from . import memops
            while self.locked:
                memops.unregister(self.locked.pop())
        if (sock := getattr(self, "sock", None)) is not None:
            sock.close()

    def room(self, like: torch.Tensor) -> torch.Tensor | None:
        """Room in the weights region for a tensor like `like` (4 KiB aligned); None when it is full."""
        start = hostmem.round_up(self.used, 4096)
        nbytes = like.numel() * like.element_size()
        if start + nbytes > self.wbytes:
            return None
        self.used = start + nbytes
        return self.flat[start:start + nbytes].view(like.dtype).view(like.shape)


def serve_one_session(prog: str, description: str, argv: list[str] | None,
                      handle: Callable[[socket.socket, str | None], object],
                      serve_metrics: Callable[[int], None], prepare: Callable[[], object] | None = None) -> None:
    """The server's command line: metrics, then one main stage's session (`handle`) until it closes; `prepare` runs
    on a thread of its own meanwhile (what the session would otherwise wait for: the main stage loads for a while)."""
    p = argparse.ArgumentParser(prog=f"vllm_hybrid.{prog}", description=description)
    p.add_argument("--socket", required=True, help="where to listen (the replica's shared /dev/shm)")
    p.add_argument("--pages", choices=("huge", "shmem"), help="the weights' pages (default: 2 MiB where the pod has them)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics here (the pod's probes check it)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prog} %(levelname)s %(message)s")
    if args.metrics_port:
        serve_metrics(args.metrics_port)
    if prepare:
        threading.Thread(target=prepare, name=f"{prog}-prepare", daemon=True).start()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(args.socket)
    srv.listen(1)
    logging.getLogger(f"vllm_hybrid.{prog}").info("listening on %s (threads %d)", args.socket, torch.get_num_threads())
    conn, _ = srv.accept()
    with conn:
        handle(conn, args.pages)
