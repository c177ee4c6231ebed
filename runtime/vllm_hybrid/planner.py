"""Layer-split planner: how many decoder layers each stage holds so weights + KV cache fit.

Deterministic (a pure function of the plan and the model's config.json), so every pod of a
pipeline computes the same split without talking to the others.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from .formats import WeightFormat, plain, weight_format
from .plan import Plan, PlanError, Stage

GiB = 1 << 30
# Decoder-only architectures whose layers vLLM can split by VLLM_PP_LAYER_PARTITION, each layer fused qkv + o
# attention with a KV cache, a gated MLP (or mixture of experts) and its norms, as vLLM 0.26 builds it
# (vllm/model_executor/models/<module>.py): what each adds to that layout is in _layout below, and
# tests/runtime/test_architectures.py checks every one against the layers vLLM itself builds.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
    "GraniteForCausalLM", "InternLM2ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
}
_LINEAR_ATTENTION = ("vLLM 0.26 runs it as a hybrid whose linear-attention (Gated DeltaNet) layers keep a fixed-size "
                     "recurrent state instead of a KV cache, which the planner does not size")
# Architectures that look like ones above but that vLLM runs differently: refused by name, with why.
REFUSED_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": _LINEAR_ATTENTION, "Qwen3_5ForConditionalGeneration": _LINEAR_ATTENTION,
    "Qwen3_5MoeForConditionalGeneration": _LINEAR_ATTENTION, "Qwen3NextForCausalLM": _LINEAR_ATTENTION,
    "GraniteMoeHybridForCausalLM": ("vLLM 0.26 runs it as a hybrid of Mamba-2 layers, which keep a fixed-size state "
                                    "instead of a KV cache, and attention layers, which the planner does not size"),
}
# Mixture of experts in every layer: config keys of the expert count, of the experts each token is routed to, of a
# routed expert's width, and of the shared expert's width (every token; None: it has none, an absent key: 0).
MOE_EXPERTS_KEY = {"MixtralForCausalLM": ("num_local_experts", "num_experts_per_tok", "intermediate_size", None),
                   "Qwen2MoeForCausalLM": ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                           "shared_expert_intermediate_size"),
                   "Qwen3MoeForCausalLM": ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                           "shared_expert_intermediate_size"),
                   "GptOssForCausalLM": ("num_local_experts", "num_experts_per_tok", "intermediate_size", None)}
# transformers' defaults (vLLM reads config.json through its config classes) for keys a config.json may leave out,
# where they are fixed numbers rather than derived from the other keys
CONFIG_DEFAULTS = {
    "MistralForCausalLM": {"num_key_value_heads": 8}, "MixtralForCausalLM": {"num_key_value_heads": 8},
    "Qwen2ForCausalLM": {"num_key_value_heads": 32}, "Qwen3ForCausalLM": {"num_key_value_heads": 32, "head_dim": 128},
    "Qwen2MoeForCausalLM": {"num_key_value_heads": 16, "shared_expert_intermediate_size": 5632},
    "Qwen3MoeForCausalLM": {"num_key_value_heads": 4},
    "Gemma2ForCausalLM": {"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True},
}
VOCAB_PADDING = 64  # vLLM pads the embedding and LM head rows to a multiple of this (vocab_parallel_embedding.py)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# Memory a stage needs beyond weights and KV: CUDA context/graphs/activations on GPU stages,
# the Python/torch runtime and compile caches on CPU stages.
GPU_RUNTIME_RESERVE = 2 * GiB
CPU_RUNTIME_RESERVE = 3 * GiB

@dataclass(frozen=True)
class ModelShape:
    architecture: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    dtype: str
    experts: int = 0  # mixture of experts: gated MLPs per layer, each `intermediate` wide, and a router
    routed: int = 0   # and how many of them each token runs
    shared: int = 0   # and a shared expert of this width that every token runs
    shared_gate: bool = False  # the shared expert's 1-wide gate (Qwen2-MoE builds it even with no shared expert)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # gate_up's and down's (dense MLPs only)
    qk_norm: bool = False   # a head_dim-wide RMSNorm of q and of k (Qwen3)
    expert_bias: bool = False  # each routed expert's gate_up and down biases, and the router's (gpt-oss)
    sinks: bool = False     # attention sinks: a logit per head (gpt-oss)
    norms: int = 2          # hidden-wide norms: before attention and MLP (Gemma-2: after each too)
    fmt: WeightFormat | None = None  # the checkpoint's quantization (formats.py); None: every weight in `dtype`

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_format(self) -> WeightFormat:
        return self.fmt or plain(self.dtype)

    def _bytes(self, rows: int, cols: int, role: str | None) -> int:
        """A weight's bytes: in the checkpoint's format where its product is quantized, else in `dtype`."""
        fmt = self.weight_format
        if role is not None and role in fmt.quantized_roles:
            return fmt.bytes(rows, cols, self.dtype_bytes)
        return rows * cols * self.dtype_bytes

    @property
    def layer_parts(self) -> list[tuple[int, int, str | None, int]]:
        """(rows, cols, product, count) of each weight of a layer as vLLM holds it: fused qkv, o, gate_up and down
        (one tensor over every expert in a mixture of experts), the norms, the biases, the router (product None:
        never quantized)."""
        h, hd, i, s = self.hidden, self.head_dim, self.intermediate, self.shared
        q_kv = (self.heads + 2 * self.kv_heads) * hd
        e, mlp = (self.experts, ("experts", "experts")) if self.experts else (1, ("gate_up", "down"))
        return ([(q_kv, h, "qkv", 1), (h, self.heads * hd, "o", 1), (e * 2 * i, h, mlp[0], 1), (e * h, i, mlp[1], 1)]
                + [(h, 1, None, self.norms)] + ([(q_kv, 1, None, 1)] if self.qkv_bias else [])
                + ([(h, 1, None, 1)] if self.o_bias else []) + ([(2 * i, 1, None, 1), (h, 1, None, 1)] if self.mlp_bias else [])
                + ([(hd, 1, None, 2)] if self.qk_norm else []) + ([(self.experts, h, None, 1)] if self.experts else [])
                + ([(e * 2 * i, 1, None, 1), (e * h, 1, None, 1), (e, 1, None, 1)] if self.expert_bias else [])
                + ([(self.heads, 1, None, 1)] if self.sinks else [])
                + ([(2 * s, h, "shared_expert", 1), (h, s, "shared_expert", 1)] if s else [])
                + ([(h, 1, None, 1)] if self.shared_gate else []))

    @property
    def layer_tensors(self) -> list[int]:
        """Elements of each weight of a layer as vLLM holds it: fused qkv, o, gate_up and down (one tensor
        over every expert in a mixture of experts, plus its router), the norms, the biases."""
        h, hd, i, e, s = self.hidden, self.head_dim, self.intermediate, max(1, self.experts), self.shared
        q_kv = (self.heads + 2 * self.kv_heads) * hd
        return ([q_kv * h, h * self.heads * hd, e * 2 * i * h, e * h * i] + [h] * self.norms
                + ([q_kv] if self.qkv_bias else []) + ([h] if self.o_bias else [])
                + ([2 * i, h] if self.mlp_bias else []) + ([hd, hd] if self.qk_norm else [])
                + ([e * h] if self.experts else []) + ([2 * s * h, h * s] if s else [])
                + ([e * 2 * i, e * h, e] if self.expert_bias else []) + ([self.heads] if self.sinks else [])
                + ([h] if self.shared_gate else []))

    @property
    def layer_bytes(self) -> int:
        return sum(count * self._bytes(rows, cols, role) for rows, cols, role, count in self.layer_parts)

    @property
    def layer_elems(self) -> int:
        """Weights of a layer (what a token multiplies, dense): the flops of a step, whatever their format."""
        return sum(self.layer_tensors)

    @property
    def expert_elems(self) -> int:
        """Weights of one expert (gate, up and down); 0 for a dense model."""
        return 3 * self.intermediate * self.hidden if self.experts else 0

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert in the checkpoint's format; 0 for a dense model."""
        if not self.experts:
            return 0
        return (self._bytes(2 * self.intermediate, self.hidden, "experts")
                + self._bytes(self.hidden, self.intermediate, "experts") + self.expert_bias_elems * self.dtype_bytes)

    @property
    def expert_bias_elems(self) -> int:
        """One routed expert's biases (gate_up's and down's), in the model's dtype; 0 where it has none."""
        return 2 * self.intermediate + self.hidden if self.expert_bias else 0

    @property
    def layer_expert_bytes(self) -> int:
        """Bytes of all a layer's experts (the 3-D weights no product split reaches); 0 for a dense model."""
        return self.experts * self.expert_bytes

    @property
    def active_layer_elems(self) -> int:
        """Weights one token multiplies in a layer: all of a dense layer, the routed experts of a MoE one."""
        return sum(self.layer_tensors) - (self.experts - self.routed) * self.expert_elems

    def expert_read_bytes(self, tokens: int) -> int:
        """Bytes of a layer's experts a step of `tokens` tokens reads: the expected distinct experts of
        `tokens` independent routings (those no token routes to stay unread)."""
        if not self.experts:
            return 0
        unread = self.experts * (1 - self.routed / self.experts) ** tokens
        return round(self.layer_expert_bytes - unread * self.expert_bytes)

    def layer_read_bytes(self, tokens: int) -> int:
        """Bytes a step of `tokens` tokens reads from a layer held in memory."""
        return self.layer_bytes - self.layer_expert_bytes + self.expert_read_bytes(tokens)

    @property
    def pinned_layer_bytes(self) -> int:
        """Host RAM a layer takes as the prefetch offloader's pinned copies: torch's pinned-memory allocator
        (CachingHostAllocator) rounds each tensor up to a power of two (a 70B layer: 1.88 GiB for 1.59)."""
        return sum(count * _power_of_two(self._bytes(rows, cols, role)) for rows, cols, role, count in self.layer_parts
                   if count)  # (a quantized weight's scales are tensors of their own: counted with it, a little over)

    @property
    def embedding_bytes(self) -> int:
        """The embedding's (and an LM head's) bytes, its rows padded as vLLM pads them."""
        return -(-self.vocab // VOCAB_PADDING) * VOCAB_PADDING * self.hidden * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of a token in a layer: every layer keeps every token's, as vLLM's full attention does (its
        sliding-window layers, Gemma-2's every other, keep only the window's: counted in full, conservative)."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


