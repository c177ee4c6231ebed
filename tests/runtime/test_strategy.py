import json
from pathlib import Path

import pytest
from vllm_hybrid.cpubind import CpuBinding
from vllm_hybrid.launcher import Identity, helper_command, resolve_stage, vllm_command, vllm_env
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import GiB, model_shape, split_layers
from vllm_hybrid.strategies import Hardware, resolve
from vllm_hybrid.strategies.balanced import HELPER_CONTEXT, Rates, split_rates
from vllm_hybrid.strategies.offload import prefetch_groups
from vllm_hybrid.tinymodel import LLAMA_3_1_8B

SHAPE = model_shape(LLAMA_3_1_8B, "bfloat16")
GPU = {"name": "gpu", "device": "gpu", "layers": 16}
CPU = {"name": "cpu", "device": "cpu", "layers": 16, "cpus": 15, "memory": "32Gi"}


def bench_run(name: str) -> dict:
    """A committed benchmark result the cost model is checked against."""
    return json.loads((Path(__file__).parents[2] / "bench/results" / name).read_text())


def planned(stages, **over):
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "stages": stages, **over})
    return plan, split_layers(plan, SHAPE)


@pytest.mark.parametrize("stages,runs", [([GPU, CPU], (0,)), ([CPU, GPU], (1,))])
def test_offload_runs_the_gpu_stage_with_every_layer_streaming_the_cpu_ones(stages, runs):
    plan, split = planned(stages, strategy="offload")
    lay, _ = resolve(plan, split)
    assert (lay.stages, lay.layers, lay.offload_bytes) == (runs, (32,), (16 * SHAPE.layer_bytes,))
    ident = Identity(runs[0], 0, "10.0.0.1", None)
    rec = resolve_stage(plan, split, ident, {}, lay)
    argv = vllm_command(plan, rec, ident, python="py")
    # vLLM's prefetch offloader, one of every 2 layers: the CPU stage's 16 of 32
    assert argv[argv.index("--offload-group-size") + 1:argv.index("--offload-group-size") + 6] == [
        "2", "--offload-num-in-group", "1", "--offload-prefetch-step", "1"]
    assert "--cpu-offload-gb" not in argv
    assert "--nnodes" not in argv and "--headless" not in argv and "--port" in argv
    env = vllm_env(plan, rec, ident, None, {})
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the V2 runner ignores vLLM's offload flags
    assert env["HYBRID_EXPECT_OFFLOADER"] == "PrefetchOffloader"  # else the stage fails at start
    assert env["VLLM_PP_LAYER_PARTITION"] == "32" and env["HYBRID_PIPELINE_STAGES"] == "1"


def test_offload_backend_uva_streams_the_same_bytes_with_cpu_offload_gb():
    plan, split = planned([GPU, CPU], strategy="offload", offload_backend="uva")
    lay, _ = resolve(plan, split)
    ident = Identity(0, 0, "10.0.0.1", None)
    rec = resolve_stage(plan, split, ident, {}, lay)
    argv = vllm_command(plan, rec, ident, python="py")
    assert argv[argv.index("--cpu-offload-gb") + 1] == "6.50024"  # layers 16-31: 16 x 0.406 GiB
    assert "--offload-group-size" not in argv
    assert vllm_env(plan, rec, ident, None, {})["HYBRID_EXPECT_OFFLOADER"] == "UVAOffloader"
    with pytest.raises(PlanError, match="offload_backend: expected one of"):
        planned([GPU, CPU], offload_backend="gds")


@pytest.mark.parametrize("layers", [8, 32, 80, 126])
def test_prefetch_groups_stream_exactly_the_cpu_stages_layer_count(layers):
    for streamed in range(1, layers):
        group, in_group = prefetch_groups(layers, streamed)
        # vllm.model_executor.offloader.prefetch: the last num_in_group layers of every group_size
        assert sum(1 for i in range(layers) if i % group >= group - in_group) == streamed
        assert 1 <= in_group <= group


