"""plan.yaml follows docs/plan-format.md exactly (snake_case keys, values from the spec)."""
from __future__ import annotations

import re

import pytest
import yaml
from hi_fixtures import ROOT, make_body, stages
from hybrid_operator.defaults import with_defaults
from hybrid_operator.plan import WORKLOAD_KEYS, layer_ranges, render_plan, stages_summary
from hybrid_operator.strategy import offloaded_stages, running_layers, running_stages, streamed_stages


def documented_keys():
    """Top-level and stage keys from the YAML example in docs/plan-format.md."""
    doc = (ROOT / "docs" / "plan-format.md").read_text()
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", doc, re.DOTALL).group(1))
    stage_keys = set().union(*(s.keys() for s in example["stages"]))
    return set(example), stage_keys


WORKLOAD = {"concurrency": 8, "promptTokens": 1024, "outputTokens": 128}
PLAN_FILE_ONLY = {"hardware", "offload_backend"}  # written by hand in a plan file; the CRD does not carry them
ONLY_WHEN_GIVEN = set(WORKLOAD_KEYS.values()) | {"stall_timeout"}  # else the runtime's defaults


def test_plan_uses_only_documented_keys():
    top, stage_keys = documented_keys()
    plan = render_plan(make_body(stages=stages(3, layers=True), workload=WORKLOAD,
                                 serving={"stallTimeoutSeconds": 120})["spec"])
    assert set(plan) == top - PLAN_FILE_ONLY
    assert set(render_plan(make_body()["spec"])) == top - PLAN_FILE_ONLY - ONLY_WHEN_GIVEN
    for stage in plan["stages"]:
        assert set(stage) <= stage_keys


def test_plan_values():
    spec = make_body(
        model={"path": "llama-3.1-8b", "volume": {"claimName": "m"}, "servedModelName": "llama",
               "dtype": "float16", "maxModelLen": 8192},
        serving={"port": 8080, "maxNumSeqs": 32, "maxNumBatchedTokens": 16384, "blockSize": 64,
                 "extraArgs": ["--enforce-eager"]},
        monitoring={"port": 9200}, strategy="balanced", stages=stages(2, layers=True))["spec"]
    plan = render_plan(spec)
    assert plan == {
        "model": "/models/llama-3.1-8b", "revision": None, "served_model_name": "llama", "dtype": "float16",
        "max_model_len": 8192, "block_size": 64, "max_num_seqs": 32, "max_num_batched_tokens": 16384,
        "api_port": 8080, "master_port": 29500, "supervisor_port": 29501, "metrics_port": 9200, "load_format": "auto",
        "strategy": "balanced", "extra_args": ["--enforce-eager"],
        "stages": [
            {"name": "gpu", "device": "gpu", "tensor_parallel": 1, "layers": 8, "gpu_memory_utilization": 0.9},
            {"name": "cpu", "device": "cpu", "tensor_parallel": 1, "layers": 8, "cpus": 16, "memory": "64Gi"},
        ],
    }


def test_defaults_and_served_name_from_path():
    plan = render_plan(make_body()["spec"])
    assert plan["served_model_name"] == "llama-3.1-8b"
    assert plan["max_num_batched_tokens"] == 4096 and plan["block_size"] == 128
    assert plan["strategy"] == "pipeline"
    assert "layers" not in plan["stages"][0]


def test_workload_goes_to_expected_keys_only_when_given():
    plan = render_plan(make_body(strategy="auto", workload=WORKLOAD)["spec"])
    assert (plan["strategy"], plan["expected_concurrency"], plan["expected_prompt_tokens"],
            plan["expected_output_tokens"]) == ("auto", 8, 1024, 128)
    partial = render_plan(make_body(workload={"outputTokens": 64})["spec"])
    assert partial["expected_output_tokens"] == 64
    assert "expected_concurrency" not in partial and "expected_prompt_tokens" not in partial


def test_hardware_goes_to_the_plan_only_when_given():
    plan = render_plan(make_body(strategy="auto", hardware={"dramGBs": 94.1, "cpuTokenSpeed": 0.45})["spec"])
    assert plan["hardware"] == {"dram_gbs": 94.1, "cpu_token_speed": 0.45}
    assert render_plan(make_body(hardware={"cpuTokenSpeed": 0.5})["spec"])["hardware"] == {"cpu_token_speed": 0.5}
    assert "hardware" not in render_plan(make_body(hardware={})["spec"]) and "hardware" not in render_plan(make_body()["spec"])


