"""spec.serving.extraArgs cannot replace what the launcher pins or the planner sized against: they are read with
vLLM 0.26's own parser (abbreviations, --flag=value, underscores, short forms, --config files) at the stage's start,
and the refusal names the flag and the spec field to use instead, in the stage's termination message."""
import json
import os
import sys

import pytest
from test_launcher import PLAN, build
from vllm_hybrid.extra_args import refuse_in_serve_argv
from vllm_hybrid.plan import PlanError

# (vLLM's flag, the spec field that sets it, a value, an abbreviation or short form vLLM 0.26 resolves to it)
PINNED = [
    ("--served-model-name", "spec.model.servedModelName", "other", "--served-m"),
    ("--revision", "spec.model.revision", "main", "--revi"),
    ("--dtype", "spec.model.dtype", "float16", "--dty"),
    ("--load-format", "spec.model.loadFormat", "dummy", "--load-f"),
    ("--max-model-len", "spec.model.maxModelLen", "100", "--max-mod"),
    ("--quantization", "quantization_config", "fp8", "-q"),
    ("--block-size", "spec.serving.blockSize", "32", "--block-s"),
    ("--max-num-seqs", "spec.serving.maxNumSeqs", "3", "--max-num-se"),
    ("--max-num-batched-tokens", "spec.serving.maxNumBatchedTokens", "99", "--max-num-b"),
    ("--host", "spec.serving.port", "127.0.0.1", "--hos"),
    ("--port", "spec.serving.port", "9000", "--por"),
    ("--api-key", "spec.serving.apiKeySecretRef", "secret", "--api-k"),
    ("--tensor-parallel-size", "spec.stages[].tensorParallel", "2", "-tp"),
    ("--gpu-memory-utilization", "spec.stages[].gpuMemoryUtilization", "0.5", "--gpu-m"),
    ("--kv-cache-memory-bytes", "spec.stages[].gpuMemoryUtilization", "1000000", "--kv-cache-mem"),
    ("--pipeline-parallel-size", "spec.stages", "3", "-pp"),
    ("--data-parallel-size", "spec.stages", "2", "-dp"),
    ("--nnodes", "spec.stages", "3", "--nn"),
    ("--node-rank", "spec.stages", "1", "--node-r"),
    ("--master-addr", "spec.stages", "10.0.0.1", "--master-a"),
    ("--master-port", "spec.stages", "1234", "--master-p"),
    ("--distributed-executor-backend", "spec.stages", "ray", "--distributed-e"),
    ("--cpu-offload-gb", "spec.strategy offload", "4", "--cpu-offload-g"),
]


def serve_args(extra, stage=0):
    """The `vllm serve` arguments the launcher builds for a stage of test_launcher's plan, with these extra ones."""
    import test_launcher
    saved = dict(test_launcher.PLAN)
    test_launcher.PLAN["extra_args"] = list(extra)
    try:
        argv, env, _ = build(stage)
    finally:
        test_launcher.PLAN.clear()
        test_launcher.PLAN.update(saved)
    assert json.loads(env.get("HYBRID_EXTRA_ARGS", "[]")) == list(extra)  # what the stage's vllm_entry reads
    return argv[argv.index("vllm_hybrid.vllm_entry") + 2:]


def refused(extra, stage=0) -> str:
    with pytest.raises(PlanError) as e:
        refuse_in_serve_argv(serve_args(extra, stage), extra)
    return str(e.value)


@pytest.mark.parametrize("flag,field,value,short", PINNED, ids=[p[0] for p in PINNED])
def test_each_pinned_flag_is_refused_in_every_form(flag, field, value, short):
    for extra in ([flag, value], [f"{flag}={value}"], [short, value], [f"{short}={value}"],
                  [flag.replace("-", "_").replace("__", "--", 1), value], ["--enforce-eager", flag, value]):
        message = refused(extra)
        assert f"sets {flag}," in message and field in message, (extra, message)
        assert repr(next(a for a in extra if a.startswith("-") and a != "--enforce-eager")) in message


def test_the_model_and_the_pipeline_wiring_are_refused_on_every_stage():
    assert "spec.model (plan: model)" in refused(["--model", "/other"])
    assert "spec.model (plan: model)" in refused(["--model=/other"], stage=1)
    assert "spec.stages" in refused(["--headl"], stage=0)  # the head stage serves the API: never headless
    # a pipeline runs without async scheduling; the launcher pins it, so turning it back on is refused
    assert "sets --async-scheduling," in refused(["--async-sch"], stage=1)
    assert "spec.serving.port" in refused(["--por", "9000"], stage=1)  # headless stages have no --port of their own


def test_a_config_file_cannot_set_them_either(tmp_path):
    config = tmp_path / "vllm.yaml"
    config.write_text("max-num-seqs: 3\nenforce-eager: true\n")
    message = refused(["--config", str(config)])
    assert "sets --max-num-seqs," in message and "spec.serving.maxNumSeqs" in message


@pytest.mark.parametrize("extra", [[], ["--enforce-eager"], ["--seed", "7"], ["--kv-cache-dtype", "fp8"],
                                   ["--middleware", "my.Middleware"], ["--max-num-scheduled-tokens=8"],
                                   ["--enable-prefix-caching", "--max-logprobs", "5"]])
def test_what_the_launcher_leaves_open_passes(extra):
    refuse_in_serve_argv(serve_args(extra), extra)  # --middleware appends to the guard, it does not replace it


@pytest.mark.parametrize("extra,why", [(["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                                       (["--max-num-s", "3"], "ambiguous option: --max-num-s could match")])
def test_what_vllm_would_refuse_is_refused_as_clearly(extra, why):
    assert why in refused(extra)


def test_the_refusal_is_the_stages_termination_message(tmp_path, monkeypatch):
    """The real stage entry point (vllm_entry, as the launcher runs it) refuses at its start, before vLLM loads;
    the launcher's supervisor puts the line where the kubelet and the operator's status read it."""
    from vllm_hybrid import supervise
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setattr(supervise, "TERMINATION_LOG", str(log))
    argv, env, _ = build(0)
    extra = ["--max-mod", "100"]
    argv = [sys.executable, *argv[1:-len(PLAN["extra_args"])], *extra]
    env = {**os.environ, **env, "HYBRID_EXTRA_ARGS": json.dumps(extra)}
    assert supervise.run_supervised(argv, env, None) == 2
    assert log.read_text() == ("vLLM exited with code 2: vllm-hybrid: error: spec.serving.extraArgs: '--max-mod' sets "
                               "--max-model-len, which the launcher pins: set spec.model.maxModelLen (plan: "
                               "max_model_len) instead\n")
