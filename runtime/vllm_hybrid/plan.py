"""The pipeline plan: one file, read identically by every stage (and rendered by the operator)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .quantity import to_bytes

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
DEVICES = ("gpu", "cpu")
OFFLOAD_BACKENDS = ("prefetch", "uva")  # vLLM's two weight offloaders (strategy offload)
class PlanError(ValueError):
    """A plan that cannot run; the message names the offending field."""


def parse_quantity(value: Any, field_name: str) -> int:
    """Kubernetes memory quantity ("64Gi", "500M") or a plain byte count -> bytes."""
    try:
        return to_bytes(value)
    except ValueError:
        raise PlanError(f"{field_name}: expected a memory quantity like 64Gi, got {value!r}") from None


@dataclass(frozen=True)
class Stage:
    name: str
    device: str
    tensor_parallel: int = 1
    layers: int | None = None
    gpu_memory_utilization: float = 0.9
    cpus: int | None = None
    memory_bytes: int | None = None

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class Plan:
    model: str
    stages: tuple[Stage, ...]
    served_model_name: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    max_model_len: int = 4096
    block_size: int = 128
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    api_port: int = 8000
    master_port: int = 29500
    supervisor_port: int | None = None
    metrics_port: int = 9100
    load_format: str = "auto"
    strategy: str = "pipeline"  # a name strategies.resolve knows (it checks it)
    offload_backend: str = "prefetch"  # strategy offload: vLLM's prefetch offloader, or UVA (--cpu-offload-gb)
    # the workload `strategy: auto` plans for (None: see strategies.cost.Workload's defaults)
    expected_concurrency: int | None = None
    expected_prompt_tokens: int | None = None
    expected_output_tokens: int | None = None
    hardware: tuple[tuple[str, float], ...] = ()  # strategies.cost.Hardware overrides: measured figures of the box
    # seconds without a finished step, requests pending, before a stage restarts (None: sized from the
    # expected step time, progress.default_timeouts; 0: never)
    stall_timeout: int | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def supervision_port(self) -> int:
        return self.supervisor_port or self.master_port + 1

    @property
    def layers_explicit(self) -> bool:
        return all(s.layers is not None for s in self.stages)


_TOP_INT = ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
            "api_port", "master_port", "supervisor_port", "metrics_port",
            "expected_concurrency", "expected_prompt_tokens", "expected_output_tokens", "stall_timeout")
_TOP_STR = ("model", "served_model_name", "revision", "dtype", "load_format", "strategy", "offload_backend")
_STAGE_KEYS = {"name", "device", "tensor_parallel", "layers", "gpu_memory_utilization", "cpus", "memory"}


def _int(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name}: expected an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise PlanError(f"{name}: must be {bound}, got {value}")
    return value


def _stage(raw: Any, i: int) -> Stage:
    where = f"stages[{i}]"
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = set(raw) - _STAGE_KEYS
    if unknown:
        raise PlanError(f"{where}.{sorted(unknown)[0]}: unknown field (known: {', '.join(sorted(_STAGE_KEYS))})")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name or ""):
        raise PlanError(f"{where}.name: expected a DNS label like 'gpu' or 'cpu-0', got {name!r}")
    device = raw.get("device")
    if device not in DEVICES:
        raise PlanError(f"{where}.device: expected one of {DEVICES}, got {device!r}")
    tp = _int(raw.get("tensor_parallel", 1), f"{where}.tensor_parallel")
    layers = raw.get("layers")
    if layers is not None:
        layers = _int(layers, f"{where}.layers")
    if device == "gpu":
        if "cpus" in raw:
            raise PlanError(f"{where}.cpus: only cpu stages take cpus; gpu stages use gpu_memory_utilization")
        gmu = raw.get("gpu_memory_utilization", 0.9)
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
            raise PlanError(f"{where}.gpu_memory_utilization: expected a number in (0, 1], got {gmu!r}")
        # memory of one GPU: lets the planner size the split without the GPU at hand (CPU pods)
        gpu_mem = parse_quantity(raw["memory"], f"{where}.memory") if "memory" in raw else None
        return Stage(name, device, tp, layers, gpu_memory_utilization=float(gmu), memory_bytes=gpu_mem)
    if "gpu_memory_utilization" in raw:
        raise PlanError(f"{where}.gpu_memory_utilization: only gpu stages take it; cpu stages use cpus and memory")
    if "cpus" not in raw or "memory" not in raw:
        missing = "cpus" if "cpus" not in raw else "memory"
        raise PlanError(f"{where}.{missing}: required for cpu stages")
    cpus = _int(raw["cpus"], f"{where}.cpus")
    memory = parse_quantity(raw["memory"], f"{where}.memory")
    return Stage(name, device, tp, layers, cpus=cpus, memory_bytes=memory)


def _hardware(raw: Any) -> tuple[tuple[str, float], ...]:
    """Measured figures of the box by name (strategies.cost.hardware_of checks the names)."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise PlanError("hardware: expected a mapping of figure names to numbers")
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise PlanError(f"hardware.{k}: expected a positive number, got {v!r}")
    return tuple(sorted((k, float(v)) for k, v in raw.items()))


