"""What spec.strategy changes in the pods (the runtime's vllm_hybrid/strategies/ decides the rest). Pure.

offload runs the gpu stages only: each cpu stage's layers sit in the host RAM of a gpu stage and are
streamed to its GPU, which computes them. balanced runs every stage and each cpu stage keeps its layers,
but splits every matrix product row-wise with a GEMM helper that a gpu stage's launcher starts in its pod:
the CPU computes some rows from its DRAM while the helper streams the others to its GPU from the same
memory (the cpu stage's weight region, handed over the replica's shared /dev/shm). coprocessor runs every
stage too, but a gpu stage computes every layer as under offload: vLLM's offloader streams the cpu stages'
layers from their weight regions (again held by the cpu pods, handed over /dev/shm), and for small decode
steps the cpu pod computes part of each of those products from the same memory; its pod holds no KV cache.
experts (a mixture of experts) runs both of its stages: the gpu stage computes every layer and keeps the routed
experts its GPU holds; the others live once in the cpu pod's region (handed over /dev/shm), which computes them
for small decode steps while larger steps stream them to the GPU; its pod holds no KV cache either.
So only under offload does the gpu stage's pod hold the cpu stages' weights; balanced, coprocessor and experts
keep one copy, in the cpu pod. pipeline runs every stage on its own. auto lets the runtime pick a strategy from
the model size, which the operator never reads, so auto renders every stage like pipeline (if the runtime
then picks offload, the cpu-stage pods stay up idle).
"""
from __future__ import annotations

from typing import Any

# Strategies under which a gpu stage streams cpu stages' weights from host RAM to its GPU (experts: the experts
# held in the cpu pod, for steps above the server's rows).
STREAMING_STRATEGIES = ("offload", "balanced", "coprocessor", "experts")


def running_stages(spec: dict[str, Any]) -> list[int]:
    """Indexes of the stages that get pods (a StatefulSet), in pipeline order. `spec` carries defaults."""
    stages = spec["stages"]
    if spec["strategy"] != "offload":
        return list(range(len(stages)))
    return [i for i, s in enumerate(stages) if s["device"] == "gpu"]


def streaming_gpu_stage(stages: list[dict[str, Any]], index: int) -> int:
    """The gpu stage that streams cpu stage `index`'s weights (offload, coprocessor: its layers; balanced:
    its GEMM helper; experts: the experts it holds): the nearest one before it, else the first (the runtime's
    rule: layers stay contiguous)."""
    gpus = [i for i, s in enumerate(stages) if s["device"] == "gpu"]
    return max((i for i in gpus if i < index), default=min(gpus))


def streamed_stages(spec: dict[str, Any], index: int) -> list[int]:
    """The cpu stages whose weights gpu stage `index` streams to its GPU (offload: from its own host RAM;
    balanced, coprocessor, experts: from the cpu stage's; none for pipeline and auto, and none for a cpu stage
    `index`)."""
    stages = spec["stages"]
    if spec["strategy"] not in STREAMING_STRATEGIES or stages[index]["device"] != "gpu":
        return []
    return [i for i, s in enumerate(stages) if s["device"] == "cpu" and streaming_gpu_stage(stages, i) == index]


def offloaded_stages(spec: dict[str, Any], index: int) -> list[int]:
    """The cpu stages whose layers (and weights, in its pod's host RAM) gpu stage `index` holds: offload
    only (balanced leaves every layer and its weights on its cpu stage and moves only GEMM rows; coprocessor
    computes them on the gpu stage, but from the weights that stay in the cpu pod; experts, the experts it holds)."""
    return streamed_stages(spec, index) if spec["strategy"] == "offload" else []


def running_layers(spec: dict[str, Any]) -> list[int | None]:
    """Layers each running stage computes (offload: its own plus the offloaded ones); None when unset.
    Under coprocessor a cpu stage's count is the layers whose weights it holds and helps compute; under experts the
    runtime holds that many layers' worth of experts there (evenly spread) unless the gpu stage states gpuMemory."""
    stages = spec["stages"]
    if not stages or not all("layers" in s for s in stages):
        return [None] * len(running_stages(spec))
    return [stages[i]["layers"] + sum(stages[j]["layers"] for j in offloaded_stages(spec, i))
            for i in running_stages(spec)]
