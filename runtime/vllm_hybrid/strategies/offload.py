"""offload: GPU stages only. The CPU stages' layers stay in the GPU pod's host RAM and are streamed to the
GPU every step by vLLM's prefetch offloader (--offload-group-size: a copy stream fills static GPU buffers a
layer ahead, once per step) or, with offload_backend uva, by --cpu-offload-gb (the GPU reads host memory per
use). Both need the V1 model runner."""
from __future__ import annotations

from ..planner import GiB, ModelShape
from .base import Layout, StageExtras, Strategy
from .cost import NO_COST, StageCost
from .streaming import OFFLOADERS, PREFETCH_BUFFER_LAYERS, prefetch_cost, prefetch_flags, streamed_layout


class Offload(Strategy):
    name = "offload"
    gpu_buffer_layers = PREFETCH_BUFFER_LAYERS

    def cpu_layer_bytes(self, shape: ModelShape, per_layer: int) -> int:
        # its cpu stages' layers become the gpu pod's pinned copies; their KV lives on the GPU
        return shape.pinned_layer_bytes

    def streamed_layer_bytes(self, shape: ModelShape) -> int:
        return shape.pinned_layer_bytes

    def refused_model(self, shape: ModelShape) -> str | None:
        if shape.weight_format.method == "mxfp4":
            # an H200 lease: the prefetch offloader failed at start (`The size of tensor a (128) must match the
            # size of tensor b (64)`), its host copy still shaped as the checkpoint's tensor
            return ("weights vLLM 0.26's offloader can stream: gpt-oss's MXFP4 experts are laid out anew on the GPU "
                    "by their CUDA kernel after loading, and the offloader's host copy keeps the checkpoint's shape")
        return None

    def layout(self, plan, split) -> Layout:
        self.require_gpu(plan)
        return streamed_layout(plan, split, self.name)

    def stage(self, plan, split, lay, ident, env, hw=None):
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
