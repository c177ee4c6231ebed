import json

import pytest
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import GiB, model_shape, read_model_config, split_layers
from vllm_hybrid.strategies import get

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def plan(stages, **kw):
    return plan_from_dict({"model": "/m", "max_model_len": 8192, "stages": stages, **kw})


def test_llama8b_shape_matches_known_sizes():
    s = model_shape(LLAMA_8B)
    assert s.layer_bytes == 436_224_000  # 218.1M params per layer in bf16
    assert s.embedding_bytes == 128256 * 4096 * 2
    assert s.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    total = 32 * s.layer_bytes + 2 * s.embedding_bytes
    assert 15.9e9 < total < 16.2e9  # the well-known ~16 GB of Llama-3.1-8B in bf16


def test_gpu_first_then_cpu_and_the_arithmetic_adds_up():
    p = plan([{"name": "gpu", "device": "gpu", "memory": "12Gi", "gpu_memory_utilization": 0.9},
              {"name": "cpu", "device": "cpu", "cpus": 16, "memory": "64Gi"}])
    split = split_layers(p, model_shape(LLAMA_8B))
    gpu, cpu = split.stages
    assert gpu.layers + cpu.layers == 32 and split.partition == f"{gpu.layers},{cpu.layers}"
    # the GPU stage is filled: one more layer (+ its minimum KV) would not fit its budget
    per_layer = 436_224_000 + 8192 * 4096
    assert gpu.weight_bytes + gpu.layers * 8192 * 4096 <= gpu.budget_bytes < gpu.weight_bytes + gpu.layers * 8192 * 4096 + per_layer
    assert (gpu.first_layer, cpu.first_layer) == (0, gpu.layers)
    assert cpu.kv_bytes == cpu.budget_bytes - cpu.weight_bytes > 0
    assert "VLLM_PP_LAYER_PARTITION=" in split.describe()


def test_cpu_first_order_still_fills_the_gpu_and_is_deterministic():
    stages = [{"name": "cpu", "device": "cpu", "cpus": 16, "memory": "64Gi"},
              {"name": "gpu", "device": "gpu", "memory": "12Gi"}]
    a = split_layers(plan(stages), model_shape(LLAMA_8B))
    b = split_layers(plan(stages), model_shape(LLAMA_8B))
    assert a == b
    cpu, gpu = a.stages
    # the GPU (second here) got its fill: one more layer (+ its minimum KV) would not fit its budget; the CPU the rest
    per_layer = 436_224_000 + 8192 * 4096
    assert gpu.weight_bytes + gpu.layers * 8192 * 4096 <= gpu.budget_bytes < gpu.weight_bytes + gpu.layers * 8192 * 4096 + per_layer
    assert cpu.layers == 32 - gpu.layers and gpu.layers > 1
    assert a.stages[0].weight_bytes > a.stages[0].layers * 436_224_000  # embedding on stage 0


def test_cpu_stages_share_by_cpu_count():
    p = plan([{"name": "a", "device": "cpu", "cpus": 8, "memory": "200Gi"},
              {"name": "b", "device": "cpu", "cpus": 24, "memory": "200Gi"}])
    assert split_layers(p, model_shape(LLAMA_8B)).partition == "8,24"


def test_explicit_layers_checked():
    p = plan([{"name": "g", "device": "gpu", "layers": 16}, {"name": "c", "device": "cpu", "layers": 16, "cpus": 8, "memory": "64Gi"}])
    assert split_layers(p, model_shape(LLAMA_8B)).partition == "16,16"
    p = plan([{"name": "g", "device": "gpu", "layers": 10}, {"name": "c", "device": "cpu", "layers": 16, "cpus": 8, "memory": "64Gi"}])
    with pytest.raises(PlanError, match="sum to 26, but the model has 32"):
        split_layers(p, model_shape(LLAMA_8B))


