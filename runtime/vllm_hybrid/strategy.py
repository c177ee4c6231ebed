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
    """Throughputs the cost model uses (plan key `hardware` overrides any). Defaults: the H200 box of
    bench/results (16 vCPUs with AMX, PCIe gen5), fitted to its runs; see bench/results/README.md."""
    dram_gbs: float = 93.7               # host DRAM read bandwidth (bench/gpu_bench.py measures it)
    cpu_decode_efficiency: float = 0.87  # share of it a CPU stage's one-token step reaches (sgl kernel)
    cpu_token_tflops_per_core: float = 0.31   # small decode batches: each token adds this on top of the read
    cpu_decode_tflops_per_core: float = 0.143  # large decode batches: compute-bound at this rate
    cpu_prefill_tflops_per_core: float = 0.19  # prompt tokens (AMX GEMMs through oneDNN)
    pcie_gbs: float = 48.5               # weights streamed per step, effective (offload, one token)
    offload_token_s: float = 0.0004      # and each token of a streamed step re-reads weights over UVA
    gpu_step_s: float = 0.004            # a pipeline step's fixed cost: GPU stage, hops, scheduling


HARDWARE_KEYS = tuple(Hardware.__dataclass_fields__)


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
    prompt = c * work.prompt_tokens
    chunks = math.ceil(prompt / plan.max_num_batched_tokens)
    prefill = step = 0.0
    for k, (i, n) in enumerate(zip(lay.stages, lay.layers)):
        stage = plan.stages[i]
        if stage.is_cpu:
            # its layers, plus the LM head if it is the last stage (read every step)
            weights = n * shape.layer_bytes + (shape.embedding_bytes if k == len(lay.stages) - 1 else 0)
            flops_per_token = 2 * weights / shape.dtype_bytes
            cores = stage.cpus or 1
            step += max(weights / (hw.dram_gbs * 1e9 * hw.cpu_decode_efficiency)
                        + c * flops_per_token / (cores * hw.cpu_token_tflops_per_core * 1e12),
                        c * flops_per_token / (cores * hw.cpu_decode_tflops_per_core * 1e12))
            prefill += prompt * flops_per_token / (cores * hw.cpu_prefill_tflops_per_core * 1e12)
        elif lay.offload_bytes[k]:
            stream = lay.offload_bytes[k] / (hw.pcie_gbs * 1e9)
            step += stream + c * hw.offload_token_s
            prefill += chunks * stream + prompt * hw.offload_token_s
    step += hw.gpu_step_s if len(lay.stages) > 1 else 0.0
    return c * work.output_tokens / (prefill + work.output_tokens * step)


def hardware_of(plan: Plan) -> Hardware:
    return Hardware(**dict(plan.hardware))


def resolve(plan: Plan, split: Split, hw: Hardware | None = None,
            api_stage: int | None = None) -> tuple[Layout, dict[str, float]]:
    """The layout to run and the predicted tokens/s of each candidate at the expected workload.
    api_stage: the plan stage that must serve the API where the deployment fixes it (Kubernetes
    routes clients to stage 0's pods), so layouts that leave it out are not candidates."""
    hw = hw or hardware_of(plan)
    work = workload_of(plan)
    candidates = ["pipeline"]
    if any(not s.is_cpu for s in plan.stages) and any(s.is_cpu for s in plan.stages):
        candidates += ["offload", "balanced"]
    lays = {name: layout(plan, split, name, hw) for name in candidates}
    if api_stage is not None:
        lays = {name: lay for name, lay in lays.items() if lay.stages[0] == api_stage}
        if plan.strategy not in ("auto", *lays):
            raise PlanError(f"strategy: {plan.strategy} would serve the API from another stage than stage "
                            f"{api_stage} ({plan.stages[api_stage].name}); put a gpu stage first")
    estimates = {name: round(predict(plan, split, lay, work, hw), 2) for name, lay in lays.items()}
    if plan.strategy == "auto":
        return lays[max(estimates, key=estimates.get)], estimates
    if plan.strategy not in lays:
        raise PlanError(f"strategy: {plan.strategy} needs a gpu stage and a cpu stage")
    return lays[plan.strategy], estimates
