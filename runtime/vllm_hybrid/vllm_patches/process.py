"""Every vLLM process of a stage: it dies with its parent, and journals the /dev/shm names it creates."""
from __future__ import annotations

import functools
import os


def die_with_parent() -> str | None:
    # Not an upstream function: every vLLM process (API server, engine core, workers) asks the
    # kernel for SIGKILL when its parent dies. vLLM's workers otherwise outlive a killed parent while
    # blocked in a pipeline receive, holding ports and memory; with this, a stage whose launcher is
    # killed goes down as a whole, like a pod.
    import ctypes
    import signal

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl

    def ask_for_sigkill():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    ask_for_sigkill()
    # fork clears the request, and forked children (the CPU engine core and worker) load no plugin again
    forked_by = [0]

    def in_child():
        ask_for_sigkill()
        if os.getppid() != forked_by[0]:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=lambda: forked_by.__setitem__(0, os.getpid()), after_in_child=in_child)
    # orphaned before the call above took effect: re-parented to init. In a container the launcher
    # itself is PID 1 (it stops the whole group), so there a parent of 1 is just the launcher.
    if os.getppid() == 1 and os.environ.get("HYBRID_LAUNCHER_PID") != "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return "die with parent"


def journal_shm_names(journal: str) -> str | None:
    # Not upstream functions: multiprocessing's SharedMemory.__init__ and SemLock.__init__, what vLLM's
    # message queues and locks are made of, append each /dev/shm name they create to the stage's journal
    # (O_APPEND, so a line is whole even from many processes). A hard-killed stage never unlinks them; the
    # launcher's next start removes what the journal names. Its periodic scan alone missed names made
    # between two scans (a sem.mp-* left after a crash loop, now and then).
    from multiprocessing import shared_memory, synchronize

    def note(name: str) -> None:
        fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{name}\n".encode())
        finally:
            os.close(fd)

    shm_init, sem_init = shared_memory.SharedMemory.__init__, synchronize.SemLock.__init__

    @functools.wraps(shm_init)
    def shared_memory_init(self, name=None, create=False, size=0, *args, **kwargs):
        shm_init(self, name, create, size, *args, **kwargs)
        if create:
            note(self._name.lstrip("/"))

    @functools.wraps(sem_init)
    def semlock_init(self, *args, **kwargs):
        sem_init(self, *args, **kwargs)
        if name := getattr(self._semlock, "name", None):  # None: unlinked at once (fork context)
            note("sem." + name.lstrip("/"))

    shared_memory.SharedMemory.__init__ = shared_memory_init
    synchronize.SemLock.__init__ = semlock_init
    return "SharedMemory/SemLock.__init__(journal /dev/shm names)"
