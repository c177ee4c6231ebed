"""A small random Llama with an offline-trained tokenizer (no model hub needed)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = ["the", "pipeline", "stage", "layer", "cache", "token", "model", "memory", "thread", "core", "node", "pod", "gpu", "cpu", "fast", "slow", "request", "answer", "question", "hello", "world", "serve", "batch", "prompt", "sequence", "kernel", "tensor", "graph", "split", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "red", "green", "blue", "small", "large", "first", "last"]


def _corpus(n: int = 2000) -> list[str]:
    """Deterministic pseudo-text: enough variety for a BPE of a few hundred tokens."""
    out, x = [], 12345
    for _ in range(n):
        words = []
        for _ in range(12):
            x = (1103515245 * x + 12345) % (1 << 31)
            words.append(_WORDS[x % len(_WORDS)])
        out.append(" ".join(words).capitalize() + ".")
    return out


def train_tokenizer(out: Path, vocab_size: int = 512) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def make_tiny_llama(out: str | Path, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 256, dtype: str = "float32", seed: int = 0,
                    max_positions: int = 2048, experts: int = 0, shared: int = 0, qwen3: bool = False) -> Path:
    """Writes config.json, safetensors weights and the tokenizer to `out` (idempotent). experts > 0:
    a Mixtral (mixture of experts, 2 routed per token) of the same size, each expert `intermediate` wide;
    and shared > 0: a Qwen2-MoE instead, whose every token also runs a shared expert `shared` wide; qwen3: a
    Qwen3-MoE instead (Qwen3-235B-A22B's architecture: q/k norms, routing weights renormalized, no shared expert)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    out = Path(out)
    marker = out / "hybrid-tiny.json"
    spec = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                dtype=dtype, seed=seed, max_positions=max_positions, experts=experts, shared=shared)
    if qwen3:
        spec["qwen3"] = True  # (absent otherwise: the markers of models made before it stay valid)
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=hidden // heads, max_position_embeddings=max_positions,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  # wider init than 0.02: peaked logits, so greedy decoding has no near-ties
                  initializer_range=0.1, torch_dtype=dtype)
    if experts and qwen3:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=intermediate, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], **common))
    elif experts and shared:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=intermediate, norm_topk_prob=False,
            shared_expert_intermediate_size=shared, decoder_sparse_step=1, mlp_only_layers=[], **common))
    elif experts:
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=experts, num_experts_per_tok=2, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return out


