"""offload: GPU stages only. The CPU stages' layers stay in the GPU pod's host RAM and are streamed to the
GPU every step by vLLM's prefetch offloader (--offload-group-size: a copy stream fills static GPU buffers a
layer ahead, once per step) or, with offload_backend uva, by --cpu-offload-gb (the GPU reads host memory per
use). Both need the V1 model runner."""
from __future__ import annotations

import math

from ..plan import Plan
from ..planner import GiB, ModelShape, Split
from .base import Layout, StageExtras, Strategy, streaming_gpu
from .cost import NO_COST, Hardware, StageCost, Workload

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


class Offload(Strategy):
    name = "offload"
    gpu_buffer_layers = PREFETCH_BUFFER_LAYERS

    def cpu_layer_bytes(self, shape: ModelShape, per_layer: int) -> int:
        # its cpu stages' layers become the gpu pod's pinned copies; their KV lives on the GPU
        return shape.pinned_layer_bytes

    def streamed_layer_bytes(self, shape: ModelShape) -> int:
        return shape.pinned_layer_bytes

    def layout(self, plan, split) -> Layout:
        self.require_gpu(plan)
        return streamed_layout(plan, split, self.name)

    def stage(self, plan, split, lay, ident, env):
        rank = lay.stages.index(ident.stage)
        streamed = lay.offload_bytes[rank]
        if not streamed:
            return StageExtras()
        if plan.offload_backend == "prefetch":
            flags = prefetch_flags(lay.layers[rank], round(streamed / split.shape.layer_bytes), step=1)
        else:
            # per GPU: vLLM offloads this much of each tensor-parallel rank's weights
            # (6 significant digits: a small model's layers round to 0.00 GiB, which vLLM takes as no offload)
            flags = ("--cpu-offload-gb", f"{streamed / GiB / plan.stages[ident.stage].tensor_parallel:.6g}")
        return StageExtras(flags=flags, expect_offloader=OFFLOADERS[plan.offload_backend])

    def cost(self, plan, split, lay, k, work, hw) -> StageCost:
        streamed = lay.offload_bytes[k]
        if not streamed:
            return NO_COST
        if plan.offload_backend == "prefetch":
            return prefetch_cost(streamed, work, plan, hw)
        stream = streamed / (hw.pcie_gbs * 1e9)  # UVA: every use reads host memory
        return StageCost(stream + work.concurrency * hw.offload_token_s,
                         work.chunks(plan) * stream + work.prompt * hw.offload_token_s)
