"""Runs one stage's vLLM process group and ties its life to the other stages.

vLLM alone does not: a headless stage keeps running when stage 0 stops, and a stage 0 whose peer
crashed can hang and ignore SIGTERM. So every launcher keeps a heartbeat connection to stage 0's
launcher (on the plan's supervisor port); whoever loses the other ends its vLLM process group and
exits non-zero, so Kubernetes (or the operator's group restart) re-forms the whole pipeline.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

from .progress import StallWatch

log = logging.getLogger("vllm_hybrid.supervise")
HEARTBEAT_S = 1.0
PEER_TIMEOUT_S = 10.0        # silence after which a connected peer counts as lost
TERM_GRACE_S = 15.0          # SIGTERM -> SIGKILL for the vLLM process group
EXIT_PEER_LOST = 75
EXIT_SIDECAR_LOST = 76
EXIT_STALLED = 77
EXIT_OOM = 137  # as a container the kernel OOM-killed: 128 + SIGKILL
PEER_GRACE_S = 3.0  # a failed vLLM waits this long for a peer stage's heartbeat to close before it blames itself


class Heartbeat:
    """Stage 0: accepts one connection per peer stage and watches them. Peers: keep one open."""

    def __init__(self, stage: int, stages: int, master_addr: str, port: int):
        self.stage, self.stages, self.master_addr, self.port = stage, stages, master_addr, port
        self.lost: str | None = None
        self.connected: set[int] = set()
        self._stop = threading.Event()

    def start(self) -> None:
        target = self._serve if self.stage == 0 else self._client
        threading.Thread(target=target, name="hybrid-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def wait_lost(self, timeout: float) -> str | None:
        """Why a peer is gone, waiting up to `timeout` for one to go (a peer's launcher closes its heartbeat
        once its own vLLM's processes are down)."""
        end = time.monotonic() + timeout
        while self.lost is None and time.monotonic() < end:
            time.sleep(0.1)
        return self.lost

    def _serve(self) -> None:
        srv = socket.create_server(("", self.port), reuse_port=False)
        srv.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(srv, selectors.EVENT_READ, None)
        last_seen: dict[socket.socket, float] = {}
        peer_of: dict[socket.socket, int] = {}
        buf: dict[socket.socket, bytes] = {}
        next_beat = 0.0
        while not self._stop.is_set() and self.lost is None:
            for key, _ in sel.select(timeout=0.2):
                if key.data is None:
                    conn, _ = srv.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, "peer")
                    last_seen[conn], buf[conn] = time.monotonic(), b""
                    continue
                conn = key.fileobj
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    self._drop(sel, conn, last_seen, buf)
                    if conn in peer_of:
                        self.lost = f"stage {peer_of[conn]} closed its heartbeat"
                    continue
                last_seen[conn] = time.monotonic()
                buf[conn] += data
                if conn not in peer_of and b"\n" in buf[conn]:
                    line = buf[conn].split(b"\n", 1)[0].decode(errors="replace")
                    if line.startswith("stage "):
                        peer_of[conn] = int(line.split()[1])
                        self.connected.add(peer_of[conn])
                        log.info("heartbeat: stage %s connected", peer_of[conn])
            now = time.monotonic()
            for conn, seen in list(last_seen.items()):
                if conn in peer_of and now - seen > PEER_TIMEOUT_S:
                    self.lost = f"stage {peer_of[conn]} silent for {now - seen:.0f}s"
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                for conn in list(last_seen):
                    try:
                        conn.send(b".")
                    except OSError:
                        pass
        for conn in list(last_seen):  # stopped: the peers learn it now, not when this process exits
            self._drop(sel, conn, last_seen, buf)
        srv.close()

    @staticmethod
    def _drop(sel, conn, last_seen, buf) -> None:
        sel.unregister(conn)
        last_seen.pop(conn, None)
        buf.pop(conn, None)
        conn.close()

    def _client(self) -> None:
        sock = None
        while not self._stop.is_set() and sock is None:  # stage 0 may start later than us
            try:
                sock = socket.create_connection((self.master_addr, self.port), timeout=2)
            except OSError:
                time.sleep(1)
        if sock is None:
            return
        sock.settimeout(HEARTBEAT_S)
        sock.sendall(f"stage {self.stage}\n".encode())
        self.connected.add(0)
        last_seen, next_beat = time.monotonic(), 0.0
        while not self._stop.is_set():
            try:
                data = sock.recv(4096)
                if not data:
                    self.lost = "stage 0 closed its heartbeat"
                    break
                last_seen = time.monotonic()
            except TimeoutError:
                pass
            except OSError as e:
                self.lost = f"stage 0 heartbeat failed: {e}"
                break
            now = time.monotonic()
            if now - last_seen > PEER_TIMEOUT_S:
                self.lost = f"stage 0 silent for {now - last_seen:.0f}s"
                break
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                try:
                    sock.sendall(b".")
                except OSError as e:
                    self.lost = f"stage 0 heartbeat failed: {e}"
                    break
        sock.close()


