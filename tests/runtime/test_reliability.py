"""Stage failures on a real 2-stage CPU pipeline, supervised like pods (issue: reliability).

Kill the non-head stage under streaming load -> every in-flight request ends within 30 s, stage 0's
/health fails and its launcher exits non-zero; restart -> it serves again. Kill stage 0 -> the other
stage exits by itself. Five rounds, no leaked processes or /dev/shm segments.
Stalls (plan stall_timeout 12 s), on every stage: a hung worker (its launcher alive) and a frozen stage
end the requests and take the pipeline down by themselves; a stage slowed to a tenth of a CPU does not.
"""
import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from pipelines import CPU_ENVS, plan_for
from vllm_hybrid.local import LocalPipeline, local_ports
from vllm_hybrid.supervise import process_tree, shm_in_use

pytestmark = pytest.mark.slow
ROUNDS = int(os.environ.get("HYBRID_FAILURE_ROUNDS", "2"))  # 2: each round restarts the pipeline twice (~30 s each on 2 cores), CI has an hour; HYBRID_FAILURE_ROUNDS for more
REPORT = {}
STALL_TIMEOUT = 12  # the plan's: seconds with requests pending and no step before a stage restarts
AT_IMPORT = set(os.listdir("/dev/shm"))
# /dev/shm as this module's pipeline first starts: what earlier tests' processes left there is not this pipeline's
# (a CI run once failed all three leak checks on two vLLM message queues an earlier test's engine left; the report
# lists such entries as left_before_these_tests)
PRE_EXISTING: set[str] = set()


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if not n.startswith(".hybrid-")} - PRE_EXISTING


def unmapped_shm() -> set[str]:
    """New /dev/shm entries no live process maps: leaks (other programs' live segments don't count)."""
    in_use = shm_in_use(int(p) for p in os.listdir("/proc") if p.isdigit())
    return {n for n in os.listdir("/dev/shm") if not n.startswith(".hybrid-")} - PRE_EXISTING - in_use


def alive(pids) -> set[int]:
    live = set()
    for pid in pids:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                live.add(pid)
        except OSError:
            pass
    return live