def test_stall_timeout_goes_to_the_plan_only_when_given():
    assert render_plan(make_body(serving={"stallTimeoutSeconds": 0})["spec"])["stall_timeout"] == 0  # off
    assert "stall_timeout" not in render_plan(make_body()["spec"])


def test_offload_plan_still_lists_every_stage():
    """The runtime needs the cpu stages to plan the split, even though they get no pods."""
    plan = render_plan(make_body(strategy="offload", stages=stages(3, layers=True))["spec"])
    assert [s["name"] for s in plan["stages"]] == ["gpu", "cpu", "cpu2"]
    assert plan["stages"][1] == {"name": "cpu", "device": "cpu", "tensor_parallel": 1, "layers": 8, "cpus": 16,
                                 "memory": "64Gi"}


def test_layer_ranges():
    assert layer_ranges(make_body(stages=stages(3, layers=True))["spec"]) == ["0-7", "8-15", "16-23"]
    assert layer_ranges(make_body()["spec"]) == ["auto", "auto"]
    assert stages_summary(make_body(stages=stages(2, layers=True))["spec"]) == "gpu:8 cpu:8"
    assert stages_summary(make_body()["spec"]) == "gpu:auto cpu:auto"
    # offload: only the gpu stages run, each computing its own and the streamed cpu layers
    offload = make_body(strategy="offload", stages=stages(3, layers=True))["spec"]
    assert layer_ranges(offload) == ["0-23"] and stages_summary(offload) == "gpu:24"
    assert stages_summary(make_body(strategy="offload")["spec"]) == "gpu:auto"
    st = stages(4, layers=True)
    st[2] = dict(st[0], name="gpu2", layers=4)  # gpu cpu gpu2 cpu3: each cpu stage goes to the gpu before it
    assert stages_summary(make_body(strategy="offload", stages=st)["spec"]) == "gpu:16 gpu2:12"
    assert layer_ranges(make_body(strategy="offload", stages=st)["spec"]) == ["0-15", "16-27"]
    for strategy in ("balanced", "coprocessor", "auto"):  # every stage runs
        assert layer_ranges(make_body(strategy=strategy, stages=stages(3, layers=True))["spec"]) == \
            ["0-7", "8-15", "16-23"]


def test_balanced_stages_compute_their_own_layers():
    """balanced moves GEMM rows to the helper, not layers: every stage keeps its own, unlike offload."""
    st = stages(4, layers=True)
    st[2] = dict(st[0], name="gpu2", layers=4)
    st[3]["layers"] = 12
    balanced = make_body(strategy="balanced", stages=st)["spec"]
    assert running_layers(with_defaults(balanced)) == [8, 8, 4, 12]
    assert stages_summary(balanced) == "gpu:8 cpu:8 gpu2:4 cpu3:12"
    assert layer_ranges(balanced) == ["0-7", "8-15", "16-19", "20-31"]
    offload = make_body(strategy="offload", stages=st)["spec"]  # the same stages, layers moved to the gpus
    assert running_layers(with_defaults(offload)) == [16, 16]
    assert stages_summary(offload) == "gpu:16 gpu2:16"


def test_streamed_stages_cover_offload_balanced_and_coprocessor_offloaded_stages_only_offload():
    st = stages(4)
    st[2] = dict(st[0], name="gpu2")
    for strategy in ("offload", "balanced", "coprocessor"):
        spec = with_defaults(make_body(strategy=strategy, stages=st)["spec"])
        assert [streamed_stages(spec, i) for i in range(4)] == [[1], [], [3], []]
        assert [offloaded_stages(spec, i) for i in range(4)] == \
            ([[1], [], [3], []] if strategy == "offload" else [[], [], [], []])
    for strategy in ("pipeline", "auto"):
        spec = with_defaults(make_body(strategy=strategy, stages=st)["spec"])
        assert [streamed_stages(spec, i) for i in range(4)] == [[], [], [], []]
    spec = with_defaults(make_body(strategy="balanced", stages=[st[1], st[0], st[3]])["spec"])  # cpu gpu cpu3
    assert [streamed_stages(spec, i) for i in range(3)] == [[], [0, 2], []]  # no gpu before cpu: the first


