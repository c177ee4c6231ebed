"""Stage supervision with stand-in processes (no vLLM): peer loss, stage-0 loss, SIGTERM."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

from vllm_hybrid.local import free_port
from vllm_hybrid.supervise import group_members, process_tree

# A stand-in for vLLM: a process that starts a grandchild and sleeps (like API server + workers).
CHILD = [sys.executable, "-c", "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(600)']); time.sleep(600)"]


def launcher(stage, port, child=CHILD, oom_flag=None):
    """A stage's launcher; with oom_flag, its container's OOM-kill count is 1 once that file exists."""
    code = textwrap.dedent(f"""
        import logging, os, sys
        from vllm_hybrid import supervise
        from vllm_hybrid.supervise import Heartbeat, run_supervised
        logging.basicConfig(level=logging.INFO)
        if {oom_flag!r}:
            supervise.oom_killed = lambda: int(os.path.exists({oom_flag!r}))
        sys.exit(run_supervised({child!r}, None, Heartbeat({stage}, 2, "127.0.0.1", {port})))
    """)
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stderr=subprocess.PIPE, text=True)


def fails_after(flag, delay):
    """A stand-in vLLM that exits 1 `delay` s after `flag` appears: an engine failing on its lost peer."""
    return [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.05)\n"
            f"time.sleep({delay}); raise SystemExit(1)"]


def kill_all(*procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def wait_connected(proc, needle="stage 1 connected", timeout=20):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        line = proc.stderr.readline()
        if needle in line:
            return
    raise AssertionError("heartbeat never connected")


def group_gone(pgid, timeout=10):
    """No live (non-zombie) process left in the process group."""
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not group_members(pgid)


def children(proc):
    """The launcher's direct children: its vLLM stand-in, which leads a process group of its own."""
    return [pid for pid in process_tree(proc.pid) - {proc.pid}
            if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == proc.pid]


def test_stage0_exits_nonzero_when_peer_dies():
    port = free_port()
    head, peer = launcher(0, port), launcher(1, port)
    try:
        wait_connected(head)
        kids = children(head)
        t0 = time.monotonic()
        os.killpg(peer.pid, signal.SIGKILL)  # the whole peer pod dies
        assert head.wait(30) == 75
        assert time.monotonic() - t0 < 30
        assert all(group_gone(k) for k in kids)  # its vLLM stand-in and grandchild are gone too
    finally:
        kill_all(head, peer)


def test_headless_stage_exits_when_stage0_goes():
    port = free_port()
    head, peer = launcher(0, port), launcher(1, port)
    try:
        wait_connected(head)
        kids = children(peer)
        os.killpg(head.pid, signal.SIGKILL)
        assert peer.wait(30) == 75
        assert all(group_gone(k) for k in kids)
    finally:
        kill_all(head, peer)


def test_sigterm_ends_every_process_of_the_stage():
    # the stand-in ignores SIGTERM, as a hung vLLM does: the launcher must SIGKILL it after the grace period
    stubborn = [sys.executable, "-c", "import signal,subprocess,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen([sys.executable,'-c','import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); time.sleep(600)"]
    port = free_port()
    head = launcher(0, port, stubborn)
    try:
        time.sleep(2)
        kids = children(head)
        assert kids
        t0 = time.monotonic()
        head.send_signal(signal.SIGTERM)
        assert head.wait(30) == 0
        assert time.monotonic() - t0 < 30
        assert all(group_gone(k, timeout=1) for k in kids)
    finally:
        kill_all(head)


