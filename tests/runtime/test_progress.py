"""Stall detection without vLLM: the worker's progress record and the launcher's watch over it."""
import sys
import time
from types import SimpleNamespace

import pytest
from vllm_hybrid import progress
from vllm_hybrid.identity import Identity
from vllm_hybrid.launcher import resolve_stage, stall_timeouts, vllm_env
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import model_shape, split_layers
from vllm_hybrid.progress import ProgressWriter, StallWatch, default_timeouts, size_bucket
from vllm_hybrid.supervise import EXIT_SIDECAR_LOST, EXIT_STALLED, run_supervised


def step(new=(), cached=(), finished=(), tokens=1):
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached)),
                           finished_req_ids=set(finished), total_num_scheduled_tokens=tokens)


@pytest.fixture
def watch(tmp_path):
    w = StallWatch(str(tmp_path / "p"), timeout=10, compile_timeout=100)
    w.create()
    return w


def test_idle_pipeline_never_stalls(watch):
    assert watch.check() is None  # nothing written yet (weights loading)
    w = ProgressWriter(watch.path)
    assert watch.check(time.monotonic() + 1000) is None  # no step yet
    w.step_started(step(new=["a"], tokens=8))
    w.step_finished()
    w.step_started(step(cached=["a"]))  # decode, bucket 1: first of its size -> grace
    w.step_finished()
    w.step_started(step(cached=["a"]))
    w.step_finished()
    w.step_started(step(finished=["a"], tokens=0))  # the empty step bringing the finished id
    w.step_finished()
    assert watch.check(time.monotonic() + 1000) is None


def test_pending_work_without_steps_is_a_stall(watch):
    w = ProgressWriter(watch.path)
    for _ in range(2):
        w.step_started(step(new=["a", "b"], tokens=2) if not w.steps else step(cached=["a", "b"], tokens=2))
        w.step_finished()
    now = time.monotonic()
    assert watch.check(now + 9) is None
    why = watch.check(now + 11)
    assert why and "2 request(s) pending" in why and "limit 10s" in why
    # frozen mid-step: same verdict (the last step's end is what counts)
    w.step_started(step(cached=["a", "b"], tokens=2))
    assert watch.check(time.monotonic() + 11)


def test_new_batch_size_gets_the_compile_grace(watch):
    w = ProgressWriter(watch.path)
    w.step_started(step(new=["a"], tokens=1))
    w.step_finished()
    w.step_started(step(cached=["a"], new=["b", "c"], tokens=300))  # bucket 512: new
    now = time.monotonic()
    assert watch.check(now + 50) is None
    assert "new batch size" in watch.check(now + 101)


def test_work_arriving_after_a_pause_starts_the_clock(watch):
    w = ProgressWriter(watch.path)
    w.step_started(step(new=["a"]))
    w.step_finished()
    w.step_started(step(finished=["a"], tokens=0))
    w.step_finished()
    w.last_progress -= 1000  # an hour-long pause, then a request
    w.step_started(step(new=["b"]))
    assert watch.check(time.monotonic() + 5) is None


def test_a_torn_record_keeps_the_last_snapshot(watch):
    w = ProgressWriter(watch.path)
    w.step_started(step(new=["a"]))
    assert watch.check() is None
    w._map[0:8] = (w._version + 1).to_bytes(8, "little")  # odd version: the writer froze mid-update
    assert watch.check(time.monotonic() + 101)  # (its first step: compile grace)


def test_buckets():
    assert [size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 512, 513)] == [1, 1, 2, 4, 4, 8, 512, 1024]