def test_coprocessor_runs_every_stage_each_holding_its_own_layers():
    """coprocessor: the gpu stage computes every layer, but the cpu stages keep (and help compute) theirs."""
    st = stages(3, layers=True)
    st[2]["layers"] = 12
    spec = with_defaults(make_body(strategy="coprocessor", stages=st)["spec"])
    assert running_stages(spec) == [0, 1, 2]
    assert [streamed_stages(spec, i) for i in range(3)] == [[1, 2], [], []]
    assert [offloaded_stages(spec, i) for i in range(3)] == [[], [], []]
    assert running_layers(spec) == [8, 8, 12]
    assert stages_summary(spec) == "gpu:8 cpu:8 cpu2:12" and layer_ranges(spec) == ["0-7", "8-15", "16-27"]
    assert render_plan(spec)["strategy"] == "coprocessor"


def test_experts_runs_both_stages_and_keeps_the_experts_in_the_cpu_pod():
    """experts: the gpu stage computes every layer; the cpu stage's pod holds (and computes) the experts the gpu
    leaves out, which larger steps stream from there: no layers or weights move into the gpu pod."""
    st = stages(2, layers=True)
    st[0]["layers"], st[1]["layers"] = 25, 7
    spec = with_defaults(make_body(strategy="experts", stages=st)["spec"])
    assert running_stages(spec) == [0, 1]
    assert [streamed_stages(spec, i) for i in range(2)] == [[1], []]
    assert [offloaded_stages(spec, i) for i in range(2)] == [[], []]
    assert running_layers(spec) == [25, 7]
    assert stages_summary(spec) == "gpu:25 cpu:7" and layer_ranges(spec) == ["0-24", "25-31"]
    plan = render_plan(spec)
    assert plan["strategy"] == "experts" and [s["name"] for s in plan["stages"]] == ["gpu", "cpu"]
    assert stages_summary(make_body(strategy="experts")["spec"]) == "gpu:auto cpu:auto"


def test_gpu_memory_goes_to_plan_memory_of_gpu_stage():
    st = stages(2)
    st[0]["gpuMemory"] = "80Gi"
    plan = render_plan(make_body(stages=st)["spec"])
    assert plan["stages"][0]["memory"] == "80Gi"


@pytest.mark.parametrize("n_stages,tp,layers,strategy", [(1, 1, False, "pipeline"), (2, 1, True, "offload"),
                                                      (3, 2, False, "auto"), (3, 2, True, "balanced"),
                                                      (2, 1, True, "coprocessor"), (2, 1, False, "experts")])
def test_runtime_loader_accepts_rendered_plans(n_stages, tp, layers, strategy):
    """Contract test: the runtime's own validator reads what the operator renders."""
    from vllm_hybrid.plan import plan_from_dict

    st = stages(n_stages, tp, layers)
    st[0]["gpuMemory"] = "80Gi"
    spec = make_body(stages=st, serving={"apiKeySecretRef": {"name": "k"}, "extraArgs": ["--enforce-eager"]},
                     strategy=strategy, workload=WORKLOAD, hardware={"dramGBs": 94.1, "cpuTokenSpeed": 0.45})["spec"]
    plan = plan_from_dict(yaml.safe_load(yaml.safe_dump(render_plan(spec))))
    assert (plan.strategy, plan.expected_concurrency, plan.expected_prompt_tokens,
            plan.expected_output_tokens) == (strategy, 8, 1024, 128)
    assert dict(plan.hardware) == {"dram_gbs": 94.1, "cpu_token_speed": 0.45}
    assert [s.name for s in plan.stages] == [s["name"] for s in st]
    assert plan.stages[0].memory_bytes == 80 * 2**30
    assert plan.supervision_port == 29501 and plan.api_port == 8000
    if n_stages > 1:
        assert plan.stages[1].cpus == 16 and plan.stages[1].memory_bytes == 64 * 2**30
