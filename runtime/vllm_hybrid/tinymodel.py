"""A small random Llama with an offline-trained tokenizer (no model hub needed)."""
from __future__ import annotations

import json
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
                    max_positions: int = 2048, experts: int = 0, shared: int = 0) -> Path:
    """Writes config.json, safetensors weights and the tokenizer to `out` (idempotent). experts > 0:
    a Mixtral (mixture of experts, 2 routed per token) of the same size, each expert `intermediate` wide;
    and shared > 0: a Qwen2-MoE instead, whose every token also runs a shared expert `shared` wide."""
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
    if experts and shared:
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