def test_a_local_stage_is_stopped_when_what_started_it_dies():
    """LocalPipeline's stages run in sessions of their own: a test or bench killed by `timeout` must not leave them
    running (local.stop_with_parent). A stand-in parent starts a stand-in stage as LocalPipeline does, then is
    SIGKILLed; the stage gets SIGTERM."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        from vllm_hybrid.local import stop_with_parent
        stage = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                                 preexec_fn=stop_with_parent)
        print(stage.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    stage = int(parent.stdout.readline())
    try:
        os.kill(stage, 0)  # running while its parent is
        parent.kill()
        parent.wait(10)
        assert group_gone(stage, timeout=10)
    finally:
        parent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(stage, signal.SIGKILL)


def test_child_failure_is_the_exit_code():
    port = free_port()
    head = launcher(0, port, [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert head.wait(20) == 3


def test_a_stage_failing_because_its_peer_failed_says_peer_lost():
    """The tail's vLLM dies on its own (code 3); the head's fails a moment later because of it (code 1, as an
    engine whose peer went). The tail keeps its own code, the head reports peer lost: the operator names the
    tail's error as the replica's cause."""
    port = free_port()
    flag = f"/tmp/hybrid-peer-failed-{port}"
    tail_child = [sys.executable, "-c", f"import time; time.sleep(4); open({flag!r}, 'w').close(); raise SystemExit(3)"]
    head, peer = launcher(0, port, fails_after(flag, 0.2)), launcher(1, port, tail_child)
    try:
        wait_connected(head)
        assert peer.wait(30) == 3
        assert head.wait(30) == 75
        assert "peer lost (stage 1 closed its heartbeat); vLLM exited with code 1" in head.stderr.read()
    finally:
        kill_all(head, peer)
        if os.path.exists(flag):
            os.unlink(flag)


def test_an_oom_killed_worker_is_the_stage_s_own_cause_even_while_vllm_runs(tmp_path):
    """The kernel kills the tail's worker at load; its vLLM process lives on, the head's engine fails on the lost
    worker. The tail says OOM at once (exit 137, its heartbeat closed first) and the head follows as peer lost;
    a SIGTERM from the group restart that follows does not hide the tail's cause."""
    port, oom = free_port(), tmp_path / "oom"
    head, tail = launcher(0, port, fails_after(oom, 0.5)), launcher(1, port, oom_flag=str(oom))
    try:
        wait_connected(head)
        deadline = time.monotonic() + 20
        while len(process_tree(tail.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = max(process_tree(tail.pid) - {tail.pid})  # the stand-in vLLM's grandchild (its worker)
        os.kill(worker, signal.SIGKILL)
        oom.touch()
        tail.send_signal(signal.SIGTERM)  # the group restart's, as it comes at once
        assert tail.wait(30) == 137
        assert "vLLM is running: a process was killed by the kernel's OOM killer" in tail.stderr.read()
        assert head.wait(30) == 75
        assert "peer lost (stage 1 closed its heartbeat)" in head.stderr.read()
    finally:
        kill_all(head, tail)


def test_a_local_pipeline_clears_what_a_hard_killed_one_left(tmp_path):
    """A SIGKILLed local launcher (its instance named by a port, so its own next start rarely comes) leaves its
    segments and bookkeeping; the next local stage's launcher clears them, and nothing of a live launcher's, one
    of another pid namespace (another pod) or one without the sweep's prefix."""
    from vllm_hybrid.supervise import ShmJanitor

    def instance(name, owner, segment):
        (tmp_path / f".hybrid-{name}-r0-s0.json.owner").write_text(owner)
        (tmp_path / f".hybrid-{name}-r0-s0.json.journal").write_text(segment + "\n")
        (tmp_path / segment).write_text("")

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ns = os.readlink("/proc/self/ns/pid")
    instance("local-2222", f"{os.getpid()} {ns}", "seg-live")
    instance("local-4444", f"{dead.stdout.strip()} pid:[1]", "seg-other-pod")
    instance("llm", f"{dead.stdout.strip()} {ns}", "seg-not-local")
    state = tmp_path / ".hybrid-local-1111-r0-s1.json"
    child = [sys.executable, "-c", "import os, sys, time\n"
             "open(os.environ['HYBRID_SHM_JOURNAL'], 'a').write('seg-killed\\n')\n"
             f"open({str(tmp_path / 'seg-killed')!r}, 'w').close()\n"
             "print(os.getpid(), flush=True)\ntime.sleep(600)\n"]
    code = ("import sys\nfrom vllm_hybrid.supervise import ShmJanitor, run_supervised\n"
            f"sys.exit(run_supervised({child!r}, None, None, ShmJanitor({str(state)!r}, {str(tmp_path)!r}, "
            "'.hybrid-local-')))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "seg-killed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open(f"{state}.owner").read().split() == [str(proc.pid), ns]  # claimed while it runs
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    left = {".hybrid-local-1111-r0-s1.json.owner", ".hybrid-local-1111-r0-s1.json.journal", "seg-killed"}
    assert left <= set(os.listdir(tmp_path))
    assert ShmJanitor(str(tmp_path / ".hybrid-local-3333-r0-s0.json"), str(tmp_path)).sweep() == []  # no prefix
    # a later stage of the killed instance's own pipeline leaves it to that stage's own restart
    assert ShmJanitor(str(tmp_path / ".hybrid-local-1111-r0-s0.json"), str(tmp_path), ".hybrid-local-").sweep() == []
    before = set(os.listdir(tmp_path))
    janitor = ShmJanitor(str(tmp_path / ".hybrid-local-3333-r0-s0.json"), str(tmp_path), ".hybrid-local-")
    assert janitor.sweep() == ["seg-killed"]  # its launcher reaped: gone
    assert set(os.listdir(tmp_path)) == before - left