def make_tiny_gpt_oss(out: str | Path, layers: int = 4, hidden: int = 256, experts: int = 4, seed: int = 0) -> Path:
    """A tiny gpt-oss (GptOssForCausalLM: biased experts on a clamped SwiGLU, attention sinks, sliding and full
    attention layers in turn) whose routed experts are MXFP4 as gpt-oss ships them (`*_blocks`: FP4 E2M1 pairs,
    `*_scales`: E8M0 per 32 inputs, quantization_config "mxfp4"); everything else bf16. Idempotent."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    from .strategies.experts.quantized import MX_GROUP, quantize

    out = Path(out)
    marker = out / "hybrid-tiny.json"
    spec = dict(arch="gpt_oss", layers=layers, hidden=hidden, experts=experts, seed=seed, experts_format="mxfp4")
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out)
    torch.manual_seed(seed)
    config = GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=2048, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 1.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 2048, "truncate": False},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    weights = load_file(out / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = weights.pop(name).transpose(1, 2)  # E x in x out -> E x out x in: MXFP4 groups run along the inputs
        q = quantize("mxfp4", w)
        e, n, k = w.shape
        weights[name + "_blocks"] = q["w"].reshape(e, n, k // MX_GROUP, MX_GROUP // 2).contiguous()
        weights[name + "_scales"] = q["scale"].contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    marker.write_text(json.dumps(spec))
    return out


# The widths of a tiny model every quantized format below loads with, on vLLM's CPU and CUDA kernels: each product's
# input and output a multiple of 128 (FP8 block-128: 128x128 weight blocks, and vLLM wants every part of a merged
# product but the last, q and k of qkv, gate of gate_up, a whole number of blocks), the W4A16 groups (128) whole,
# and the CPU int4 kernel's multiples of 32 (CPUWNA16LinearKernel). q 256, k and v 128 each (head_dim 64).
QUANTIZABLE_TINY = dict(hidden=256, heads=4, kv_heads=2, intermediate=512)

# compressed-tensors' preset schemes, as llm-compressor's recipes name them, and the format each is stored in
QUANT_SCHEMES = {
    "w4a16": "W4A16",  # int4 weights, symmetric, in groups of 128 inputs; activations as they are (pack-quantized)
    "int8": "W8A8",  # int8 weights per output channel, int8 activations per token at run time (int-quantized)
    "fp8-block": "FP8_BLOCK",  # FP8 E4M3 weights in 128x128 blocks, FP8 activations per group of 128 at run time
    "fp8-dynamic": "FP8_DYNAMIC",  # FP8 per-channel: FP8 weights per output channel, FP8 activations per token
}
# left unquantized where a checkpoint has them, as published quantized checkpoints leave them: the output head and
# the MoE routers (Mixtral's block_sparse_moe.gate, Qwen-MoE's mlp.gate and its shared expert's one-wide gate)
UNQUANTIZED = ["lm_head", "re:.*block_sparse_moe\\.gate$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]
ATTENTION = ["re:.*self_attn\\..*"]  # quantize_checkpoint(ignore=ATTENTION): the experts (and MLPs) only


def _weight_qparams(weight, args):
    """compressed-tensors' scale (and zero point) of a weight for `args`: min and max over its channel, group or
    block, then calculate_qparams (what llm-compressor's min-max observer does, without calibration data)."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.float()
    if args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    elif args.strategy == QuantizationStrategy.GROUP:
        groups = w.unflatten(-1, (-1, args.group_size))
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    elif args.strategy == QuantizationStrategy.BLOCK:
        (bn, bk), (n, k) = args.block_structure, w.shape
        blocks = w.reshape(n // bn, bn, k // bk, bk)
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        raise ValueError(f"weight strategy {args.strategy} is not written here")
    scale, zero_point = calculate_qparams(lo, hi, args)
    return scale.to(weight.dtype), zero_point


def quantize_checkpoint(src: str | Path, out: str | Path, scheme: str, ignore: Sequence[str] = ()) -> Path:
    """A copy of the model directory `src` with its linear layers quantized in the compressed-tensors format, as
    llm-compressor writes one (idempotent): scheme is one of QUANT_SCHEMES. Every 2-D weight of a linear layer is
    quantized (round to nearest, scales from the weight's own min and max) and stored by compressed-tensors' own
    compressor for the scheme; embeddings, norms, UNQUANTIZED and `ignore` (more such patterns, e.g. ATTENTION: a
    checkpoint whose experts only are quantized) stay as they are; config.json gets the
    quantization_config that compressed-tensors' ModelCompressor writes. The widths must suit the scheme
    (QUANTIZABLE_TINY suits them all).

    scheme "gptq" writes AutoGPTQ's format instead (quant_method gptq, 4-bit, groups of 128, symmetric), "awq"
    AutoAWQ's (quant_method awq, 4-bit GEMM, groups of 128, zero points).

    It works on the checkpoint's tensors, not on a transformers model: transformers 5 fuses a MoE's experts into one
    3-D parameter, which apply_quantization_config (it targets Linear modules) would leave unquantized, while the
    checkpoint keeps one linear weight per expert, the names quantized checkpoints and vLLM use."""
    import torch
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.utils.match import match_name, match_quantizable_tensors
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if scheme not in QUANT_SCHEMES and scheme not in PACKED_SCHEMES:
        raise ValueError(f"scheme {scheme!r}: one of {', '.join([*QUANT_SCHEMES, *PACKED_SCHEMES])}")
    src, out = Path(src), Path(out)
    marker = out / "hybrid-quantized.json"
    source = src / "hybrid-tiny.json"
    spec = {"scheme": scheme, "source": str(src), "source_spec": source.read_text() if source.exists() else None,
            "ignore": list(ignore)}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    out.mkdir(parents=True, exist_ok=True)
    packed = PACKED_SCHEMES.get(scheme)  # AutoGPTQ / AutoAWQ: (its writer, its quantization_config)
    if packed is None:
        qscheme = preset_name_to_scheme(QUANT_SCHEMES[scheme], targets=["Linear"])
        qscheme.format = infer_module_format(torch.nn.Linear, qscheme).value
        compressor = BaseCompressor.get_value_from_registry(qscheme.format)

    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{src}: no safetensors weights")
    names = []
    for shard in shards:
        with safe_open(shard, "pt") as f:
            names += list(f.keys())
    ignore = [pattern for pattern in [*UNQUANTIZED, *ignore]
              if any(match_name(n.rpartition(".")[0], pattern) for n in names)]
    weight_map = {}
    for shard in shards:
        tensors = load_file(shard)
        targets = [(module, name) for module, name in match_quantizable_tensors(
                       tensors, ignore=[*ignore, "re:.*embed_tokens$"], targets=["Linear"])
                   if tensors[name].ndim == 2]
        for module, name in targets:
            weight = tensors.pop(name)
            if packed is not None:
                tensors.update({f"{module}.{key}": value for key, value in packed[0](weight).items()})
                continue
            scale, zero_point = _weight_qparams(weight, qscheme.weights)
            local = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point},
                                        qscheme)
            tensors.update({f"{module}.{key}": value.contiguous() for key, value in local.items()})
        save_file(tensors, out / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))

    for f in src.iterdir():  # config, tokenizer, generation config: as they are (not the weights, nor a marker)
        if (f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json"
                and not f.name.startswith("hybrid-")):
            (out / f.name).write_bytes(f.read_bytes())
    if (src / "model.safetensors.index.json").exists():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        (out / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}, indent=1))
    if packed is not None:  # its own config (routers and lm_head: never quantized in vLLM's models)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": packed[1]}, indent=1))
    else:
        config = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=ignore, format=qscheme.format,
                                    quantization_status=QuantizationStatus.COMPRESSED)
        ModelCompressor(quantization_config=config).update_config(str(out))
    marker.write_text(json.dumps(spec))
    return out