@pytest.mark.parametrize("stages,cpu", [([GPU, CPU], 1), ([CPU, GPU], 0)])
def test_balanced_splits_the_cpu_stages_gemms_with_the_gpu_stages_helper(stages, cpu):
    plan, _ = planned(stages, strategy="balanced")
    split = split_layers(plan, SHAPE, strategy="balanced")  # as resolve_split re-splits for balanced
    lay, _ = resolve(plan, split)
    gpu = 1 - cpu
    # every stage runs its own layers; nothing moves to the GPU stage's --cpu-offload-gb
    assert (lay.stages, lay.layers, lay.offload_bytes) == ((0, 1), (16, 16), (0, 0))
    assert lay.helper_of(cpu) == gpu and lay.helper_of(gpu) is None and lay.helped_by(gpu) == [cpu]
    base = {"HYBRID_INSTANCE": "llama", "HYBRID_SHM_DIR": "/dev/shm"}
    ids = {i: Identity(i, 2, "10.0.0.1", None) for i in (cpu, gpu)}
    recs = {i: resolve_stage(plan, split, ids[i], base, lay) for i in (cpu, gpu)}
    cpu_env = vllm_env(plan, recs[cpu], ids[cpu], CpuBinding("1-2", 2, None, [1, 2]), base)
    assert cpu_env["HYBRID_GEMM_SOCKET"] == f"/dev/shm/hybrid-llama-r2-s{gpu}.gemm"
    assert Rates.decode(cpu_env["HYBRID_SPLIT_RATES"]) == split_rates(Hardware(), 15)
    helper = helper_command(recs[gpu], python="py")
    # the helper takes the planner's GPU memory (less the CUDA context it makes anyway) before vLLM starts
    reserve = split.stages[gpu].beside_vllm_bytes - HELPER_CONTEXT
    assert reserve > 9 * 14336 * 4096 * 2  # its ring: 9 slots of the 8B shape's biggest split weight
    assert helper == ["py", "-m", "vllm_hybrid.gemm_helper", "--socket", cpu_env["HYBRID_GEMM_SOCKET"],
                      "--device", "cuda", "--reserve-bytes", str(reserve)]
    assert helper_command(recs[cpu]) is None
    gpu_argv = vllm_command(plan, recs[gpu], ids[gpu], python="py")
    assert "--cpu-offload-gb" not in gpu_argv
    pipe = resolve(*planned(stages, strategy="pipeline"))[0]
    assert "HYBRID_GEMM_SOCKET" not in vllm_env(plan, resolve_stage(plan, split, ids[cpu], base, pipe), ids[cpu],
                                                CpuBinding("1", 1, None, [1]), base)
    assert helper_command(resolve_stage(plan, split, ids[gpu], base, pipe)) is None


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
        planned([CPU, GPU], hardware={"pcie": 50})
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


def test_the_balanced_cost_model_matches_the_bench():
    # bench/results/gpu_bench-onecopy.json: one H200 lease, CPU stage first (14 CPUs), one copy of its
    # weights on 2 MiB pages, DRAM measured there
    run = bench_run("gpu_bench-onecopy.json")
    hw = Hardware(dram_gbs=run["dram_read_gbs"])
    cpu = {**CPU, "cpus": 14}
    for w, prefetch in zip(run["d-balanced-huge"]["waves"], run["b-prefetch-plain"]["waves"]):
        plan, split = planned([cpu, GPU], strategy="auto", expected_concurrency=w["concurrency"],
                              expected_prompt_tokens=128, expected_output_tokens=128)
        lay, est = resolve(plan, split, hw)
        assert w["tok_per_s"] > prefetch["tok_per_s"]  # the best measured at every concurrency of that run
        assert lay.strategy == "balanced"
        assert est["balanced"] == pytest.approx(w["tok_per_s"], rel=0.1)


def test_the_coprocessor_cost_model_matches_the_bench():
    # bench/results/gpu_bench-coproc.json: one H200 lease, coprocessor (13 server threads, 4 KiB and 2 MiB
    # pages) beside vLLM's prefetch offloader; the two coprocessor runs differ by up to 10% (171 / 188 at 16)
    run = bench_run("gpu_bench-coproc.json")
    pairs = [(w, p) for k in ("e-coproc", "e-coproc-huge") for w, p in zip(run[k]["waves"], run["b-prefetch-plain"]["waves"])]
    for w, prefetch in pairs:
        plan, split = planned([GPU, {**CPU, "cpus": 14}], strategy="coprocessor", expected_concurrency=w["concurrency"],
                              expected_prompt_tokens=128, expected_output_tokens=128)
        _, est = resolve(plan, split, Hardware(dram_gbs=run["dram_read_gbs"]))
        assert w["tok_per_s"] > 1.1 * prefetch["tok_per_s"]
        assert est["coprocessor"] == pytest.approx(w["tok_per_s"], rel=0.15)
        assert est["coprocessor"] > est["offload"]