def process_tree(root: int) -> set[int]:
    """root and all its live descendants, from /proc parent links."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z":
            parent[int(pid)] = int(stat[1])
    tree, frontier = set(), {root} & set(parent)
    while frontier:
        tree |= frontier
        frontier = {p for p, pp in parent.items() if pp in frontier} - tree
    return tree


def shm_in_use(pids) -> set[str]:
    """/dev/shm entries (segments, semaphores) that these processes map or hold open."""
    names = set()
    for pid in pids:
        try:
            for line in open(f"/proc/{pid}/maps"):
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    names.add(target[9:].split()[0])
        except OSError:
            continue
    return names


class ShmJanitor:
    """Removes the /dev/shm segments vLLM leaves behind when a stage dies hard.

    vLLM's message queues and locks live in /dev/shm, which CPU and GPU pods of a replica share;
    a SIGKILLed stage never unlinks them. The launcher records what its processes map (in a state
    file beside them) and unlinks it when the stage ends, or at the next start after a hard kill.
    """

    def __init__(self, state: str, shm_dir: str = "/dev/shm", sweep: str | None = None):
        self.state, self.dir, self.owned = state, shm_dir, set()
        self.journal = state + ".journal"  # names vLLM's processes write as they create them (vllm_patches/process.py)
        self.owner = state + ".owner"  # this launcher's pid and pid namespace, while it runs (where it sweeps)
        # other instances' bookkeeping with this prefix whose launcher is gone is ours to clear (local runs: a
        # random port names each, so a hard-killed one's next start, which would clear it, never comes)
        self.sweep_prefix = sweep

    def claim(self) -> None:
        with open(self.owner, "w") as f:
            f.write(f"{os.getpid()} {_pid_namespace()}\n")

    def sweep(self) -> list[str]:
        """Clear what launchers of other instances (names starting with sweep_prefix) left when they were killed
        hard: their owner file names a pid of this pid namespace that no longer runs."""
        removed = []
        own = os.path.basename(self.state).rsplit("-r", 1)[0] + "-r"  # this instance's stages: their own restarts
        for entry in sorted(os.listdir(self.dir)) if self.sweep_prefix else ():
            path = os.path.join(self.dir, entry)
            if not (entry.startswith(self.sweep_prefix) and entry.endswith(".owner")) or entry.startswith(own):
                continue
            try:
                pid, ns = open(path).read().split()
            except (OSError, ValueError):
                continue
            if ns != _pid_namespace() or ns == "unknown" or _alive(int(pid)):  # without /proc: nothing is known
                continue
            other = ShmJanitor(path[:-len(".owner")], self.dir)
            removed += other.cleanup_previous()
            other._forget()  # the names still mapped by its dying processes, if any, go with our own at our end
            self._own(set(other.owned))
            with contextlib.suppress(OSError):
                os.unlink(other.state[:-len(".json")] + ".progress")  # its stall watch's record
        return removed

    def record(self, pids) -> None:
        self._own(shm_in_use(pids) - {os.path.basename(self.state), os.path.basename(self.journal)})

    def _own(self, names: set[str]) -> None:
        if names - self.owned:
            self.owned |= names
            tmp = self.state + ".tmp"
            with open(tmp, "w") as f:
                json.dump(sorted(self.owned), f)
            os.replace(tmp, self.state)

    def _existing(self, names) -> set[str]:
        return {n for n in names if os.path.lexists(os.path.join(self.dir, n))}

    def journaled(self) -> set[str]:
        try:
            with open(self.journal) as f:
                return {line.strip() for line in f if line.strip() and "/" not in line}
        except OSError:
            return set()

    def cleanup(self, names=None) -> list[str]:
        names = (self.owned if names is None else set(names)) | self.journaled()
        busy = shm_in_use(int(p) for p in os.listdir("/proc") if p.isdigit())
        removed = []
        for name in sorted(set(names) - busy):  # never one a live process still maps
            try:
                os.unlink(os.path.join(self.dir, name))
                removed.append(name)
            except OSError:
                pass
        return removed

    def cleanup_previous(self) -> list[str]:
        try:
            names = set(json.load(open(self.state)))
        except (OSError, ValueError):
            names = set()
        names |= self.journaled()
        removed = self.cleanup(names)
        self._forget()
        # one a process of the previous run still mapped (it was dying): still ours, removed at this run's end
        self._own(self._existing(names - set(removed)))
        return removed

    def finish(self, wait_s: float = 5.0) -> None:
        end = time.monotonic() + wait_s
        # the stage's processes may still be unmapping as they exit: retry what was busy for a few seconds
        while self._existing(self.owned | self.journaled()) - set(self.cleanup()) and time.monotonic() < end:
            time.sleep(0.2)
        self._forget()

    def _forget(self) -> None:
        for path in (self.state, self.journal, self.owner):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _alive(pid: int) -> bool:
    """Running, not a zombie: a killed launcher whose parent has not reaped it yet is gone too."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def group_members(pgid: int) -> dict[int, bool]:
    """Live processes of a process group -> whether each is a multiprocessing resource tracker."""
    members = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if int(stat[2]) != pgid or stat[0] == "Z":
                continue
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        members[int(pid)] = b"resource_tracker" in cmdline
    return members


