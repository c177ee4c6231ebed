"""The weight format of a checkpoint, read from its config.json's quantization_config: what one weight of a
quantized linear layer takes in memory, and which of a layer's products are quantized. The planner sizes layers by
it; the strategies take or refuse a checkpoint by it (Strategy.refused_model). Pure."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .plan import PlanError

# the roles of a decoder layer's products: the module names vLLM checks an ignore list against, as the fused layer it
# builds (AWQ/GPTQ: substrings of its prefix) and as the checkpoint's own modules (compressed-tensors, fp8: each shard)
ROLES = {"qkv": (("self_attn.qkv_proj",), ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
         "o": (("self_attn.o_proj",), ("self_attn.o_proj",)),
         "gate_up": (("mlp.gate_up_proj",), ("mlp.gate_proj", "mlp.up_proj")),
         "down": (("mlp.down_proj",), ("mlp.down_proj",)),
         "experts": (("mlp.experts",), ("mlp.experts.0.gate_proj", "mlp.experts.0.up_proj", "mlp.experts.0.down_proj",
                                         "block_sparse_moe.experts.0.w1", "block_sparse_moe.experts.0.w2")),
         "shared_expert": (("mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj"),
                           ("mlp.shared_expert.gate_proj", "mlp.shared_expert.down_proj"))}


@dataclass(frozen=True)
class WeightFormat:
    name: str                  # what the support table and `vllm-hybrid plan` call it
    method: str = ""           # quantization_config.quant_method ("" unquantized)
    bits: int = 0              # of a quantized weight (0: the model's dtype)
    group: int = 0             # weights along K per scale (0: one per output row or block)
    block: int = 0             # FP8 block-wise: a scale per block x block weights
    scale_bytes: int = 0       # of one scale
    zero_bits: int = 0         # of one zero point (asymmetric formats), per group
    quantized_roles: frozenset[str] = frozenset()  # the layer's products held in this format (the rest: dtype)
    detail: str = ""           # how the checkpoint departs from its format's preset ("": the preset itself)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def bytes(self, rows: int, cols: int, dtype_bytes: int) -> int:
        """Bytes vLLM holds for a rows x cols weight in this format: the packed weight, its scales and zero points
        (the checkpoint's layout; a CPU kernel's repacking keeps the bytes)."""
        if not self.quantized:
            return rows * cols * dtype_bytes
        packed = rows * cols * self.bits // 8
        if self.block:
            scales = -(-rows // self.block) * -(-cols // self.block)
        elif self.group:
            scales = rows * -(-cols // self.group)
        else:
            scales = rows
        return packed + scales * self.scale_bytes + -(-scales * self.zero_bits // 8)

    def describe(self, dtype: str) -> str:
        return f"{self.name}, {dtype} elsewhere" if self.quantized else dtype


def plain(dtype: str) -> WeightFormat:
    return WeightFormat(dtype)


def weight_format(config: dict, dtype: str) -> WeightFormat:
    """The checkpoint's format from its quantization_config (none: its dtype); PlanError naming the method or scheme
    the planner cannot size."""
    q = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not q:
        return plain(dtype)
    method = str(q.get("quant_method") or "")
    if method == "fp8":
        block = q.get("weight_block_size")
        if block and list(block) != [128, 128]:
            raise PlanError(f"model: quantization_config fp8 with weight_block_size {block}: only 128x128 blocks "
                            "are sized (the CPU kernels take those)")
        fmt = (WeightFormat("FP8 block-128", method, 8, block=128, scale_bytes=4) if block
               else WeightFormat("FP8 per-tensor", method, 8, scale_bytes=4))
        return _with_roles(fmt, q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
    if method in ("gptq", "awq"):
        bits, group = int(q.get("bits", 4)), int(q.get("group_size", 128))
        if bits != 4:
            raise PlanError(f"model: quantization_config {method} with {bits}-bit weights: only 4-bit is sized")
        # GPTQ stores zero points as well (packed int32) even when symmetric; AWQ is asymmetric
        order = " act-order" if method == "gptq" and q.get("desc_act") else ""  # inputs permuted: g_idx used
        fmt = WeightFormat(f"W4A16 {method.upper()} group {group}{order}", method, 4, group=max(group, 0),
                           scale_bytes=2, zero_bits=4)
        fmt = _with_roles(fmt, q.get("modules_to_not_convert") or [], substring=True)
        if method == "gptq" and (listed := q.get("modules_in_block_to_quantize")):
            # only the modules it lists (vLLM: substrings of a shard's name); a MoE layer's experts always
            names = [m for group in listed for m in (group if isinstance(group, list) else [group])]
            roles = {role for role, (_, shards) in ROLES.items()
                     if role == "experts" or any(n in f"model.layers.0.{s}" for s in shards for n in names)}
            fmt = WeightFormat(**{**fmt.__dict__, "quantized_roles": fmt.quantized_roles & roles})
        # (where a GPTQ config lists nothing, vLLM reads which modules are quantized off the weights' dtypes: the
        # planner counts every product quantized, as quantizers write them)
        return fmt
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "mxfp4":  # gpt-oss's own: the routed experts only (vLLM's Mxfp4Config leaves linear layers unquantized)
        return WeightFormat("MXFP4", method, 4, group=32, scale_bytes=1, quantized_roles=frozenset({"experts"}))
    if method:
        raise PlanError(f"model: quantization_config quant_method {method!r} is not supported (the planner sizes "
                        "fp8, gptq, awq, mxfp4 and compressed-tensors checkpoints)")
    raise PlanError("model: quantization_config without a quant_method")


def _compressed_tensors(q: dict) -> WeightFormat:
    groups = list((q.get("config_groups") or {}).values())
    schemes = {_ct_scheme(g.get("weights") or {}, g.get("input_activations")) for g in groups}
    if len(schemes) != 1:
        raise PlanError(f"model: compressed-tensors with {len(schemes) or 'no'} weight schemes "
                        f"({', '.join(sorted(s.name for s in schemes)) or 'none'}): one scheme for every layer is "
                        "sized")
    return _with_roles(schemes.pop(), q.get("ignore") or [])


def _ct_scheme(w: dict, acts: dict | None) -> WeightFormat:
    bits, kind, strategy = int(w.get("num_bits", 0)), w.get("type", "int"), w.get("strategy", "tensor")
    group = int(w.get("group_size") or 0)
    where = "compressed-tensors"
    if kind == "float" and bits == 8:
        if strategy == "block":
            if list(w.get("block_structure") or []) != [128, 128]:
                raise PlanError(f"model: compressed-tensors FP8 blocks {w.get('block_structure')}: only 128x128 "
                                "blocks are sized")
            return WeightFormat("FP8 block-128", where, 8, block=128, scale_bytes=4)
        return WeightFormat(f"FP8 per-{strategy}", where, 8, scale_bytes=4)
    if kind == "int" and bits == 4 and acts is None:
        zero = 0 if w.get("symmetric", True) else 4
        return WeightFormat(f"W4A16 compressed-tensors group {group}" if group else "W4A16 compressed-tensors",
                            where, 4, group=group, scale_bytes=2, zero_bits=zero)
    if kind == "int" and bits == 8 and acts is not None:
        return WeightFormat("W8A8 INT8", where, 8, scale_bytes=4, detail=_w8a8_detail(w, acts))
    if kind == "float" and bits == 4:
        raise PlanError("model: compressed-tensors FP4 (NVFP4/MXFP4) weights are not supported")
    raise PlanError(f"model: compressed-tensors {kind}{bits} weights ({strategy}"
                    f"{', activations ' + str(acts.get('type')) + str(acts.get('num_bits')) if acts else ''}) "
                    "are not supported")


def _w8a8_detail(w: dict, acts: dict) -> str:
    """What sets a W8A8 INT8 scheme apart from compressed-tensors' W8A8 preset (weights with a scale per output row,
    activations quantized per token at run time, symmetric): sizes alike, but not every kernel computes it."""
    parts = [] if w.get("strategy", "tensor") == "channel" else [f"a weight scale per {w.get('strategy', 'tensor')}"]
    if not acts.get("dynamic", False):
        parts.append(f"static activation scales (per {acts.get('strategy', 'tensor')})")
    elif acts.get("strategy", "tensor") != "token":
        parts.append(f"activations quantized per {acts.get('strategy', 'tensor')}")
    if not acts.get("symmetric", True):
        parts.append("asymmetric activations")
    return ", ".join(parts)


def _with_roles(fmt: WeightFormat, ignore: list[str], substring: bool = False) -> WeightFormat:
    """The layer's products in the format: every one but those an ignore list names (a router, often; a layer's
    attention, sometimes), matched as vLLM matches that method's list: compressed-tensors and fp8 by name or `re:`
    pattern, AWQ/GPTQ's modules_to_not_convert as substrings of the module's name. A product ignored in one layer
    counts as unquantized in all (conservative)."""
    def ignored(module: str) -> bool:
        for pattern in ignore:
            if substring:
                if pattern in module:
                    return True
            elif pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.split(".", 3)[-1] == re.sub(r"^.*?layers\.\d+\.", "", pattern):
                return True
        return False
    roles = frozenset(role for role, (fused, shards) in ROLES.items()
                      if not any(ignored(f"model.layers.0.{name}") for name in (fused if substring else shards)))
    return WeightFormat(**{**fmt.__dict__, "quantized_roles": roles})


def cpu_refusal(fmt: WeightFormat, dtype: str, cpu_flags: set[str]) -> str | None:
    """Why vLLM 0.26's CPU build cannot compute a CPU stage's layers in this format and dtype on a CPU with these
    flags (/proc/cpuinfo); None: it can (its kernels: vllm/model_executor/kernels/linear/{scaled_mm,mixed_precision}/
    cpu.py; per-channel FP8 runs ChannelWiseTorchFP8ScaledMM, or on AMX our vllm_patches.cpu_fp8, INT8 CPUInt8ScaledMM,
    W4A16 CPUWNA16)."""
    if fmt.name == "FP8 block-128" and "amx_tile" not in cpu_flags:
        return ("FP8 block-128 weights on a CPU stage need AMX (vLLM 0.26's CPU FP8 kernel, CPUFp8BlockScaledMMKernel: "
                "Sapphire Rapids or newer), which this node's CPU lacks")
    if fmt.name.startswith("W4A16") and dtype not in ("bfloat16", "float16", "half"):
        return (f"{fmt.name} weights on a CPU stage need dtype bfloat16 or float16 (vLLM 0.26's CPU int4 kernel, "
                f"cpu_gemm_wna16, has no {dtype})")
    return None


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path) as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()
