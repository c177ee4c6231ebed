"""pipeline: every stage computes its own layers; CPU stages read their weights from their own DRAM."""
from __future__ import annotations

from ..plan import Plan
from ..planner import Split
from .base import Layout, Strategy
from .cost import NO_COST, Hardware, StageCost, Workload, cpu_pass_s, lm_head_bytes


def cpu_stage_cost(plan: Plan, split: Split, lay: Layout, k: int, work: Workload, hw: Hardware) -> StageCost:
    """A CPU stage computing its layers (and the LM head when last) alone."""
    shape, c, n = split.shape, work.concurrency, lay.layers[k]
    stage, lm = plan.stages[lay.stages[k]], lm_head_bytes(shape, lay, k)
    cores = stage.cpus or 1
    flops_per_token = 2 * (n * shape.active_layer_elems + lm / shape.dtype_bytes)
    return StageCost(cpu_pass_s(n * shape.layer_read_bytes(c) + lm, flops_per_token, c, cores, shape, hw),
                     work.prompt * flops_per_token / (cores * hw.cpu_prefill_tflops_per_core * 1e12))


class Pipeline(Strategy):
    name = "pipeline"
    hybrid = False  # runs any plan

    def layout(self, plan: Plan, split: Split) -> Layout:
        counts = tuple(sp.layers for sp in split.stages)
        return Layout(self.name, tuple(range(len(counts))), counts, (0,) * len(counts))

    def cost(self, plan, split, lay, k, work, hw) -> StageCost:
        # GPU stages: the step's fixed cost covers them (cost.Hardware.gpu_step_s)
        return cpu_stage_cost(plan, split, lay, k, work, hw) if plan.stages[lay.stages[k]].is_cpu else NO_COST