# what vLLM reads from a model directory: weights (and their index), configs, tokenizer files
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".tiktoken", ".txt")


def check_model_readable(path: Path, readable=lambda f: os.access(f, os.R_OK)) -> None:
    """vLLM reports a weight file this uid cannot read as missing, and only when it loads the weights, a minute
    into each start: refused before vLLM starts, naming the files."""
    try:
        files = sorted(f for f in path.iterdir() if f.suffix in MODEL_FILE_SUFFIXES and f.is_file())
    except PermissionError:
        files = [path]
    if denied := [f.name for f in files if not readable(str(f))]:
        more = f" and {len(denied) - 3} more" if len(denied) > 3 else ""
        raise PlanError(f"model: uid {os.getuid()} cannot read {', '.join(denied[:3])}{more} in {path}: make the "
                        "model's files readable by the pods' user (uid 1000 in the runtime images; chmod a+r)")


def read_model_config(model: str) -> dict:
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise PlanError(f"model: no config.json at {config} (missing model files? the model must be a "
                        "local directory mounted into the pod)")
    if path.is_dir():
        check_model_readable(path)
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"model: {config} is not valid JSON: {e}") from e


def _layout(arch: str, text: dict, hidden: int, heads: int) -> dict:
    """What vLLM 0.26's decoder layer of `arch` holds beyond fused qkv and o, a gated MLP and two norms, as
    ModelShape fields (from the config keys vLLM's own module reads)."""
    attention_bias = bool(text.get("attention_bias") or text.get("bias"))
    if arch in ("LlamaForCausalLM", "MistralForCausalLM"):  # llama.py's layer (mistral.py subclasses it)
        if text.get("ada_rms_norm_t_cond"):
            raise PlanError(f"model: {arch} with ada_rms_norm_t_cond (a time-conditioned MLP per layer) is not "
                            "supported: the planner does not size it")
        return {"qkv_bias": bool(text.get("qkv_bias", attention_bias)), "o_bias": attention_bias,
                "mlp_bias": bool(text.get("mlp_bias"))}
    if arch == "GraniteForCausalLM":  # the Llama layout; its multipliers hold no weights
        return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": bool(text.get("mlp_bias"))}
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):  # qkv bias always; head_dim: hidden / heads, always
        return {"qkv_bias": True, "qk_norm": arch == "Qwen2ForCausalLM" and bool(text.get("qk_norm")),
                "head_dim": hidden // heads, "shared_gate": arch == "Qwen2MoeForCausalLM"}
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        return {"qkv_bias": bool(text.get("attention_bias")), "qk_norm": True}
    if arch == "Gemma2ForCausalLM":  # norms before and after attention and MLP; its soft-capping holds no weights
        return {"qkv_bias": bool(text.get("attention_bias")), "o_bias": bool(text.get("attention_bias")), "norms": 4}
    if arch == "InternLM2ForCausalLM":  # no biases, whatever config.bias says; head_dim: hidden / heads
        return {"head_dim": hidden // heads}
    if arch == "GptOssForCausalLM":  # biases everywhere (qkv, o, experts, router), a sink per head
        return {"qkv_bias": True, "o_bias": True, "expert_bias": True, "sinks": True}
    return {}  # Mixtral: the Llama layout, experts for the MLP


def model_shape(config: dict, dtype: str = "auto") -> ModelShape:
    archs = config.get("architectures") or []
    refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and refused:
        raise PlanError(f"model: architecture {refused[0]} is not supported: {REFUSED_ARCHITECTURES[refused[0]]}")
    if arch is None:
        raise PlanError(f"model: unsupported architecture {archs or 'unknown'}; "
                        f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    text = {**CONFIG_DEFAULTS.get(arch, {}), **config.get("text_config", config)}
    if dtype == "auto":
        dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16").replace("torch.", "")
        # vLLM's auto dtype runs a float32 checkpoint in the platform's 16-bit type (bf16 on CPUs and GPUs of sm80+)
        dtype = "bfloat16" if dtype in ("float32", "float") else dtype
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype: cannot size weights of dtype {dtype!r}")
    try:
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        moe = {}
        if arch in MOE_EXPERTS_KEY:
            experts, routed, width, shared = MOE_EXPERTS_KEY[arch]
            if int(text.get("decoder_sparse_step", 1)) != 1 or text.get("mlp_only_layers"):
                raise PlanError(f"model: {arch} with dense MLP layers between its MoE ones (decoder_sparse_step, "
                                "mlp_only_layers) is not supported: every layer must be a mixture of experts")
            shared = int(text.get(shared) or 0) if shared else 0
            # transformers 5 writes Qwen-MoE's num_experts by its alias num_local_experts (both read the same)
            count = text[experts if experts in text or "num_local_experts" not in text else "num_local_experts"]
            moe = {"experts": int(count), "routed": int(text[routed]), "intermediate": int(text[width]),
                   "shared": shared, "shared_gate": shared > 0}
        layout = {"intermediate": moe.get("intermediate") or int(text["intermediate_size"]),
                  "head_dim": int(text.get("head_dim") or hidden // heads), **moe, **_layout(arch, text, hidden, heads)}
        return ModelShape(
            architecture=arch, num_layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads), vocab=int(text["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            dtype=dtype, fmt=weight_format(config, dtype), **layout)
    except KeyError as e:
        raise PlanError(f"model: config.json lacks {e.args[0]}") from e


class BudgetRules:
    """What a strategy takes of each stage's budget (split_layers asks these; strategies.base.Strategy extends
    them): by default each stage holds its layers and their KV cache, nothing beside vLLM."""
    gpu_buffer_layers = 0  # >0: the gpu stages compute the cpu stages' layers, streaming them through this many buffers

    def beside_vllm_bytes(self, plan: Plan, shape: ModelShape, gpu: int) -> int:
        """GPU memory gpu stage `gpu` needs beside vLLM (its sidecar's)."""
        return 0

    def cpu_layer_bytes(self, shape: ModelShape, per_layer: int) -> int:
        """A cpu stage's budget per layer as the planner fills it (per_layer: its weights and minimum KV)."""
        return per_layer

    def streamed_layer_bytes(self, shape: ModelShape) -> int:
        """A streamed layer's weights in its cpu stage's budget (gpu_buffer_layers > 0)."""
        return shape.layer_bytes



PLAIN = BudgetRules()  # pipeline's: no stage streams or runs anything beside vLLM


@dataclass(frozen=True)
class StagePlan:
    stage: Stage
    index: int
    first_layer: int
    layers: int
    weight_bytes: int
    budget_bytes: int
    kv_bytes: int
    kv_tokens: int
    beside_vllm_bytes: int = 0  # gpu stages: what takes GPU memory outside vLLM (a strategy's sidecar)
    gpu_memory_bytes: int | None = None  # of one GPU, where known
    fit_checked: bool = True  # False: a gpu stage of explicit layers whose GPU memory is unknown here

    @property
    def gpu_memory_utilization(self) -> float:
        """What vLLM may take of each GPU: the stage's share less what runs beside it."""
        gmu = self.stage.gpu_memory_utilization
        if self.beside_vllm_bytes and self.gpu_memory_bytes:
            gmu -= self.beside_vllm_bytes / self.stage.tensor_parallel / self.gpu_memory_bytes
        return round(gmu, 4)

    @property
    def layer_range(self) -> str:
        return f"{self.first_layer}-{self.first_layer + self.layers - 1}"


@dataclass(frozen=True)
class Split:
    shape: ModelShape
    stages: tuple[StagePlan, ...]

    @property
    def partition(self) -> str:
        """The value of VLLM_PP_LAYER_PARTITION."""
        return ",".join(str(s.layers) for s in self.stages)

    def model_line(self) -> str:
        shape = self.shape
        moe = f", {shape.experts} experts" if shape.experts else ""
        return (f"model: {shape.architecture}{moe}, {shape.num_layers} layers, {shape.weight_format.describe(shape.dtype)}, "
                f"{shape.layer_bytes / GiB:.3f} GiB/layer, embedding {shape.embedding_bytes / GiB:.3f} GiB, "
                f"KV {shape.kv_bytes_per_token_per_layer} B/token/layer")

    def describe(self) -> str:
        rows = [self.model_line()]
        for sp in self.stages:
            rows.append(f"stage {sp.index} {sp.stage.name} ({sp.stage.device}, tp={sp.stage.tensor_parallel}): "
                        f"layers {sp.layer_range} ({sp.layers}); weights {sp.weight_bytes / GiB:.2f} GiB"
                        + (f" + KV {sp.kv_bytes / GiB:.2f} GiB ({sp.kv_tokens} tokens) of budget "
                           f"{sp.budget_bytes / GiB:.2f} GiB" if sp.fit_checked else
                           "; fit NOT checked: the GPU's memory is unknown (give the stage's memory or --gpu-memory; "
                           "`serve` checks it against the GPU it runs on)")
                        + (f"; GEMM helper {sp.beside_vllm_bytes / GiB:.2f} GiB beside vLLM, which gets "
                           f"gpu_memory_utilization {sp.gpu_memory_utilization}" if sp.beside_vllm_bytes else ""))
        rows.append(f"VLLM_PP_LAYER_PARTITION={self.partition}")
        return "\n".join(rows)


def stage_budget(stage: Stage, gpu_memory_bytes: int | None) -> int:
    """Bytes a stage may use for weights + KV cache (all its tensor-parallel ranks together)."""
    if stage.is_cpu:
        return stage.memory_bytes - CPU_RUNTIME_RESERVE
    gpu_memory_bytes = stage.memory_bytes or gpu_memory_bytes
    if gpu_memory_bytes is None:
        raise PlanError(f"stage {stage.name}: the planner needs the memory of one GPU (the stage's "
                        "memory, or --gpu-memory) or explicit layers on every stage")
    per_rank = int(gpu_memory_bytes * stage.gpu_memory_utilization) - GPU_RUNTIME_RESERVE
    return per_rank * stage.tensor_parallel


def _budget_note(stage: Stage, gpu_memory_bytes: int | None = None) -> str:
    if stage.is_cpu:
        return f"memory {stage.memory_bytes / GiB:.2f} GiB minus {CPU_RUNTIME_RESERVE / GiB:.0f} GiB for the runtime"
    gpu = stage.memory_bytes or gpu_memory_bytes
    return (f"gpu_memory_utilization {stage.gpu_memory_utilization} of each GPU"
            + (f" ({gpu / GiB:.2f} GiB)" if gpu else "") + f" minus {GPU_RUNTIME_RESERVE / GiB:.0f} GiB per GPU for the runtime")


# vLLM 0.26's models of these build the embedding and the LM head on every pipeline rank, not only the first and last
# (models/{mixtral,qwen2_moe,qwen3_moe,gpt_oss,gemma2,internlm2}.py: no is_first_rank / is_last_rank test): a Qwen3-235B
# stage held 1.16 GiB more than planned, and a GPU stage planned to its budget had no room left for its KV cache
ENDS_ON_EVERY_STAGE = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                       "Gemma2ForCausalLM", "InternLM2ForCausalLM"}


def _fixed_bytes(shape: ModelShape, index: int, n: int) -> int:
    """Embedding on the first stage; final norm + LM head on the last (a copy where tied, unless one stage holds
    both: then the LM head is the embedding). Both on every stage for ENDS_ON_EVERY_STAGE."""
    if shape.architecture in ENDS_ON_EVERY_STAGE:
        return shape.hidden * shape.dtype_bytes + shape.embedding_bytes * (1 if shape.tied_embeddings else 2)
    fixed = shape.embedding_bytes if index == 0 else 0
    if index == n - 1:
        fixed += shape.hidden * shape.dtype_bytes + (0 if shape.tied_embeddings and n == 1 else shape.embedding_bytes)
    return fixed


def split_layers(plan: Plan, shape: ModelShape, gpu_memory_bytes: int | None = None,
                 strat: BudgetRules = PLAIN) -> Split:
    """Layers per stage so that each stage's weights + KV fit its budget under a strategy's budget rules: a gpu
    stage that streams cpu stages' layers also holds their KV, the LM head and its buffers; one that runs a sidecar
    leaves it room."""
    n, total = len(plan.stages), shape.num_layers
    # Every stage must hold KV for at least one full-length sequence.
    min_kv_per_layer = shape.kv_bytes_per_token_per_layer * plan.max_model_len
    per_layer = shape.layer_bytes + min_kv_per_layer
    gpus = [i for i, s in enumerate(plan.stages) if not s.is_cpu]
    beside = [strat.beside_vllm_bytes(plan, shape, i) if i in gpus else 0 for i in range(n)]
    if plan.layers_explicit:
        counts = [s.layers for s in plan.stages]
        if sum(counts) != total:
            raise PlanError(f"stages[*].layers: sum to {sum(counts)}, but the model has {total} layers")
        budgets = [stage_budget(s, gpu_memory_bytes) - beside[i] if (s.is_cpu or s.memory_bytes or gpu_memory_bytes)
                   else None for i, s in enumerate(plan.stages)]
    else:
        if total < n:
            raise PlanError(f"stages: {n} stages but the model has only {total} layers")
        budgets = [stage_budget(s, gpu_memory_bytes) - beside[i] for i, s in enumerate(plan.stages)]
        host_layer = [strat.cpu_layer_bytes(shape, per_layer) if s.is_cpu else per_layer for s in plan.stages]
        capacity = [max(0, (b - _fixed_bytes(shape, i, n)) // host_layer[i]) for i, b in enumerate(budgets)]
        if strat.gpu_buffer_layers and gpus and len(gpus) < n:
            # beside its own layers' weights: every layer it may serve's KV, both ends, the streaming buffers
            reserved = (2 * shape.embedding_bytes + (total - len(gpus) + 1) * min_kv_per_layer
                        + strat.gpu_buffer_layers * shape.layer_bytes)
            for g in gpus:
                capacity[g] = max(0, (budgets[g] - reserved) // shape.layer_bytes)
        counts = _assign(plan.stages, capacity, total)
    stages = []
    first = 0
    for i, (s, count, budget) in enumerate(zip(plan.stages, counts, budgets)):
        # a streamed cpu stage's layers are weights only: their KV lives on the GPU that computes them
        streamed = s.is_cpu and strat.gpu_buffer_layers > 0 and bool(gpus)
        layer = strat.streamed_layer_bytes(shape) if streamed else shape.layer_bytes
        weights = count * layer + _fixed_bytes(shape, i, n)
        kv_floor = 0 if streamed else count * min_kv_per_layer
        need = weights + kv_floor
        if budget is not None and need > budget:
            raise PlanError(
                f"stages[{i}] ({s.name}): does not fit: {count} layers need {need / GiB:.2f} GiB "
                f"(weights {weights / GiB:.2f} GiB + KV for one {plan.max_model_len}-token sequence "
                f"{kv_floor / GiB:.2f} GiB) but the budget is {budget / GiB:.2f} GiB ({_budget_note(s, gpu_memory_bytes)})")
        kv = 0 if budget is None or streamed else budget - weights
        stages.append(StagePlan(s, i, first, count, weights, budget or 0, kv,
                                kv // (count * shape.kv_bytes_per_token_per_layer), beside[i],
                                None if s.is_cpu else (s.memory_bytes or gpu_memory_bytes), budget is not None))
        first += count
    return Split(shape, tuple(stages))


def check_gpu_fit(plan: Plan, shape: ModelShape, stage: int, gpu_memory_bytes: int,
                  strat: BudgetRules = PLAIN) -> StagePlan:
    """Gpu stage `stage` of explicit layers whose plan gives no GPU memory, checked against the memory of the GPU
    it runs on (the split itself does not need it, and every pod must compute the same split: a check only).
    Raises the planner's "does not fit" PlanError."""
    stages = tuple(replace(s, memory_bytes=gpu_memory_bytes) if i == stage else s for i, s in enumerate(plan.stages))
    return split_layers(replace(plan, stages=stages), shape, None, strat).stages[stage]


def _assign(stages: tuple[Stage, ...], capacity: list[int], total: int) -> list[int]:
    """GPU stages first, as many layers as fit; CPU stages share the rest by their CPU count."""
    n = len(stages)
    if sum(capacity) < total or min(capacity) < 1:
        short = [f"{s.name} fits {c}" for s, c in zip(stages, capacity)]
        raise PlanError(f"stages: the model does not fit: {total} layers, capacity {sum(capacity)} "
                        f"({', '.join(short)}); add memory or stages")
    counts = [1] * n  # vLLM needs at least one layer on every pipeline stage
    left = total - n
    gpus = [i for i, s in enumerate(stages) if not s.is_cpu]
    cpus = [i for i, s in enumerate(stages) if s.is_cpu]
    for i in gpus if cpus else []:
        take = min(left, capacity[i] - counts[i])
        counts[i] += take
        left -= take
    pool = cpus or gpus
    weights = [stages[i].cpus if stages[i].is_cpu else capacity[i] for i in pool]
    while left > 0:  # hand out one layer at a time: deterministic, proportional, capacity-bounded
        open_ = [(counts[i] / w, k, i) for k, (i, w) in enumerate(zip(pool, weights)) if counts[i] < capacity[i]]
        _, _, i = min(open_)
        counts[i] += 1
        left -= 1
    return counts