def stream(url, outcome, i, max_tokens=2000, gaps=None):
    body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    t0 = last = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=60)) as r:
            if r.status_code != 200:
                outcome[i] = (f"rejected:{r.status_code}:{r.read()[:300]!r}", time.monotonic())
                return
            done, reason = False, None
            for line in r.iter_lines():
                if gaps is not None and line:  # the longest wait between two chunks: the pipeline's slowest step
                    gaps[i] = max(gaps.get(i, 0.0), time.monotonic() - last)
                    last = time.monotonic()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"])
                    reason = (chunk.get("choices") or [{}])[0].get("finish_reason") or reason
                done |= line == "data: [DONE]"
            if not done:  # the server closed the stream midway: an error to any OpenAI client
                raise ConnectionError("stream ended without [DONE]")
            if reason != "length":  # vLLM ends requests of a dead engine as finish_reason "abort"
                raise RuntimeError(f"finish_reason {reason}")
        outcome[i] = ("finished", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the point: it ends, with an error
        outcome[i] = (f"error:{type(e).__name__}", time.monotonic())


@pytest.fixture(scope="module")
def pipe(tiny_llama, tmp_path_factory):
    plan = plan_for(tiny_llama, max_model_len=2048, stall_timeout=STALL_TIMEOUT, **local_ports())
    p = LocalPipeline(plan, tmp_path_factory.mktemp("rel"), CPU_ENVS)
    PRE_EXISTING.update(os.listdir("/dev/shm"))
    REPORT["left_before_these_tests"] = sorted(PRE_EXISTING - AT_IMPORT)
    yield p
    p.stop()
    Path(os.environ.get("HYBRID_REPORT_DIR", p.workdir)).joinpath("reliability.json").write_text(json.dumps(REPORT, indent=1))


def test_stage_failure_rounds(pipe):
    pipe.start()
    pipe.wait_ready()
    rounds = []
    for n in range(ROUNDS):
        # 1) the non-head stage dies (whole pod: launcher and vLLM) while 4 streams are in flight
        outcome: dict[int, tuple] = {}
        threads = [threading.Thread(target=stream, args=(pipe.url, outcome, i)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(3)
        assert pipe.healthy()
        stage_pids = [process_tree(p.pid) for p in pipe.procs]
        t_kill = time.monotonic()
        os.killpg(pipe.procs[1].pid, signal.SIGKILL)  # the launcher dies hard: its vLLM must follow
        for t in threads:
            t.join(35)
        assert not any(t.is_alive() for t in threads), "a request hung after its pipeline lost a stage"
        assert all(o[0].startswith("error") for o in outcome.values()), outcome
        ended = max(o[1] for o in outcome.values()) - t_kill
        assert pipe.procs[0].wait(30) not in (0, None)  # stage 0 exits non-zero, within 30 s
        exit_s = time.monotonic() - t_kill
        assert not pipe.healthy()
        # 2) "Kubernetes" restarts the group -> it serves again
        t_restart = time.monotonic()
        pipe.start()
        pipe.wait_ready()
        recovery = time.monotonic() - t_restart
        r = httpx.post(pipe.url + "/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        # 3) stage 0 dies -> the headless stage exits by itself
        stage_pids += [process_tree(p.pid) for p in pipe.procs]
        t_kill0 = time.monotonic()
        os.killpg(pipe.procs[0].pid, signal.SIGKILL)
        assert pipe.procs[1].wait(30) is not None
        headless_exit = time.monotonic() - t_kill0
        everyone = set().union(*stage_pids)
        deadline = time.monotonic() + 15
        while alive(everyone) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive(everyone), "processes of a dead stage are still running"
        time.sleep(2)
        left_at_death = shm_names()
        rounds.append({"requests_ended_s": round(ended, 1), "stage0_exit_s": round(exit_s, 1),
                       "recovery_s": round(recovery, 1), "headless_exit_s": round(headless_exit, 1),
                       })
        pipe.start()
        pipe.wait_ready()
        rounds[-1].update(shm_left_at_death=len(left_at_death),
                          shm_left_after_restart=len(left_at_death & shm_names()))
    REPORT["rounds"] = rounds
    print(json.dumps(rounds))
    # what hard-killed stages left in /dev/shm is gone once they restart: nothing piles up
    assert all(r["shm_left_after_restart"] == 0 for r in rounds), rounds


def worker_of(pipe, stage) -> int:
    """The stage's vLLM worker (vLLM titles it VLLM::Worker_PP<rank>): where a hung kernel would hang."""
    for pid in process_tree(pipe.procs[stage].pid):
        try:
            if open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"VLLM::Worker"):
                return pid
        except OSError:
            pass
    raise AssertionError(f"no vLLM worker under stage {stage}'s launcher")


def signal_all(pids, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def start_streams(pipe, outcome, **kw) -> list[threading.Thread]:
    threads = [threading.Thread(target=stream, args=(pipe.url, outcome, i), kwargs=kw) for i in range(4)]
    for t in threads:
        t.start()
    return threads


def stall_round(pipe, stage: int, fault: str) -> dict:
    """4 streams in flight, then `fault` on `stage`: every in-flight request must end with an error, stage 0's
    /health fail and every stage that is not frozen exit non-zero by itself; a frozen one is SIGKILLed then
    (what the group restart or, for stage 0, the liveness probe does); the restarted pipeline serves."""
    outcome: dict[int, tuple] = {}
    threads = start_streams(pipe, outcome)
    time.sleep(3)
    assert pipe.healthy()
    pids = set().union(*(process_tree(p.pid) for p in pipe.procs))
    frozen = process_tree(pipe.procs[stage].pid) if fault == "frozen stage" else set()
    t0 = time.monotonic()
    if fault == "hung worker":  # its launcher keeps running and beating
        os.kill(worker_of(pipe, stage), signal.SIGSTOP)
    else:
        signal_all(frozen, signal.SIGSTOP)
    seen: dict[str, float] = {}
    others = [i for i in range(len(pipe.procs)) if not (frozen and i == stage)]
    deadline = t0 + STALL_TIMEOUT + 40
    while time.monotonic() < deadline and not ({"health", "exited"} <= set(seen)):
        if "health" not in seen and not pipe.healthy():
            seen["health"] = time.monotonic() - t0
        if "exited" not in seen and all(pipe.procs[i].poll() is not None for i in others):
            seen["exited"] = time.monotonic() - t0
        time.sleep(0.25)
    assert {"health", "exited"} <= set(seen), f"{fault} on stage {stage}: only {seen} after {deadline - t0:.0f}s"
    codes = [pipe.procs[i].returncode for i in others]
    assert all(c not in (0, None) for c in codes), codes
    if frozen:  # nothing inside a frozen pod can act: it is killed from outside. As in test_stage_failure_rounds
        # the launcher dies hard and its vLLM follows; the resource trackers, thawed, unlink what those held
        os.killpg(pipe.procs[stage].pid, signal.SIGKILL)
        pipe.procs[stage].wait(30)
        time.sleep(1)
        signal_all(frozen, signal.SIGCONT)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), f"a request hung after {fault} on stage {stage}"
    assert all(o[0].startswith("error") for o in outcome.values()), outcome
    ended = max(o[1] for o in outcome.values()) - t0
    deadline = time.monotonic() + 15
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pids), f"processes left after {fault} on stage {stage}"
    t_restart = time.monotonic()
    pipe.start()
    pipe.wait_ready()
    recovery = time.monotonic() - t_restart
    r = httpx.post(pipe.url + "/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    return {"stage": stage, "fault": fault, "health_failed_s": round(seen["health"], 1),
            "stages_exited_s": round(seen["exited"], 1), "requests_ended_s": round(ended, 1),
            "exit_codes": codes, "recovery_s": round(recovery, 1)}


def slow_round(pipe, stage: int, seconds: float = 20) -> dict:
    """The stage's processes get a tenth of a CPU (run 10 ms of every 100 ms, as a CFS quota of 10% does):
    requests slow down but finish, and no stage restarts. Margin: stall timeout / longest step seen."""
    tree = process_tree(pipe.procs[stage].pid)
    stop = threading.Event()

    def throttle():
        while not stop.is_set():
            signal_all(tree, signal.SIGCONT)
            time.sleep(0.01)
            signal_all(tree, signal.SIGSTOP)
            time.sleep(0.09)
        signal_all(tree, signal.SIGCONT)

    t = threading.Thread(target=throttle)
    t.start()
    outcome, gaps = {}, {}
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:  # waves of 4 streams, each request short enough to finish
            threads = start_streams(pipe, outcome, max_tokens=40, gaps=gaps)
            for th in threads:
                th.join(120)
            assert all(o[0] == "finished" for o in outcome.values()), outcome
    finally:
        stop.set()
        t.join()
    assert all(p.poll() is None for p in pipe.procs) and pipe.healthy()
    slowest = max(gaps.values())
    return {"stage": stage, "fault": "slow stage (1/10 CPU)", "longest_gap_s": round(slowest, 2),
            "stall_timeout_s": STALL_TIMEOUT, "margin_x": round(STALL_TIMEOUT / slowest, 1)}


def test_stalls_restart_the_pipeline(pipe):
    """Hung worker, frozen stage and slow stage, on every stage."""
    if not pipe.healthy():
        pipe.start()
        pipe.wait_ready()
    rounds = []
    for stage in range(len(pipe.procs)):
        rounds.append(slow_round(pipe, stage))
        for fault in ("hung worker", "frozen stage"):
            rounds.append(stall_round(pipe, stage, fault))
            print(json.dumps(rounds[-1]), flush=True)
    REPORT["stall_rounds"] = rounds
    print(json.dumps(rounds, indent=1))
    hung = [r for r in rounds if r["fault"] == "hung worker"]
    # detection follows the stall timeout (plus the 5 s SIGTERM grace of a group that will not stop)
    assert all(r["stages_exited_s"] < STALL_TIMEOUT + 20 for r in hung), hung


def test_the_next_local_pipeline_clears_what_a_hard_killed_one_left(pipe, tiny_llama, tmp_path):
    """The whole local pipeline killed hard (a closed session, kill -9): its port-named instance never starts
    again to clear its /dev/shm, so the next local pipeline's stages do, before their vLLM starts."""
    if not pipe.healthy():
        pipe.start()
        pipe.wait_ready()
    pids = set().union(*(process_tree(p.pid) for p in pipe.procs))
    for p in pipe.procs:
        os.killpg(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pids)
    time.sleep(2)  # as in the rounds: the resource trackers unlink what they can
    prefix = f".hybrid-local-{pipe.plan['api_port']}-"
    books = {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    left = unmapped_shm()
    assert {n for n in books if n.endswith(".owner")} == {f"{prefix}r0-s{i}.json.owner" for i in range(len(pipe.procs))}
    nxt = LocalPipeline(plan_for(tiny_llama, max_model_len=2048, **local_ports()), tmp_path, CPU_ENVS)
    try:
        nxt.start()
        nxt.wait_ready()
        REPORT["hard_killed_pipeline"] = {"shm_left": len(left), "bookkeeping_left": len(books),
                                          "after_the_next_start": len((left | books) & set(os.listdir("/dev/shm")))}
        assert not (left | books) & set(os.listdir("/dev/shm")), REPORT["hard_killed_pipeline"]
        assert "left by hard-killed local pipelines" in nxt.log(0) + nxt.log(1)
    finally:
        nxt.stop()


def test_nothing_left_behind(pipe):
    """After the last (clean) stop, no process of ours and no unmapped /dev/shm entry is left."""
    pids = set().union(*(process_tree(p.pid) for p in pipe.procs))
    pipe.stop()
    assert not alive(pids)
    leaked = sorted(unmapped_shm())
    REPORT["shm_leaked_after_stop"] = leaked
    assert leaked == []
