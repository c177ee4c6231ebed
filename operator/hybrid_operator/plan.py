"""spec -> the runtime's plan.yaml (docs/plan-format.md): snake_case, one file for every stage."""
from __future__ import annotations

import hashlib
import posixpath
from typing import Any

import yaml

from .defaults import with_defaults
from .settings import MASTER_PORT, SUPERVISOR_PORT
from .strategy import running_layers, running_stages

MODEL_MOUNT = "/models"
WORKLOAD_KEYS = {"concurrency": "expected_concurrency", "promptTokens": "expected_prompt_tokens",
                 "outputTokens": "expected_output_tokens"}
HARDWARE_KEYS = {"dramGBs": "dram_gbs", "cpuTokenSpeed": "cpu_token_speed"}


def model_location(model: dict[str, Any]) -> str:
    """Local directory inside the pod, or the HF repo id."""
    if "repo" in model:
        return model["repo"]
    return posixpath.normpath(posixpath.join(MODEL_MOUNT, model["path"]))


def served_model_name(model: dict[str, Any]) -> str:
    if model.get("servedModelName"):
        return model["servedModelName"]
    return posixpath.basename(model_location(model).rstrip("/")) or "model"


def _stage(stage: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": stage["name"], "device": stage["device"],
                           "tensor_parallel": stage["tensorParallel"]}
    if "layers" in stage:
        out["layers"] = stage["layers"]
    if stage["device"] == "gpu":
        out["gpu_memory_utilization"] = stage.get("gpuMemoryUtilization", 0.9)
        if "gpuMemory" in stage:
            out["memory"] = stage["gpuMemory"]  # memory of ONE GPU, for the runtime's planner
    else:
        # Same values as the pod's Guaranteed requests/limits, so the runtime sizes the KV cache to fit.
        out["cpus"] = stage["cpus"]
        out["memory"] = stage["memory"]
    return out


def render_plan(spec: dict[str, Any]) -> dict[str, Any]:
    spec = with_defaults(spec)
    model, serving = spec["model"], spec["serving"]
    plan = {
        "model": model_location(model),
        "revision": model.get("revision"),
        "served_model_name": served_model_name(model),
        "dtype": model["dtype"],
        "max_model_len": model["maxModelLen"],
        "block_size": serving["blockSize"],
        "max_num_seqs": serving["maxNumSeqs"],
        # vLLM needs >= max_model_len without chunked prefill; the plan always states it explicitly.
        "max_num_batched_tokens": serving.get(
            "maxNumBatchedTokens", max(model["maxModelLen"], serving["maxNumSeqs"])),
        "api_port": serving["port"],
        "master_port": MASTER_PORT,
        "supervisor_port": SUPERVISOR_PORT,
        "metrics_port": spec["monitoring"]["port"],
        "load_format": model["loadFormat"],
        "strategy": spec["strategy"],
        "extra_args": list(serving["extraArgs"]),
        "stages": [_stage(s) for s in spec["stages"]],
    }
    # Only what the user stated: the runtime's cost model has its own defaults for the rest.
    for key, plan_key in WORKLOAD_KEYS.items():
        if key in spec.get("workload", {}):
            plan[plan_key] = spec["workload"][key]
    if hardware := {plan_key: spec["hardware"][key] for key, plan_key in HARDWARE_KEYS.items() if key in spec.get("hardware", {})}:
        plan["hardware"] = hardware
    if "stallTimeoutSeconds" in serving:
        plan["stall_timeout"] = serving["stallTimeoutSeconds"]
    return plan


def plan_yaml(spec: dict[str, Any]) -> str:
    return yaml.safe_dump(render_plan(spec), sort_keys=False)


def plan_hash(spec: dict[str, Any]) -> str:
    """Goes into the pod template so a plan change rolls every stage."""
    return hashlib.sha256(plan_yaml(spec).encode()).hexdigest()[:16]


def layer_ranges(spec: dict[str, Any]) -> list[str]:
    """Per running stage 'first-last' when layers are explicit, else 'auto' (the runtime decides)."""
    out, first = [], 0
    for n in running_layers(with_defaults(spec)):
        if n is None:
            out.append("auto")
            continue
        out.append(f"{first}-{first + n - 1}")
        first += n
    return out


def stages_summary(spec: dict[str, Any]) -> str:
    """Printer column over the running stages, e.g. 'gpu:16 cpu:16', 'gpu:auto cpu:auto', 'gpu:32' (offload)."""
    spec = with_defaults(spec)
    return " ".join(f"{spec['stages'][i]['name']}:{'auto' if n is None else n}"
                    for i, n in zip(running_stages(spec), running_layers(spec)))