def test_default_timeouts_follow_the_expected_step(tmp_path):
    assert default_timeouts(0.01) == (60.0, 300.0)
    assert default_timeouts(10) == (200.0, 1000.0)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}
    raw = {"model": "m", "dtype": "bfloat16", "stages": [
        {"name": "gpu", "device": "gpu", "layers": 16, "memory": "80Gi"},
        {"name": "cpu", "device": "cpu", "layers": 16, "cpus": 16, "memory": "64Gi"}]}
    plan = plan_from_dict(raw)
    split = split_layers(plan, model_shape(cfg, plan.dtype))
    timeout, grace = stall_timeouts(plan, split)
    # 16 8B-sized layers + LM head on 16 cores: a 4096-token chunk takes seconds, so well above the floor
    assert 100 < timeout < 600 and grace == 5 * timeout
    assert stall_timeouts(plan_from_dict({**raw, "stall_timeout": 12}), split) == (12.0, 300.0)
    assert stall_timeouts(plan_from_dict({**raw, "stall_timeout": 0}), split) == (0.0, 0.0)
    with pytest.raises(PlanError, match="stall_timeout"):
        plan_from_dict({**raw, "stall_timeout": -1})
    ident, base = Identity(0, 2, "x", None), {"HYBRID_INSTANCE": "demo"}
    env = vllm_env(plan, resolve_stage(plan, split, ident, base), ident, None, base)
    assert env["HYBRID_PROGRESS_FILE"] == "/dev/shm/.hybrid-demo-r2-s0.progress"
    assert env["HYBRID_STALL_TIMEOUT"] == f"{timeout:g},{grace:g}"


def test_launcher_stops_a_stalled_stage(tmp_path):
    """The supervisor loop ends a vLLM whose record shows pending work and no progress."""
    path = str(tmp_path / "p")
    child = ("import time; from types import SimpleNamespace as S; from vllm_hybrid.progress import ProgressWriter\n"
             f"w = ProgressWriter({path!r}); w.step_started(S(scheduled_new_reqs=[S(req_id='a')], "
             "total_num_scheduled_tokens=1)); w.step_finished()\n"
             "w.step_started(S(total_num_scheduled_tokens=1)); w.step_finished(); time.sleep(600)")
    t0 = time.monotonic()
    code = run_supervised([sys.executable, "-c", child], None, None, stall=StallWatch(path, 2, 100))
    assert code == EXIT_STALLED and 2 < time.monotonic() - t0 < 15


def test_vllm_starts_only_once_the_sidecar_is_ready(tmp_path):
    """The GEMM helper takes its GPU memory before it listens; vLLM must not start (and profile the GPU)
    before that, and not at all if the helper dies first."""
    ready, started = tmp_path / "helper.sock", tmp_path / "vllm-started"
    helper = [sys.executable, "-c", f"import time, pathlib; time.sleep(1); pathlib.Path({str(ready)!r}).touch(); time.sleep(600)"]
    child = f"import os, pathlib, sys; pathlib.Path({str(started)!r}).write_text(str(os.path.exists({str(ready)!r}))); sys.exit(3)"
    assert run_supervised([sys.executable, "-c", child], None, None, sidecar=helper, sidecar_ready=str(ready)) == 3
    assert started.read_text() == "True"
    started.unlink()
    dying = [sys.executable, "-c", "import sys; sys.exit(1)"]
    code = run_supervised([sys.executable, "-c", child], None, None, sidecar=dying, sidecar_ready=str(tmp_path / "never"))
    assert code == EXIT_SIDECAR_LOST and not started.exists()


def test_stall_gauges_read_the_record(tmp_path, monkeypatch):
    from vllm_hybrid import stage_metrics
    w = ProgressWriter(str(tmp_path / "p"))
    monkeypatch.setattr(progress, "_WRITER", w)
    labels = stage_metrics.stage_labels({})
    m = stage_metrics.StageMetrics(labels)
    stage_metrics.watch_progress(m, {"HYBRID_STALL_TIMEOUT": "12,300"})

    def value(name):
        return m.registry.get_sample_value(name, labels)

    assert value("hybrid_stage_seconds_since_progress") == 0 and value("hybrid_stage_pending_requests") == 0
    w.step_started(step(new=["a", "b"], tokens=2))  # first step of its size: the grace applies
    assert value("hybrid_stage_stall_timeout_seconds") == 300
    w.step_finished()
    w.step_started(step(cached=["a", "b"], tokens=2))
    w.step_finished()
    w.last_progress -= 5
    assert value("hybrid_stage_pending_requests") == 2 and value("hybrid_stage_stall_timeout_seconds") == 12
    assert 5 <= value("hybrid_stage_seconds_since_progress") < 6