def _awq(weight, group: int = 128) -> dict:
    """An N x K weight as AutoAWQ writes it (4-bit GEMM version, a zero point per group): qweight K x N/8 int32
    (8 output columns a word, in AutoAWQ's order), qzeros K/group x N/8 alike, scales K/group x N fp16; each
    group's zero point is its own (min-max), so the format's zero points are really read."""
    from .strategies.experts.quantized import quantize
    q = quantize("w4a16-awq", weight[None].float(), group)
    return {"qweight": q["w"][0].contiguous(), "qzeros": q["zeros"][0].contiguous(), "scales": q["scale"][0].contiguous()}


def _gptq(weight, group: int = 128) -> dict:
    """An N x K weight as AutoGPTQ writes it (4-bit, symmetric, no activation order, its v1 format): qweight K/8 x N
    int32 (8 values along K a word), scales K/group x N fp16, qzeros K/group x N/8 int32 (8 zero points a word,
    stored less one: 8 as 7), g_idx the group of each input."""
    import torch

    from .strategies.experts.quantized import quantize
    q = quantize("w4a16", weight[None].float(), group)
    n, k = weight.shape
    return {"qweight": q["w"][0].contiguous(), "scales": q["scale"][0].to(torch.float16).contiguous(),
            "qzeros": torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32),
            "g_idx": (torch.arange(k, dtype=torch.int32) // group)}


# the formats quantize_checkpoint writes by its own packing: each scheme's writer and quantization_config
PACKED_SCHEMES = {
    "gptq": (_gptq, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                     "checkpoint_format": "gptq"}),
    "awq": (_awq, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}),
}


def make_shaped_model(out: str | Path, config: dict) -> Path:
    """config.json of a real architecture + a word-level tokenizer covering its whole vocabulary,
    for serving with `--load-format dummy` (benchmarks: real shapes, no weights to download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", unk_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 32768,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "router_aux_loss_coef": 0.02,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
# a fine-grained mixture of experts with a shared expert: 64 experts of 2560, 8 routed, one shared of 20480
QWEN2_57B_A14B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 3584,
    "intermediate_size": 18944, "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 151936,
    "max_position_embeddings": 32768, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "router_aux_loss_coef": 0.001,
    "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
}
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
# the same architecture, wider and deeper
LLAMA_3_1_70B = {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64}

# Qwen3-235B-A22B: 94 layers of 128 experts (8 routed, 1536 wide), q/k norms, no shared expert
QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "max_position_embeddings": 40960, "max_window_layers": 94, "num_attention_heads": 64,
    "num_hidden_layers": 94, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False, "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
# W4A16 in groups of 128 as llm-compressor writes it (compressed-tensors pack-quantized), the routers left out
W4A16_GROUP128 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*mlp.gate$"],
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                              "symmetric": True, "dynamic": False}}}}
# compressed-tensors' W8A8 preset as llmcompressor writes it: int8 weights per output channel, int8 activations per
# token at run time (the bench's llama-3.1-8b-int8: issue 48's dense case under strategy coprocessor)
W8A8_INT8 = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                  "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
                                              "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                        "symmetric": True, "dynamic": True}}}}
# gpt-oss-120b as openai ships it: 36 layers of 128 biased experts (4 routed) in MXFP4, sinks, window/full attention
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "initial_context_length": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "experts_per_token": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False}, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
    "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
