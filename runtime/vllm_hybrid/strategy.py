"""How the CPU side of the budget is used (plan.strategy), and the cost model `auto` chooses by.

pipeline  CPU stages compute their layers, reading the weights from their own DRAM.
offload   GPU stages only: the CPU stages' layers stay in the GPU pod's host RAM and are streamed
          to the GPU every step (vLLM --cpu-offload-gb, which needs the V1 model runner).
balanced  Both: a GPU stage also streams the CPU layers next to it, as many as make its PCIe time
          about equal to the CPU stage's DRAM time.
auto      Whichever of the three the cost model predicts fastest for the plan's expected workload.

Pure: a function of the plan, its layer split and the hardware figures, like the planner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .plan import Plan, PlanError
from .planner import Split


@dataclass(frozen=True)
class Hardware:
    """Throughputs the cost model uses. Defaults: the H200 box of bench/results (16 Sapphire Rapids
    cores with AMX, PCIe gen5), fitted to its measured runs; see bench/results/gpu_bench.md."""
    pcie_gbs: float = 49.5            # streamed weights per step, effective (offload, concurrency 1)
    offload_token_s: float = 0.0007   # a streamed step grows per token in the batch (UVA re-reads)
    dram_gbs: float = 97.7            # host DRAM read bandwidth
    cpu_decode_efficiency: float = 0.62  # share of that bandwidth a CPU stage's small-batch step reaches
    cpu_decode_tflops_per_core: float = 0.11  # large decode batches: compute-bound
    cpu_prefill_tflops_per_core: float = 0.23
    gpu_step_s: float = 0.008         # a pipeline step's fixed cost: GPU stage, hops, scheduling


@dataclass(frozen=True)
class Workload:
    concurrency: int = 16
    prompt_tokens: int = 512
    output_tokens: int = 256


def workload_of(plan: Plan) -> Workload:
    d = Workload()
    return Workload(plan.expected_concurrency or d.concurrency, plan.expected_prompt_tokens or d.prompt_tokens,
                    plan.expected_output_tokens or d.output_tokens)


@dataclass(frozen=True)
class Layout:
    """What actually runs: plan stage indexes in pipeline order, their layers and streamed bytes."""
    strategy: str
    stages: tuple[int, ...]
    layers: tuple[int, ...]
    offload_bytes: tuple[int, ...]

    @property
    def partition(self) -> str:
        return ",".join(map(str, self.layers))

    def ranges(self) -> dict[int, str]:
        out, first = {}, 0
        for i, n in zip(self.stages, self.layers):
            out[i], first = f"{first}-{first + n - 1}", first + n
        return out


def layout(plan: Plan, split: Split, strategy: str, hw: Hardware = Hardware()) -> Layout:
    counts = [sp.layers for sp in split.stages]
    gpus = [i for i, s in enumerate(plan.stages) if not s.is_cpu]
    if strategy == "pipeline" or not gpus:
        if strategy in ("offload", "balanced"):
            raise PlanError(f"strategy: {strategy} needs a gpu stage to stream layers to")
        return Layout("pipeline", tuple(range(len(counts))), tuple(counts), (0,) * len(counts))
    lb = split.shape.layer_bytes
    layers, streamed = dict.fromkeys(range(len(counts)), 0), dict.fromkeys(range(len(counts)), 0)
    for i in range(len(counts)):
        if not plan.stages[i].is_cpu:
            layers[i] += counts[i]
            continue
        # the GPU stage on the side the layers touch keeps them contiguous: the one before, else after
        g = max((j for j in gpus if j < i), default=min(gpus))
        moved = counts[i] if strategy == "offload" else _balanced_share(counts[i], hw)
        layers[g], streamed[g] = layers[g] + moved, streamed[g] + moved * lb
        layers[i] = counts[i] - moved
    keep = [i for i in range(len(counts)) if layers[i]]
    return Layout(strategy, tuple(keep), tuple(layers[i] for i in keep), tuple(streamed[i] for i in keep))


def _balanced_share(cpu_layers: int, hw: Hardware) -> int:
    """Layers to stream so k/PCIe ~ (n-k)/DRAM: both links busy for about the same time."""
    if cpu_layers < 2:
        return 0
    k = round(cpu_layers * hw.pcie_gbs / (hw.pcie_gbs + hw.dram_gbs * hw.cpu_decode_efficiency))
    return min(max(k, 1), cpu_layers - 1)


def predict(plan: Plan, split: Split, lay: Layout, work: Workload, hw: Hardware = Hardware()) -> float:
    """Output tokens/s of one wave of `concurrency` requests (all prefill, then decode) under `lay`."""
    shape, c = split.shape, work.concurrency
    head_bytes = shape.embedding_bytes  # the LM head, read every step by the last stage
    prefill = step = 0.0
    streams = any(lay.offload_bytes)
    chunks = math.ceil(c * work.prompt_tokens / plan.max_num_batched_tokens)
    for k, (i, n) in enumerate(zip(lay.stages, lay.layers)):
        stage = plan.stages[i]
        weights = n * shape.layer_bytes + (head_bytes if k == len(lay.stages) - 1 else 0)
        if stage.is_cpu:
            flops_per_token = weights  # 2 FLOP per weight, 2 bytes per bf16 weight
            flops_per_token *= 2 / shape.dtype_bytes
            cores = stage.cpus or 1
            step += max(weights / (hw.dram_gbs * 1e9 * hw.cpu_decode_efficiency),
                        c * flops_per_token / (cores * hw.cpu_decode_tflops_per_core * 1e12))
            prefill += c * work.prompt_tokens * flops_per_token / (cores * hw.cpu_prefill_tflops_per_core * 1e12)
        else:
            stream = lay.offload_bytes[k] / (hw.pcie_gbs * 1e9)
            step += stream + (c * hw.offload_token_s if lay.offload_bytes[k] else 0.0)
            prefill += chunks * stream
    step += hw.gpu_step_s if len(lay.stages) > 1 or not streams else 0.0
    return c * work.output_tokens / (prefill + work.output_tokens * step)


def resolve(plan: Plan, split: Split, hw: Hardware = Hardware()) -> tuple[Layout, dict[str, float]]:
    """The layout to run and the predicted tokens/s of each candidate at the expected workload."""
    work = workload_of(plan)
    candidates = ["pipeline"]
    if any(not s.is_cpu for s in plan.stages) and any(s.is_cpu for s in plan.stages):
        candidates += ["offload", "balanced"]
    lays = {name: layout(plan, split, name, hw) for name in candidates}
    estimates = {name: round(predict(plan, split, lay, work, hw), 2) for name, lay in lays.items()}
    if plan.strategy == "auto":
        return lays[max(estimates, key=estimates.get)], estimates
    if plan.strategy not in lays:
        raise PlanError(f"strategy: {plan.strategy} needs a gpu stage and a cpu stage")
    return lays[plan.strategy], estimates
