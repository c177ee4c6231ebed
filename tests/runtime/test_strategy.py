import pytest
from vllm_hybrid.launcher import Identity, vllm_command, vllm_env
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import model_shape, split_layers
from vllm_hybrid.strategy import Hardware, layout, resolve
from vllm_hybrid.tinymodel import LLAMA_3_1_8B

SHAPE = model_shape(LLAMA_3_1_8B, "bfloat16")
GPU = {"name": "gpu", "device": "gpu", "layers": 16}
CPU = {"name": "cpu", "device": "cpu", "layers": 16, "cpus": 15, "memory": "32Gi"}


def planned(stages, **over):
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "stages": stages, **over})
    return plan, split_layers(plan, SHAPE)


@pytest.mark.parametrize("stages,runs", [([GPU, CPU], (0,)), ([CPU, GPU], (1,))])
def test_offload_runs_the_gpu_stage_with_every_layer_streaming_the_cpu_ones(stages, runs):
    plan, split = planned(stages, strategy="offload")
    lay, _ = resolve(plan, split)
    assert (lay.stages, lay.layers, lay.offload_bytes) == (runs, (32,), (16 * SHAPE.layer_bytes,))
    argv = vllm_command(plan, split, Identity(runs[0], 0, "10.0.0.1", None), python="py", lay=lay)
    assert argv[argv.index("--cpu-offload-gb") + 1] == "6.50"  # the 6.5 GiB for layers 16-31
    assert "--nnodes" not in argv and "--headless" not in argv and "--port" in argv
    env = vllm_env(plan, split, Identity(runs[0], 0, "10.0.0.1", None), None, {}, lay=lay)
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the V2 runner ignores --cpu-offload-gb
    assert env["VLLM_PP_LAYER_PARTITION"] == "32" and env["HYBRID_PIPELINE_STAGES"] == "1"


def test_balanced_moves_contiguous_layers_next_to_the_gpu_stage():
    for stages, gpu_first in (([GPU, CPU], True), ([CPU, GPU], False)):
        plan, split = planned(stages, strategy="balanced")
        lay, _ = resolve(plan, split)
        moved = lay.offload_bytes[0 if gpu_first else 1] // SHAPE.layer_bytes
        assert 1 <= moved <= 15 and sum(lay.layers) == 32
        assert lay.layers == ((16 + moved, 16 - moved) if gpu_first else (16 - moved, 16 + moved))
        assert lay.ranges()[1 if gpu_first else 0] == (f"{16 + moved}-31" if gpu_first else f"0-{15 - moved}")
    # equal link times: k / PCIe == (16 - k) / (DRAM x efficiency)
    hw = Hardware(pcie_gbs=50, dram_gbs=100, cpu_decode_efficiency=0.5)
    assert layout(planned([GPU, CPU])[0], planned([GPU, CPU])[1], "balanced", hw).layers == (24, 8)


def test_auto_follows_the_workload():
    picks = {c: resolve(*planned([CPU, GPU], strategy="auto", expected_concurrency=c, expected_prompt_tokens=128,
                                 expected_output_tokens=128))[0].strategy for c in (1, 4, 64)}
    assert picks[1] == "pipeline" and picks[64] == "offload"
    _, est = resolve(*planned([CPU, GPU], strategy="auto", expected_concurrency=1))
    assert set(est) == {"pipeline", "offload", "balanced"}


def test_strategies_that_need_a_gpu_stage():
    cpu2 = {**CPU, "name": "cpu2"}
    for strategy in ("offload", "balanced"):
        with pytest.raises(PlanError, match=f"strategy: {strategy} needs a gpu stage"):
            resolve(*planned([CPU, cpu2], strategy=strategy))
    assert resolve(*planned([CPU, cpu2], strategy="auto"))[0].strategy == "pipeline"


def test_workload_must_fit_the_model_length():
    with pytest.raises(PlanError, match="expected_prompt_tokens \\+ expected_output_tokens"):
        planned([GPU, CPU], expected_prompt_tokens=8000, expected_output_tokens=500)


def test_hardware_figures_from_the_plan_steer_the_choice():
    slow_pcie = {"pcie_gbs": 5.0, "offload_token_s": 0.001}
    plan, split = planned([CPU, GPU], strategy="auto", expected_concurrency=64, hardware=slow_pcie)
    assert dict(plan.hardware) == slow_pcie
    assert resolve(plan, split)[0].strategy == "pipeline"  # streaming at 5 GB/s loses even at 64
    with pytest.raises(PlanError, match="hardware.pcie: unknown field"):
        planned([CPU, GPU], hardware={"pcie": 50})
    with pytest.raises(PlanError, match="hardware.dram_gbs: expected a positive number"):
        planned([CPU, GPU], hardware={"dram_gbs": "fast"})


def test_a_deployment_that_routes_clients_to_stage_0_keeps_it_serving():
    plan, split = planned([CPU, GPU], strategy="auto", expected_concurrency=64, expected_prompt_tokens=128,
                          expected_output_tokens=128)
    assert resolve(plan, split)[0].strategy == "offload"  # local runs: the GPU stage may serve the API
    lay, _ = resolve(plan, split, api_stage=0)  # Kubernetes: stage 0's pods get the requests
    assert lay.stages[0] == 0 and lay.strategy in ("pipeline", "balanced")
    with pytest.raises(PlanError, match="would serve the API from another stage than stage 0"):
        resolve(*planned([CPU, GPU], strategy="offload"), api_stage=0)
    assert resolve(*planned([GPU, CPU], strategy="offload"), api_stage=0)[0].stages == (0,)