def test_refuses_when_it_does_not_fit():
    p = plan([{"name": "g", "device": "gpu", "memory": "8Gi"}, {"name": "c", "device": "cpu", "cpus": 8, "memory": "8Gi"}])
    with pytest.raises(PlanError, match="does not fit: 32 layers"):
        split_layers(p, model_shape(LLAMA_8B))
    p = plan([{"name": "g", "device": "gpu", "layers": 2}, {"name": "c", "device": "cpu", "layers": 30, "cpus": 8, "memory": "8Gi"}])
    with pytest.raises(PlanError, match=r"stages\[1\] \(c\): does not fit") as err:
        split_layers(p, model_shape(LLAMA_8B))
    assert "budget is 5.00 GiB (memory 8.00 GiB minus 3 GiB for the runtime)" in str(err.value)


def test_gpu_memory_needed_without_explicit_layers():
    p = plan([{"name": "g", "device": "gpu"}, {"name": "c", "device": "cpu", "cpus": 8, "memory": "64Gi"}])
    with pytest.raises(PlanError, match="memory of one GPU"):
        split_layers(p, model_shape(LLAMA_8B))
    assert split_layers(p, model_shape(LLAMA_8B), gpu_memory_bytes=80 * GiB).stages[0].layers == 31


def test_unknown_architecture_and_missing_files(tmp_path):
    with pytest.raises(PlanError, match="unsupported architecture"):
        model_shape({**LLAMA_8B, "architectures": ["MambaForCausalLM"]})
    with pytest.raises(PlanError, match="lacks hidden_size"):
        model_shape({k: v for k, v in LLAMA_8B.items() if k != "hidden_size"})
    with pytest.raises(PlanError, match="missing model files"):
        read_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert read_model_config(str(tmp_path))["hidden_size"] == 4096


def test_mixtral_counts_every_expert_and_its_router():
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    s = model_shape(MIXTRAL_8X7B)
    assert s.experts == 8
    per_layer = 4096 * 128 * (2 * 32 + 2 * 8) + 8 * (3 * 4096 * 14336 + 4096) + 2 * 4096
    assert s.layer_bytes == 2 * per_layer
    total = 32 * s.layer_bytes + 2 * s.embedding_bytes
    assert 93.0e9 < total < 93.8e9  # Mixtral-8x7B's 46.7B parameters in bf16


