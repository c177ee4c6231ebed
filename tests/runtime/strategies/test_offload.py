"""offload: the gpu stage runs every layer, streaming the cpu stages' with vLLM's offloaders."""
import pytest
from strategy_plans import CPU, GPU, SHAPE, bench_run, planned
from vllm_hybrid.identity import Identity
from vllm_hybrid.launcher import resolve_stage, vllm_command, vllm_env
from vllm_hybrid.plan import PlanError
from vllm_hybrid.strategies import Hardware, resolve
from vllm_hybrid.strategies.streaming import prefetch_groups


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


def test_the_prefetch_offload_cost_model_matches_the_bench():
    # bench/results/gpu_bench-prefetch.json: `strategy: offload` on vLLM's prefetch offloader, one H200 lease
    run = bench_run("gpu_bench-prefetch.json")
    assert run["b-offload"]["offload_verified"]  # the engine said PrefetchOffloader
    for w in run["b-offload"]["waves"]:
        plan, split = planned([GPU, CPU], strategy="offload", expected_concurrency=w["concurrency"],
                              expected_prompt_tokens=128, expected_output_tokens=128)
        _, est = resolve(plan, split, Hardware(dram_gbs=run["dram_read_gbs"]))
        assert est["offload"] == pytest.approx(w["tok_per_s"], rel=0.1)