def _kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def terminate_group(proc: subprocess.Popen, grace: float = TERM_GRACE_S) -> None:
    """SIGTERM the whole vLLM process group, SIGKILL what is left after `grace` seconds.

    Python's resource trackers are spared the first SIGKILL: they ignore SIGTERM and unlink the
    shared-memory segments and semaphores of their (now dead) clients once those are gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    workers_gone = lambda: proc.poll() is not None and not any(  # noqa: E731
        not tracker for tracker in group_members(proc.pid).values())
    if not _wait_until(workers_gone, grace):
        _kill(pid for pid, tracker in group_members(proc.pid).items() if not tracker)
    proc.wait()
    if not _wait_until(lambda: not group_members(proc.pid), 5):
        _kill(group_members(proc.pid))


def on_parent_death(sig: int) -> None:
    """In a child (Popen's preexec_fn): `sig` once the process that started it dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def _die_with_parent() -> None:
    """In the vLLM child: get SIGKILL if the launcher dies (a SIGKILLed launcher cannot clean up;
    vLLM's engine and workers already exit when their parent does)."""
    on_parent_death(signal.SIGKILL)


TERMINATION_LOG = "/dev/termination-log"  # the kubelet's default terminationMessagePath
ERROR_LINE = re.compile(r"\b\w*(Error|Exception|Exit)\b[:(]|\berror\b:|Traceback|Killed|out of memory", re.I)
# a Python exception as printed at the end of a traceback, maybe after vLLM's "(Worker pid=N) " prefix or
# its logger's "ERROR <time> [file:line] "
EXCEPTION_LINE = re.compile(r"(^|\) |\] )[A-Za-z_][\w.]*(Error|Exception): ")
# vLLM's engine re-raising a worker's failure: the worker's own exception, printed before, says more
WRAPPER = re.compile(r"root cause|see (the )?stack trace|initialization failed|failed to start", re.I)


class OutputTail:
    """Copies the vLLM process group's output to ours, keeping its last lines: where a failure says why."""

    def __init__(self, stream, keep: int = 200):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._thread = threading.Thread(target=self._copy, args=(stream,), name="hybrid-output", daemon=True)
        self._thread.start()

    def _copy(self, stream) -> None:
        out = sys.stdout.buffer
        for raw in iter(stream.readline, b""):
            out.write(raw)
            out.flush()
            self.lines.append(raw.decode(errors="replace").rstrip())

    def error_line(self, wait: float = 2.0) -> str:
        """Why the group failed: the first exception raised (a worker's, before the engine's "see the root cause"
        wrappers), else the last line that names an error, else the last line."""
        self._thread.join(wait)  # the rest of a dying process group's output
        lines = [ln.strip() for ln in self.lines if ln.strip()]
        raised = [ln for ln in lines if EXCEPTION_LINE.search(ln) and not WRAPPER.search(ln)]
        hits = [ln for ln in lines if ERROR_LINE.search(ln) and not ln.startswith(("Traceback", "File "))]
        return unreadable_note((raised[:1] or hits[-1:] or lines[-1:] or [""])[0][-400:])


def unreadable_note(line: str, readable=lambda path: os.access(path, os.R_OK)) -> str:
    """vLLM reports a weight file this uid cannot read as missing (FileNotFoundError): say what it is."""
    for path in re.findall(r"(/[^\s'\"`,:]+)", line):
        if os.path.exists(path) and not readable(path):
            return f"{line} ({path} exists but uid {os.getuid()} cannot read it)"
    return line


OOM_LINE = ("a process was killed by the kernel's OOM killer (the pod's memory limit is too small for this "
            "stage)")


def oom_killed() -> int:
    """OOM kills in this container's memory cgroup so far (cgroup v2 memory.events, v1 memory.oom_control)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        with contextlib.suppress(OSError, ValueError):
            for line in open(path):
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    return 0


def termination_message(text: str, path: str | None = None) -> None:
    """One line for `kubectl describe` and the operator's status; only where the kubelet provides the file."""
    path = path or TERMINATION_LOG
    if os.path.exists(path):
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(text[:1000] + "\n")


def _stopping(why: str) -> None:
    log.error("%s", why)
    termination_message(why)


def _wait_for(path: str, side: subprocess.Popen, stopping: threading.Event) -> bool:
    """Until `path` exists: False if the process exits or the stage is told to stop first."""
    while not os.path.exists(path):
        if side.poll() is not None or stopping.wait(0.2):
            return False
    return True


def run_supervised(argv: list[str], env: dict[str, str] | None, heartbeat: Heartbeat | None,
                   janitor: ShmJanitor | None = None, sidecar: list[str] | None = None,
                   stall: StallWatch | None = None, sidecar_ready: str | None = None) -> int:
    """Start vLLM in its own process group; return its exit code, or EXIT_PEER_LOST.
    sidecar: a process the stage needs beside vLLM (the GEMM helper), started first (and vLLM only once
    the path sidecar_ready exists); if it dies, the stage stops with EXIT_SIDECAR_LOST (its CPU stages
    cannot compute without it).
    stall: the worker's progress record; no progress with requests pending -> EXIT_STALLED."""
    stopping = threading.Event()
    env = {**(os.environ if env is None else env), "HYBRID_LAUNCHER_PID": str(os.getpid())}  # die-with-parent reads it
    if janitor:
        env["HYBRID_SHM_JOURNAL"] = janitor.journal
    previous = {s: signal.signal(s, lambda *_: stopping.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    if janitor:
        if removed := janitor.cleanup_previous():
            log.info("removed %d /dev/shm entries left by this stage's previous run", len(removed))
        if janitor.sweep_prefix:  # only sweeps read owner files: an instance that sweeps can be swept
            if removed := janitor.sweep():
                log.info("removed %d /dev/shm entries left by hard-killed local pipelines", len(removed))
            janitor.claim()
    if stall:
        stall.create()
    side = sidecar and subprocess.Popen(sidecar, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    if side and sidecar_ready and not _wait_for(sidecar_ready, side, stopping):
        _stopping(f"{sidecar[2]} exited with code {side.poll()} before it was ready")
        terminate_group(side, grace=5)
        return EXIT_SIDECAR_LOST
    ooms = oom_killed()
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = OutputTail(proc.stdout)
    if heartbeat:
        heartbeat.start()
    next_scan = 0.0
    try:
        while True:
            if janitor and time.monotonic() >= next_scan:
                next_scan = time.monotonic() + 2
                janitor.record(process_tree(proc.pid))
            code = proc.poll()
            if oom_killed() > ooms:
                # the kernel killed one of vLLM's processes (a worker, at load): this stage's own cause, said before
                # its peers fail on the lost worker and before a group restart's SIGTERM could hide it
                _stopping(f"vLLM {'is running' if code is None else f'exited with code {code}'}: {OOM_LINE}")
                if heartbeat:
                    heartbeat.stop()  # the peers stop now, as followers ("peer lost")
                terminate_group(proc, grace=5)
                return EXIT_OOM
            if code is not None:
                terminate_group(proc, grace=5)  # workers it left behind
                if code == 0:
                    log.info("vLLM exited with code 0")
                elif heartbeat and heartbeat.wait_lost(PEER_GRACE_S):
                    # vLLM failed because another stage went (its engine start or a step lost the peer): that
                    # stage's own error is the replica's cause, not this one (the operator reads the exit code)
                    _stopping(f"peer lost ({heartbeat.lost}); vLLM exited with code {code}: {tail.error_line()}")
                    return EXIT_PEER_LOST
                else:
                    _stopping(f"vLLM exited with code {code}: {tail.error_line()}")
                return code
            if stopping.is_set():
                log.info("termination requested: stopping vLLM")
                terminate_group(proc)
                return 0
            if heartbeat and heartbeat.lost:
                _stopping(f"peer lost ({heartbeat.lost}): stopping this stage so the pipeline restarts")
                terminate_group(proc, grace=5)
                return EXIT_PEER_LOST
            if stall and (why := stall.check()):
                _stopping(f"pipeline stalled: {why}; stopping this stage so the pipeline restarts")
                terminate_group(proc, grace=5)  # a stopped (hung) worker ignores SIGTERM: SIGKILL follows
                return EXIT_STALLED
            if side and side.poll() is not None:
                _stopping(f"{sidecar[2]} exited with code {side.returncode}: stopping this stage")
                terminate_group(proc, grace=5)
                return EXIT_SIDECAR_LOST
            stopping.wait(0.2)
    finally:
        if side:
            terminate_group(side, grace=5)
        if janitor:
            janitor.finish()
        if stall:
            stall.remove()
        if heartbeat:
            heartbeat.stop()
        for s, h in previous.items():
            signal.signal(s, h)