def test_the_prefetch_offload_cost_model_matches_the_bench():
    # bench/results/gpu_bench-prefetch.json: `strategy: offload` on vLLM's prefetch offloader, one H200 lease
    run = bench_run("gpu_bench-prefetch.json")
    assert run["b-offload"]["offload_verified"]  # the engine said PrefetchOffloader
    for w in run["b-offload"]["waves"]:
        plan, split = planned([GPU, CPU], strategy="offload", expected_concurrency=w["concurrency"],
                              expected_prompt_tokens=128, expected_output_tokens=128)
        _, est = resolve(plan, split, Hardware(dram_gbs=run["dram_read_gbs"]))
        assert est["offload"] == pytest.approx(w["tok_per_s"], rel=0.1)


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
        plan, _ = planned([GPU, {**CPU, "memory": "100Gi"}], strategy=name)  # plan.py takes every registered name
        assert strategy.refused(plan, True) is None
        split = split_layers(plan, shape, strategy=name)
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
        planned([GPU, CPU], strategy="sharded")


def test_a_lone_gpu_stage_is_planned_as_plain_vllm():
    from vllm_hybrid.strategies import resolve_split
    plan = plan_from_dict({"model": "m", "strategy": "auto", "stages": [{"name": "gpu", "device": "gpu"}]})
    split, lay, estimates = resolve_split(plan, SHAPE, 80 * GiB)  # its step is the GPU's own: not a zero to divide by
    assert (lay.strategy, lay.layers, split.stages[0].layers) == ("pipeline", (32,), 32)
    assert list(estimates) == ["pipeline"] and estimates["pipeline"] > 0


MIXTRAL_GPU = {"name": "gpu", "device": "gpu", "memory": "80Gi"}
MIXTRAL_CPU = {"name": "cpu", "device": "cpu", "cpus": 15, "memory": "100Gi"}


def mixtral_plan(stages=(MIXTRAL_GPU, MIXTRAL_CPU), **over):
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "strategy": "experts",
                           "stages": list(stages), **over})
    return plan, model_shape(MIXTRAL_8X7B, "bfloat16")