def test_every_stage_of_a_model_vllm_builds_both_ends_on_every_rank_counts_them():
    """vLLM 0.26's Qwen3-MoE (Mixtral, Qwen2-MoE, gpt-oss, ...) makes the embedding and the LM head on every pipeline
    rank: a GPU stage of the 235B holding layers 62-93 loaded 40.58 GiB where 39.41 were planned for its layers and LM
    head alone (H200, 2026-11-28). Llama's ranks make only their own ends."""
    qwen3 = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096, "moe_intermediate_size": 1536,
             "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_attention_heads": 64,
             "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "torch_dtype": "bfloat16",
             "tie_word_embeddings": False, "intermediate_size": 12288}
    stages = [{"name": "a", "device": "cpu", "cpus": 8, "memory": "4000Gi", "layers": 30},
              {"name": "b", "device": "cpu", "cpus": 8, "memory": "4000Gi", "layers": 34},
              {"name": "c", "device": "cpu", "cpus": 8, "memory": "4000Gi", "layers": 30}]
    for config, ends in ((qwen3, [2, 2, 2]), ({**LLAMA_8B, "num_hidden_layers": 94}, [1, 0, 1])):
        shape = model_shape(config)
        split = split_layers(plan(stages), shape)
        fixed = [sp.weight_bytes - sp.layers * shape.layer_bytes for sp in split.stages]
        assert [f // shape.embedding_bytes for f in fixed] == ends


def test_qwen2_moe_counts_its_fine_grained_experts_and_the_shared_one():
    from vllm_hybrid.tinymodel import QWEN2_57B_A14B
    s = model_shape(QWEN2_57B_A14B)
    assert (s.experts, s.routed, s.intermediate, s.shared) == (64, 8, 2560, 20480)  # routed experts' width
    assert s.expert_elems == 3 * 2560 * 3584 and s.layer_expert_bytes == 64 * s.expert_elems * 2
    shared = 3 * 20480 * 3584 + 3584  # every token runs it: not an expert a step may leave unread
    qkv_bias = 128 * (28 + 2 * 4)  # Qwen2's attention has one
    assert s.layer_bytes - s.layer_expert_bytes == 2 * (3584 * 128 * (2 * 28 + 2 * 4) + qkv_bias + 64 * 3584 + 2 * 3584
                                                        + shared)
    assert s.layer_read_bytes(1) == s.layer_bytes - 56 * s.expert_elems * 2
    total = 28 * s.layer_bytes + 2 * s.embedding_bytes
    assert 114.0e9 < total < 115.5e9  # Qwen2-57B-A14B's 57.4B parameters in bf16
    with pytest.raises(PlanError, match="every layer must be a mixture of experts"):
        model_shape({**QWEN2_57B_A14B, "decoder_sparse_step": 2})


def test_a_mixture_of_experts_step_reads_the_experts_its_tokens_route_to():
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    s, expert = model_shape(MIXTRAL_8X7B), 2 * 3 * 4096 * 14336
    assert s.routed == 2
    assert s.layer_read_bytes(1) == s.layer_bytes - 6 * expert  # one token: 2 of the 8 experts
    assert s.layer_read_bytes(4) == round(s.layer_bytes - 8 * 0.75 ** 4 * expert)
    assert s.layer_bytes - s.layer_read_bytes(64) < 1e-6 * s.layer_bytes  # a large batch: all of them
    assert s.active_layer_elems * 2 == s.layer_bytes - 6 * expert
    dense = model_shape(LLAMA_8B)
    assert dense.layer_read_bytes(1) == dense.layer_bytes and dense.active_layer_elems * 2 == dense.layer_bytes


def test_a_model_larger_than_the_gpu_splits_by_both_memories():
    # Llama-3.1-70B shape (141 GB in bf16) on an 80 GB GPU and 110Gi of host RAM for the cpu stage
    from vllm_hybrid.tinymodel import LLAMA_3_1_70B
    shape = model_shape(LLAMA_3_1_70B)
    p = plan([{"name": "cpu", "device": "cpu", "cpus": 15, "memory": "110Gi"},
              {"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.92}], dtype="bfloat16")
    cpu, gpu = split_layers(p, shape, gpu_memory_bytes=int(79.2 * GiB)).stages
    assert cpu.layers + gpu.layers == 80 and gpu.layers >= 40  # the GPU is filled first
    for s in (cpu, gpu):
        assert s.weight_bytes + s.kv_bytes <= s.budget_bytes and s.kv_tokens >= 8192


def test_each_strategy_gets_a_split_that_fits_its_gpu_memory():
    # the 70B shape on an 80 GB GPU + 110Gi for the cpu stage, CPU stage first (the LM head on the GPU)
    from vllm_hybrid.strategies import resolve_split
    from vllm_hybrid.strategies.balanced import helper_gpu_bytes
    from vllm_hybrid.strategies.balanced.io import HELPER_RING_SLOTS
    from vllm_hybrid.tinymodel import LLAMA_3_1_70B
    shape, gpu_mem = model_shape(LLAMA_3_1_70B), int(79.2 * GiB)
    stages = [{"name": "cpu", "device": "cpu", "cpus": 15, "memory": "110Gi"},
              {"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.92}]
    kv = shape.kv_bytes_per_token_per_layer * 8192
    got = {}
    for strategy in ("pipeline", "offload", "balanced"):
        p = plan(stages, dtype="bfloat16", strategy=strategy, max_num_batched_tokens=4096)
        split, lay, _ = resolve_split(p, shape, gpu_mem)
        cpu, gpu = split.stages
        got[strategy] = gpu.layers
        assert lay.strategy == strategy and cpu.layers + gpu.layers == 80
        if strategy == "offload":  # the GPU holds its layers, both ends, one prefetch buffer and every layer's KV
            assert gpu.layers * shape.layer_bytes + 2 * shape.embedding_bytes + shape.layer_bytes + 80 * kv <= gpu.budget_bytes
        if strategy == "balanced":  # the GEMM helper's ring of the biggest weight (gate_up) sits beside vLLM
            helper = helper_gpu_bytes(p, shape, 1)
            assert helper > HELPER_RING_SLOTS * 2 * 28672 * 8192 * 2 and gpu.beside_vllm_bytes == helper
            assert gpu.gpu_memory_utilization == round(0.92 - helper / gpu_mem, 4)
            assert gpu.weight_bytes + gpu.layers * kv <= gpu.budget_bytes == int(gpu_mem * 0.92) - 2 * GiB - helper
    assert got["pipeline"] > got["offload"] > got["balanced"] >= 30


def test_offload_counts_the_pinned_copies_as_torch_allocates_them():
    # torch's pinned-memory allocator rounds each tensor to a power of two: 41 streamed layers of the 70B
    # shape held 82.58 GB of pinned memory on the H100 (bench/results/gpu_bench-70b-h100.json, p-offload)
    from vllm_hybrid.tinymodel import LLAMA_3_1_70B
    shape = model_shape(LLAMA_3_1_70B)
    assert shape.pinned_layer_bytes == (256 + 128 + 1024 + 512) * 2**20 + 2 * 16 * 2**10
    assert abs(41 * shape.pinned_layer_bytes / 1e9 - 82.58) < 0.1
    # a cpu stage with room for 20 layers' weights (less the LM head it would hold last): too small for
    # the model either way; the refusal says how many layers it holds under each strategy
    stages = [{"name": "gpu", "device": "gpu", "gpu_memory_utilization": 0.92},
              {"name": "cpu", "device": "cpu", "cpus": 8, "memory": f"{(20 * shape.layer_bytes + 3 * GiB) >> 20}Mi"}]
    for strategy, held in (("offload", 15), ("pipeline", 18)):
        with pytest.raises(PlanError, match=f"cpu fits {held}\\)"):
            split_layers(plan(stages, dtype="bfloat16"), shape, int(79.2 * GiB), get(strategy))


def test_explicit_layers_of_a_streamed_cpu_stage_are_checked_at_the_size_they_take():
    # 41 layers of the 70B shape: 65.2 GiB as plain weights, 76.9 GiB as offload's pinned copies; a cpu
    # stage of 75Gi holds them under pipeline and coprocessor (no KV there), not under offload
    from vllm_hybrid.tinymodel import LLAMA_3_1_70B
    shape = model_shape(LLAMA_3_1_70B)
    stages = [{"name": "gpu", "device": "gpu", "layers": 39, "gpu_memory_utilization": 0.92},
              {"name": "cpu", "device": "cpu", "layers": 41, "cpus": 8, "memory": "75Gi"}]
    with pytest.raises(PlanError, match=r"stages\[1\] \(cpu\): does not fit: 41 layers need 78\.\d\d GiB"):
        split_layers(plan(stages, dtype="bfloat16"), shape, int(79.2 * GiB), get("offload"))
    for strategy in ("pipeline", "coprocessor"):
        cpu = split_layers(plan(stages, dtype="bfloat16"), shape, int(79.2 * GiB), get(strategy)).stages[1]
        assert cpu.weight_bytes > 41 * shape.layer_bytes
    # what `vllm-hybrid plan` says of it: the coprocessor's cpu stage keeps weights only, pipeline's a KV cache
    coproc = split_layers(plan(stages, dtype="bfloat16"), shape, int(79.2 * GiB), get("coprocessor"))
    pipe = split_layers(plan(stages, dtype="bfloat16"), shape, int(79.2 * GiB), get("pipeline"))
    assert coproc.stages[1].kv_bytes == 0 and "KV 0.00 GiB (0 tokens)" in coproc.describe().splitlines()[2]
    assert pipe.stages[1].kv_bytes == pipe.stages[1].budget_bytes - pipe.stages[1].weight_bytes > 0


def test_a_gpu_stage_of_explicit_layers_without_its_memory_is_checked_against_the_gpu_it_runs_on():
    from vllm_hybrid.planner import check_gpu_fit
    p = plan([{"name": "g", "device": "gpu", "layers": 30}, {"name": "c", "device": "cpu", "layers": 2, "cpus": 8,
                                                              "memory": "64Gi"}])
    split = split_layers(p, model_shape(LLAMA_8B))  # the split needs no GPU memory: `plan` says what it left out
    gpu_row, cpu_row = split.describe().splitlines()[1:3]
    assert not split.stages[0].fit_checked and "fit NOT checked: the GPU's memory is unknown" in gpu_row
    assert split.stages[1].fit_checked and "of budget 61.00 GiB" in cpu_row and "NOT" not in cpu_row
    # 30 layers of Llama-3.1-8B (12.19 GiB), its embedding (0.98 GiB), KV for one 8192-token sequence (0.94 GiB)
    with pytest.raises(PlanError, match=r"stages\[0\] \(g\): does not fit: 30 layers need 14\.\d\d GiB") as err:
        check_gpu_fit(p, model_shape(LLAMA_8B), 0, 16 * GiB)
    assert "budget is 12.40 GiB (gpu_memory_utilization 0.9 of each GPU (16.00 GiB) minus 2 GiB" in str(err.value)
    fits = check_gpu_fit(p, model_shape(LLAMA_8B), 0, int(79.2 * GiB))
    assert fits.fit_checked and fits.kv_tokens > 8192 and fits.layers == 30
    assert split_layers(p, model_shape(LLAMA_8B)) == split  # a check only: every pod computes the same split


def test_serve_measures_the_gpu_and_refuses_a_stage_that_does_not_fit_before_vllm_loads(tmp_path, monkeypatch, caplog):
    import argparse

    from vllm_hybrid import cli
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    (tmp_path / "plan.json").write_text(json.dumps({
        "model": str(tmp_path), "max_model_len": 8192,
        "stages": [{"name": "g", "device": "gpu", "layers": 30},
                   {"name": "c", "device": "cpu", "layers": 2, "cpus": 1, "memory": "64Gi"}]}))
    args = argparse.Namespace(plan=str(tmp_path / "plan.json"), stage=0, replica=0, gpu_memory=None)
    env = {"HYBRID_CPUS": "0"}
    monkeypatch.setattr(cli, "visible_gpu_memory", lambda: 16 * GiB)
    with pytest.raises(PlanError, match=r"stages\[0\] \(g\): does not fit: 30 layers need 14\.\d\d GiB .* \(16\.00 GiB\)"):
        cli.build_stage(args, dict(env))
    monkeypatch.setattr(cli, "visible_gpu_memory", lambda: int(79.2 * GiB))
    with caplog.at_level("INFO", logger="vllm_hybrid"):
        assert cli.build_stage(args, dict(env))[2] is not None  # vLLM's argv: it starts
    assert "stage g: its 30 layers fit this GPU (79.20 GiB)" in caplog.text
    monkeypatch.setattr(cli, "visible_gpu_memory", lambda: None)  # no GPU to ask: it starts, and says so
    with caplog.at_level("WARNING", logger="vllm_hybrid"):
        assert cli.build_stage(args, dict(env))[2] is not None
    assert "stage g: no GPU visible to measure: the fit of its 30 layers is not checked" in caplog.text
    # the cpu stage has nothing to measure
    monkeypatch.setattr(cli, "visible_gpu_memory", lambda: pytest.fail("a cpu stage asked for the GPU's memory"))
    cli.build_stage(argparse.Namespace(**{**vars(args), "stage": 1}), dict(env))


def test_the_gpu_memory_is_what_torch_reports_in_a_child_process(tmp_path):
    from vllm_hybrid.cli import GPU_MEMORY_CODE, visible_gpu_memory
    assert "torch.cuda.mem_get_info()[1]" in GPU_MEMORY_CODE  # the total vLLM takes gpu_memory_utilization of
    fake = tmp_path / "python"
    for script, expected in (("echo 'a warning'; echo 85045870592", 85045870592), ("echo", None),
                             ("echo 85045870592; exit 1", None)):
        fake.write_text(f"#!/bin/sh\n{script}\n")
        fake.chmod(0o755)
        assert visible_gpu_memory(str(fake)) == expected
    assert visible_gpu_memory(str(tmp_path / "missing")) is None