def plan_from_dict(raw: Any) -> Plan:
    if not isinstance(raw, dict):
        raise PlanError(f"plan: expected a mapping at the top level, got {type(raw).__name__}")
    known = set(_TOP_INT) | set(_TOP_STR) | {"stages", "extra_args", "hardware"}
    unknown = set(raw) - known
    if unknown:
        raise PlanError(f"{sorted(unknown)[0]}: unknown field (known: {', '.join(sorted(known))})")
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise PlanError("model: required, a model directory or repository id")
    kwargs: dict[str, Any] = {}
    for key in _TOP_STR:
        if raw.get(key) is not None:
            if not isinstance(raw[key], str):
                raise PlanError(f"{key}: expected a string, got {raw[key]!r}")
            kwargs[key] = raw[key]
    for key in _TOP_INT:
        if raw.get(key) is not None:
            kwargs[key] = _int(raw[key], key, minimum=0 if key == "stall_timeout" else 1,
                               maximum=65535 if key.endswith("port") else None)
    if kwargs.get("dtype", "auto") not in DTYPES:
        raise PlanError(f"dtype: expected one of {DTYPES}, got {kwargs['dtype']!r}")
    if kwargs.get("offload_backend", "prefetch") not in OFFLOAD_BACKENDS:
        raise PlanError(f"offload_backend: expected one of {OFFLOAD_BACKENDS}, got {kwargs['offload_backend']!r}")
    if kwargs.get("block_size", 128) % 32:
        raise PlanError(f"block_size: must be a multiple of 32 (CPU attention), got {kwargs['block_size']}")
    extra = raw.get("extra_args") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise PlanError("extra_args: expected a list of strings")
    kwargs["hardware"] = _hardware(raw.get("hardware"))
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise PlanError("stages: required, a non-empty list")
    stages = tuple(_stage(s, i) for i, s in enumerate(stages_raw))
    names = [s.name for s in stages]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise PlanError(f"stages[{names.index(dup, names.index(dup) + 1)}].name: duplicate stage name {dup!r}")
    tps = {s.tensor_parallel for s in stages}
    if len(tps) > 1:
        raise PlanError(f"stages[*].tensor_parallel: must be equal on every stage (vLLM pipelines need it), got {sorted(tps)}")
    with_layers = [s.layers is not None for s in stages]
    if any(with_layers) and not all(with_layers):
        raise PlanError(f"stages[{with_layers.index(False)}].layers: give layers on every stage or on none")
    expected = kwargs.get("expected_prompt_tokens", 0) + kwargs.get("expected_output_tokens", 0)
    if expected > kwargs.get("max_model_len", 4096):
        raise PlanError(f"expected_prompt_tokens + expected_output_tokens: {expected} exceeds max_model_len")
    if kwargs.get("max_num_batched_tokens", 4096) < kwargs.get("max_num_seqs", 64):
        raise PlanError("max_num_batched_tokens: must be >= max_num_seqs")
    ports = {k: kwargs.get(k) for k in ("api_port", "master_port", "supervisor_port", "metrics_port") if kwargs.get(k)}
    plan = Plan(stages=stages, extra_args=tuple(extra), **kwargs)
    used = [plan.api_port, plan.master_port, plan.supervision_port, plan.metrics_port]
    if len(set(used)) != len(used):
        raise PlanError(f"api_port/master_port/supervisor_port/metrics_port: must differ, got {ports or used}")
    return plan


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanError(f"plan file {path}: {e.strerror}") from e
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise PlanError(f"plan file {path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from e
    return plan_from_dict(raw)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Inverse of plan_from_dict (what the operator writes into the ConfigMap)."""
    out: dict[str, Any] = {k: getattr(plan, k) for k in (*_TOP_STR, *_TOP_INT) if getattr(plan, k) is not None}
    out["extra_args"] = list(plan.extra_args)
    if plan.hardware:
        out["hardware"] = dict(plan.hardware)
    stages = []
    for s in plan.stages:
        d: dict[str, Any] = {"name": s.name, "device": s.device, "tensor_parallel": s.tensor_parallel}
        if s.layers is not None:
            d["layers"] = s.layers
        if s.is_cpu:
            d["cpus"] = s.cpus
        else:
            d["gpu_memory_utilization"] = s.gpu_memory_utilization
        if s.memory_bytes is not None:
            d["memory"] = s.memory_bytes
        stages.append(d)
    out["stages"] = stages
    return out
