"""Streaming the cpu stages' layers to a gpu stage with vLLM's offloaders, as offload does and coprocessor builds on:
which gpu stage streams which cpu stage, the layout that leaves the cpu stages out, the prefetch offloader's flags
and its cost."""
from __future__ import annotations

import math

from ..plan import Plan, Stage
from ..planner import Split
from .base import Layout
from .cost import Hardware, StageCost, Workload


def streaming_gpu(stages: tuple[Stage, ...], index: int) -> int:
    """The gpu stage serving cpu stage `index` under offload, balanced and coprocessor: the one before it
    (layers stay contiguous), else the first."""
    gpus = [i for i, s in enumerate(stages) if not s.is_cpu]
    return max((j for j in gpus if j < index), default=min(gpus))


# vLLM's prefetch offloader keeps static GPU buffers for prefetch_step (1) streamed layer
# (vllm/model_executor/offloader/prefetch.py, StaticBufferPool slot_capacity)
PREFETCH_BUFFER_LAYERS = 1
OFFLOADERS = {"prefetch": "PrefetchOffloader", "uva": "UVAOffloader"}  # plan.offload_backend -> vLLM's class


def prefetch_groups(layers: int, streamed: int) -> tuple[int, int]:
    """(--offload-group-size, --offload-num-in-group) that stream exactly `streamed` of a stage's `layers`:
    vLLM's prefetch offloader streams the last num_in_group layers of every group_size layers."""
    g = math.gcd(layers, streamed)
    return layers // g, streamed // g


def prefetch_flags(layers: int, streamed: int, step: int) -> tuple[str, ...]:
    group, in_group = prefetch_groups(layers, streamed)
    return ("--offload-group-size", str(group), "--offload-num-in-group", str(in_group),
            "--offload-prefetch-step", str(step))


def streamed_layout(plan: Plan, split: Split, name: str, servers: tuple[tuple[int, int], ...] = ()) -> Layout:
    """The gpu stages only: each computes its own layers and those of the cpu stages it streams."""
    counts, lb = [sp.layers for sp in split.stages], split.shape.layer_bytes
    everyone = range(len(counts))
    layers, streamed = dict.fromkeys(everyone, 0), dict.fromkeys(everyone, 0)
    for i in everyone:
        if not plan.stages[i].is_cpu:
            layers[i] += counts[i]
            continue
        g = streaming_gpu(plan.stages, i)
        layers[g], streamed[g] = layers[g] + counts[i], streamed[g] + counts[i] * lb
    keep = [i for i in everyone if layers[i]]
    return Layout(name, tuple(keep), tuple(layers[i] for i in keep), tuple(streamed[i] for i in keep),
                  servers=servers)


def prefetch_cost(streamed: int, work: Workload, plan: Plan, hw: Hardware) -> StageCost:
    """Streaming `streamed` bytes through vLLM's prefetch offloader: once per step, whatever its tokens."""
    stream = streamed / (hw.prefetch_pcie_gbs * 1e9)
    return StageCost(stream + work.concurrency * hw.prefetch_token_s,
                     work.chunks(plan) * stream + work.prompt * hw.prefetch_token_s)