@pytest.mark.parametrize("concurrency", [1, 16])
def test_experts_runs_every_layer_on_the_gpu_and_as_many_experts_as_its_budget_holds(concurrency):
    from vllm_hybrid import experts
    from vllm_hybrid.planner import stage_budget
    from vllm_hybrid.strategies import get, resolve_split
    from vllm_hybrid.strategies.experts import expert_bytes
    plan, shape = mixtral_plan(expected_concurrency=concurrency)
    split, lay, est = resolve_split(plan, shape)
    one = expert_bytes(shape)
    remote = lay.offload_bytes[0] // one
    assert (lay.strategy, lay.stages, lay.layers, lay.servers) == ("experts", (0,), (32,), ((1, 0),))
    assert lay.offload_bytes[0] == remote * one and est["experts"] > 0
    # the gpu: every layer's attention, norms and router, both ends, KV for the workload (at least one
    # 8192-token sequence), room to copy a layer's remote experts in and unpack them while the next one's comes in
    # (large steps), and as many experts as fit; the rest on the cpu stage
    kv = 32 * max(8192, concurrency * (512 + 256)) * shape.kv_bytes_per_token_per_layer
    staging = (3 * -(-remote // 32) + 1) * one  # three times a layer's remote experts, rounded up, and one more
    room = stage_budget(plan.stages[0], None) - 32 * (shape.layer_bytes - shape.layer_expert_bytes) \
        - 2 * shape.embedding_bytes - kv - staging
    assert (32 * 8 - remote) * one <= room < (32 * 8 - remote + 2) * one
    assert 0.15 < remote / 256 < 0.3  # as bench/bounds.py has it on this box: about a fifth
    ident = Identity(0, 2, "10.0.0.1", None)
    base = {"HYBRID_INSTANCE": "mix", "HYBRID_SHM_DIR": "/dev/shm"}
    rec = resolve_stage(plan, split, ident, base, lay)
    env, argv = vllm_env(plan, rec, ident, None, base), vllm_command(plan, rec, ident, python="py")
    sock = "/dev/shm/hybrid-mix-r2-s1.experts"
    assert env["HYBRID_EXPERTS_SOCKET"] == sock and env["VLLM_PP_LAYER_PARTITION"] == "32"
    placed = experts.parse_placement(env["HYBRID_EXPERTS_REMOTE"])
    counts = [len(placed.get(layer, [])) for layer in range(32)]
    assert sum(counts) == remote and max(counts) - min(counts) <= 1 and max(counts) < 8
    assert int(env["HYBRID_EXPERTS_BYTES"]) >= remote * one
    assert argv[argv.index("--max-cudagraph-capture-size") + 1] == env["HYBRID_EXPERTS_MAX_ROWS"] == "64"
    assert "--no-async-scheduling" not in argv  # one vLLM stage: it schedules the next step while one runs
    server = get("experts").server(plan, lay, Identity(1, 2, "10.0.0.1", None), base)
    assert server.argv[:4] == ("-m", "vllm_hybrid.experts", "--socket", sock)
    assert server.summary["for_stage"] == 0
    from vllm_hybrid.cpubind import plan_binding
    spins = server.env(plan_binding([1, 2], {0: [1, 2]}, reserve=0), {"OMP_WAIT_POLICY": "PASSIVE"})
    assert "OMP_WAIT_POLICY" not in spins  # its threads spin between two MoE layers (the product server's sleep)
    assert get("experts").server(plan, lay, ident, base) is None


def test_experts_refuses_dense_models_and_plans_it_cannot_serve():
    plan, split = planned([GPU, CPU], strategy="experts")  # Llama: no routed experts
    with pytest.raises(PlanError, match=r"strategy: experts needs a mixture-of-experts model \(LlamaForCausalLM"):
        resolve(plan, split)
    plan, shape = mixtral_plan()
    split = split_layers(plan, shape)
    with pytest.raises(PlanError, match="experts needs the stages of a replica to share /dev/shm"):
        resolve(plan, split, shared_shm=False)
    plan, shape = mixtral_plan(stages=({**MIXTRAL_GPU, "tensor_parallel": 2}, {**MIXTRAL_CPU, "tensor_parallel": 2}))
    with pytest.raises(PlanError, match="experts needs tensor_parallel 1 on the gpu stage"):
        resolve(plan, split_layers(plan, shape))
    plan, shape = mixtral_plan(stages=(MIXTRAL_GPU, MIXTRAL_CPU, {**MIXTRAL_CPU, "name": "cpu2"}))
    with pytest.raises(PlanError, match="experts needs one gpu stage and one cpu stage"):
        resolve(plan, split_layers(plan, shape))
    plan, shape = mixtral_plan(stages=({**MIXTRAL_GPU, "memory": "16Gi"}, MIXTRAL_CPU))
    with pytest.raises(PlanError, match=r"stages\[0\] \(gpu\): strategy experts does not fit"):
        resolve(plan, split_layers(plan, shape))
    plan, split = planned([GPU, CPU], strategy="auto")  # dense: auto leaves it out
    assert "experts" not in resolve(plan, split)[1]


@pytest.mark.parametrize("concurrency", [1, 4, 16, 64])
def test_auto_picks_experts_where_the_measured_runs_found_it_fastest(concurrency):
    """The Mixtral-8x7B shape on the H100 box as bench/gpu_bench.py plans it (gpu_bench-experts-mixtral-h100-b.json,
    32 + 16 tokens a request): experts was the fastest measured at 1, 4, 16 and 64 (1.5-1.6x pipeline and
    offload), so auto picks it there, with the box's measured DRAM bandwidth."""
    stages = ({"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.92, "memory": "81559Mi"},
              {"name": "cpu", "device": "cpu", "cpus": 15, "memory": f"{128887 - 16384}Mi"})
    plan, shape = mixtral_plan(stages, strategy="auto", max_num_seqs=64, block_size=128,
                               max_num_batched_tokens=512, expected_concurrency=concurrency,
                               expected_prompt_tokens=32, expected_output_tokens=16, hardware={"dram_gbs": 111.5})
    lay, est = resolve(plan, split_layers(plan, shape))
    assert lay.strategy == "experts" and est["experts"] > max(v for k, v in est.items() if k != "experts")


def test_experts_cost_reads_the_routed_cpu_experts_and_streams_them_for_large_steps():
    from vllm_hybrid.strategies import Workload, get
    from vllm_hybrid.strategies.offload import prefetch_cost
    plan, shape = mixtral_plan()
    split = split_layers(plan, shape)
    strategy = get("experts")
    lay, hw = strategy.layout(plan, split), Hardware()
    steps = {c: strategy.cost(plan, split, lay, 0, Workload(c, 512, 256), hw).step_s for c in (1, 2, 4, 64, 65)}
    assert 0 < steps[1] < steps[2] < steps[4]  # more tokens route to more of the cpu experts
    assert steps[4] < 4 * steps[1] and steps[64] < 8 * steps[1]  # but each expert is read once, whatever its tokens
    # above max_rows the step streams the cpu experts to the gpu, as the prefetch offloader would
    assert steps[65] == prefetch_cost(lay.offload_bytes[0], Workload(65, 512, 256), plan, hw).step_s
