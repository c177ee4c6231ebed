"""What spec.strategy changes in the pods (the runtime's vllm_hybrid/strategy.py decides the rest). Pure.

offload runs the gpu stages only: each cpu stage's layers sit in the host RAM of a gpu stage and are
streamed to its GPU. pipeline and balanced run every stage. auto lets the runtime pick one of the three
from the model size, which the operator never reads, so auto renders every stage like pipeline (if the
runtime then picks offload, the cpu-stage pods stay up idle).
"""
from __future__ import annotations

from typing import Any


def running_stages(spec: dict[str, Any]) -> list[int]:
    """Indexes of the stages that get pods (a StatefulSet), in pipeline order. `spec` carries defaults."""
    stages = spec["stages"]
    if spec["strategy"] != "offload":
        return list(range(len(stages)))
    return [i for i, s in enumerate(stages) if s["device"] == "gpu"]


def offload_target(stages: list[dict[str, Any]], index: int) -> int:
    """The gpu stage holding cpu stage `index`'s layers under offload: the nearest one before it, else
    the first (the runtime's choice in vllm_hybrid.strategy.layout: layers stay contiguous)."""
    gpus = [i for i, s in enumerate(stages) if s["device"] == "gpu"]
    return max((i for i in gpus if i < index), default=min(gpus))


def offloaded_stages(spec: dict[str, Any], index: int) -> list[int]:
    """The cpu stages whose layers gpu stage `index` streams under offload (none for other strategies)."""
    stages = spec["stages"]
    if spec["strategy"] != "offload" or stages[index]["device"] != "gpu":
        return []
    return [i for i, s in enumerate(stages) if s["device"] == "cpu" and offload_target(stages, i) == index]


def running_layers(spec: dict[str, Any]) -> list[int | None]:
    """Layers each running stage computes (offload: its own plus the streamed ones); None when unset."""
    stages = spec["stages"]
    if not stages or not all("layers" in s for s in stages):
        return [None] * len(running_stages(spec))
    return [stages[i]["layers"] + sum(stages[j]["layers"] for j in offloaded_stages(spec, i))
            for i in running_stages(spec)]
