"""How the CPU side of the budget is used (plan.strategy), and the cost model `auto` chooses by.

pipeline  CPU stages compute their layers, reading the weights from their own DRAM.
offload   GPU stages only: the CPU stages' layers stay in the GPU pod's host RAM and are streamed
          to the GPU every step by vLLM's prefetch offloader (--offload-group-size: a copy stream
          fills static GPU buffers a layer ahead, once per step) or, with offload_backend uva, by
          --cpu-offload-gb (the GPU reads host memory per use). Both need the V1 model runner.
balanced  Both at once: every CPU stage computes its layers, and each of its matrix products is split
          row-wise with the GEMM helper of a GPU stage (gemm_split.py), which streams its share of the
          weights over PCIe while the CPU reads the rest from DRAM.
coprocessor  GPU stages compute every layer, streaming the CPU stages' layers with vLLM's prefetch
          offloader from a region each CPU stage owns (one copy); for decode-sized steps every product of
          those layers is split row-wise with the CPU stage, which computes its rows from the same memory
          (coproc.py). Prompt chunks stream whole layers: attention and KV stay on the GPU.
auto      Whichever of these the cost model predicts fastest for the plan's expected workload.

Pure: a function of the plan, its layer split and the hardware figures, like the planner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .plan import Plan, PlanError
from .planner import Split, split_layers, streaming_gpu

ALIGN = 16  # a GPU share of a split GEMM is whole 16-row blocks; below one block the CPU does it all


@dataclass(frozen=True)
class Hardware:
    """Throughputs the cost model uses (plan key `hardware` overrides any). Defaults: the H200 box of
    bench/results (16 vCPUs with AMX, PCIe gen5), fitted to its runs; see bench/results/README.md."""
    dram_gbs: float = 93.7               # host DRAM read bandwidth (bench/gpu_bench.py measures it)
    cpu_decode_efficiency: float = 0.87  # share of it a CPU stage's one-token step reaches (sgl kernel)
    cpu_moe_efficiency: float = 0.65     # and a mixture of experts' layers (gpu_bench-mixtral-h100.json: 89-405 ms)
    cpu_token_tflops_per_core: float = 0.31   # small decode batches: each token adds this on top of the read
    cpu_decode_tflops_per_core: float = 0.143  # large decode batches: compute-bound at this rate
    cpu_prefill_tflops_per_core: float = 0.19  # prompt tokens (AMX GEMMs through oneDNN)
    cpu_token_speed: float = 1.0  # this box's CPU per decode token against the H200 box's (the H100 box's 70B runs: 0.45)
    pcie_gbs: float = 48.5               # weights streamed per step, effective (offload uva, one token)
    offload_token_s: float = 0.0004      # and each token of a streamed step re-reads weights over UVA
    prefetch_pcie_gbs: float = 55.0      # offload prefetch: copies per step (gpu_bench-prefetch.json: 135 ms at 1)
    prefetch_token_s: float = 0.00008    # and each token of the step (that run: 140 ms at 64)
    gpu_step_s: float = 0.004            # a pipeline step's fixed cost: GPU stage, hops, scheduling
    split_pcie_gbs: float = 60.0         # balanced: the GEMM helper's pinned DMA copies (vLLM's UVA offload: pcie_gbs)
    split_dram_share: float = 0.5        # balanced: share of its decode rate a CPU stage keeps while the GPU streams
    split_call_s: float = 0.0001         # balanced: fixed cost of one split GEMM (socket round trip, sync)
    split_token_s_per_gb: float = 6e-5      # balanced: each token of a decode step, per GB of the stage's weights
    split_prefill_s_per_gb: float = 2.5e-5  # balanced: each prompt token (copies, attention, norms on the CPU)
    coproc_gbs: float = 85.0             # coprocessor: a decode step's streamed layers, PCIe and CPU rows together
    coproc_call_s: float = 0.00005       # coprocessor: each split product's hand-over (memops, io copies)
    coproc_token_s_per_gb: float = 7.2e-5  # coprocessor: each token of a split step, per GB of split weights
    coproc_max_rows: int = 64            # coprocessor: larger steps stream whole layers (coproc.DEFAULT_SHARES)
    # (the coproc_* figures: gpu_bench-coproc.json, TPOT 84-91 ms at 1-16, 121 ms at 64)
    # (the split_* figures: gpu_bench-onecopy.json, one weight copy on 2 MiB pages)


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
    helpers: tuple[int | None, ...] = ()  # balanced: the plan stage whose GEMM helper each stage uses
    servers: tuple[tuple[int, int], ...] = ()  # coprocessor: (cpu stage, the gpu stage it computes products for)

    def helper_of(self, stage: int) -> int | None:
        return self.helpers[self.stages.index(stage)] if self.helpers else None

    def helped_by(self, stage: int) -> list[int]:
        """The stages whose GEMMs `stage`'s helper computes part of (balanced)."""
        return [s for s, h in zip(self.stages, self.helpers) if h == stage]

    @property
    def partition(self) -> str:
        return ",".join(map(str, self.layers))

    def ranges(self) -> dict[int, str]:
        out, first = {}, 0
        for i, n in zip(self.stages, self.layers):
            out[i], first = f"{first}-{first + n - 1}", first + n
        return out


def prefetch_groups(layers: int, streamed: int) -> tuple[int, int]:
    """(--offload-group-size, --offload-num-in-group) that stream exactly `streamed` of a stage's `layers`:
    vLLM's prefetch offloader streams the last num_in_group layers of every group_size layers."""
    g = math.gcd(layers, streamed)
    return layers // g, streamed // g


def layout(plan: Plan, split: Split, strategy: str) -> Layout:
    counts = [sp.layers for sp in split.stages]
    everyone = tuple(range(len(counts)))
    gpus = [i for i, s in enumerate(plan.stages) if not s.is_cpu]
    if strategy == "pipeline" or not gpus:
        if strategy in ("offload", "balanced", "coprocessor"):
            raise PlanError(f"strategy: {strategy} needs a gpu stage to stream layers to")
        return Layout("pipeline", everyone, tuple(counts), (0,) * len(counts))
    if strategy == "balanced":
        helpers = tuple(streaming_gpu(plan.stages, i) if plan.stages[i].is_cpu else None for i in everyone)
        return Layout("balanced", everyone, tuple(counts), (0,) * len(counts), helpers)
    lb = split.shape.layer_bytes
    servers = tuple((i, streaming_gpu(plan.stages, i)) for i in everyone if plan.stages[i].is_cpu) \
        if strategy == "coprocessor" else ()
    layers, streamed = dict.fromkeys(everyone, 0), dict.fromkeys(everyone, 0)
    for i in everyone:
        if not plan.stages[i].is_cpu:
            layers[i] += counts[i]
            continue
        g = streaming_gpu(plan.stages, i)
        layers[g], streamed[g] = layers[g] + counts[i], streamed[g] + counts[i] * lb
    keep = [i for i in everyone if layers[i]]
    return Layout(strategy, tuple(keep), tuple(layers[i] for i in keep), tuple(streamed[i] for i in keep),
                  servers=servers)


@dataclass(frozen=True)
class Rates:
    """What each side reaches while both work (launcher: from the plan's hardware figures)."""
    pcie_gbs: float = 50.0    # host -> GPU, pinned weights
    cpu_gbs: float = 55.0     # CPU weight reads while the GPU streams (both load DRAM)
    cpu_tflops: float = 3.0   # CPU GEMM compute, large batches

    def encode(self) -> str:
        return f"{self.pcie_gbs},{self.cpu_gbs},{self.cpu_tflops}"

    @classmethod
    def decode(cls, text: str | None) -> Rates:
        return cls(*map(float, text.split(","))) if text else cls()

    def row_seconds(self, k: int, rows: int, elem: int) -> tuple[float, float]:
        """Time per weight row of a (n, k) product at `rows` rows on each side. GPU: the row and its
        outputs cross PCIe, (k + rows) * elem bytes. CPU: it reads the row at DRAM speed or, in large
        batches, computes it at its FLOP rate."""
        cpu_bps = min(self.cpu_gbs * 1e9, self.cpu_tflops * 1e12 * elem / (2 * rows))
        return (k + rows) * elem / (self.pcie_gbs * 1e9), k * elem / cpu_bps


def gpu_rows(rows: int, n: int, k: int, elem: int, rates: Rates, share: float | None = None) -> int:
    """Rows of an (n, k) weight the GPU computes for a batch of `rows`: both sides finish together
    (`share` fixes the GPU's fraction instead, for experiments)."""
    if share is None:
        t_gpu, t_cpu = rates.row_seconds(k, rows, elem)
        share = t_cpu / (t_gpu + t_cpu)
    n0 = int(n * share) // ALIGN * ALIGN
    return n if n - n0 < ALIGN else n0


def split_rates(hw: Hardware, cores: int) -> Rates:
    """What a CPU stage and its GEMM helper reach side by side (gemm_split picks each split by them)."""
    return Rates(pcie_gbs=hw.split_pcie_gbs, cpu_gbs=hw.dram_gbs * hw.cpu_decode_efficiency * hw.split_dram_share,
                 cpu_tflops=cores * hw.cpu_prefill_tflops_per_core)


def split_pass_s(weights: float, k: int, rows: int, elem: int, rates: Rates) -> float:
    """One pass over `weights` bytes of (n, k) products at `rows` rows, each split at gemm_split's point:
    the two sides work in parallel, so their rates per weight row add up."""
    t_gpu, t_cpu = rates.row_seconds(k, rows, elem)
    return weights / (k * elem) * t_gpu * t_cpu / (t_gpu + t_cpu)


def cpu_pass_s(read_bytes: float, flops_per_token: float, c: int, cores: int, shape, hw: Hardware) -> float:
    """A CPU stage's decode step of `c` tokens: reading its weights plus each token's products, or, in large
    batches, compute-bound."""
    efficiency = hw.cpu_moe_efficiency if shape.experts else hw.cpu_decode_efficiency
    flops = c * flops_per_token / (cores * hw.cpu_token_speed * 1e12)
    return max(read_bytes / (hw.dram_gbs * 1e9 * efficiency) + flops / hw.cpu_token_tflops_per_core,
               flops / hw.cpu_decode_tflops_per_core)


def predict(plan: Plan, split: Split, lay: Layout, work: Workload, hw: Hardware = Hardware()) -> float:
    """Output tokens/s of one wave of `concurrency` requests (all prefill, then decode) under `lay`."""
    shape, c = split.shape, work.concurrency
    prompt = c * work.prompt_tokens
    chunks = math.ceil(prompt / plan.max_num_batched_tokens)
    prefill = step = 0.0
    for k, (i, n) in enumerate(zip(lay.stages, lay.layers)):
        stage = plan.stages[i]
        if stage.is_cpu:
            lm = shape.embedding_bytes if k == len(lay.stages) - 1 else 0  # the last stage's LM head, read every step
            cores = stage.cpus or 1
            if lay.helper_of(i) is not None:
                # the helper splits the 2-D products; a mixture's experts (3-D) stay on the CPU, as in pipeline
                weights = n * (shape.layer_bytes - shape.layer_expert_bytes) + lm
                rates, calls, gb = split_rates(hw, cores), (4 * n + 1) * hw.split_call_s, weights / 1e9
                moe_flops = 2 * n * shape.routed * shape.expert_elems
                step += (split_pass_s(weights, shape.hidden, c, shape.dtype_bytes, rates) + calls
                         + c * gb * hw.split_token_s_per_gb / hw.cpu_token_speed
                         + cpu_pass_s(n * shape.expert_read_bytes(c), moe_flops, c, cores, shape, hw))
                chunk = min(prompt, plan.max_num_batched_tokens)
                prefill += (chunks * (split_pass_s(weights, shape.hidden, chunk, shape.dtype_bytes, rates) + calls)
                            + prompt * gb * hw.split_prefill_s_per_gb
                            + prompt * moe_flops / (cores * hw.cpu_prefill_tflops_per_core * 1e12))
                continue
            flops_per_token = 2 * (n * shape.active_layer_elems + lm / shape.dtype_bytes)
            step += cpu_pass_s(n * shape.layer_read_bytes(c) + lm, flops_per_token, c, cores, shape, hw)
            prefill += prompt * flops_per_token / (cores * hw.cpu_prefill_tflops_per_core * 1e12)
        elif lay.offload_bytes[k] and lay.strategy == "coprocessor":
            stream = lay.offload_bytes[k] / (hw.prefetch_pcie_gbs * 1e9)  # prompt chunks: whole layers
            prefill += chunks * stream + prompt * hw.prefetch_token_s
            if c <= hw.coproc_max_rows:
                # the 2-D products are split with the CPU; a mixture's experts (3-D) stream whole, as in offload
                layers = round(lay.offload_bytes[k] / shape.layer_bytes)
                experts = layers * shape.layer_expert_bytes
                products, gb = (2 if shape.experts else 4) * layers, (lay.offload_bytes[k] - experts) / 1e9
                step += (gb / hw.coproc_gbs + experts / (hw.prefetch_pcie_gbs * 1e9) + products * hw.coproc_call_s
                         + c * gb * hw.coproc_token_s_per_gb / hw.cpu_token_speed)
            else:
                step += stream + c * hw.prefetch_token_s
        elif lay.offload_bytes[k] and plan.offload_backend == "prefetch":
            stream = lay.offload_bytes[k] / (hw.prefetch_pcie_gbs * 1e9)  # once per step, whatever its tokens
            step += stream + c * hw.prefetch_token_s
            prefill += chunks * stream + prompt * hw.prefetch_token_s
        elif lay.offload_bytes[k]:
            stream = lay.offload_bytes[k] / (hw.pcie_gbs * 1e9)
            step += stream + c * hw.offload_token_s
            prefill += chunks * stream + prompt * hw.offload_token_s
    step += hw.gpu_step_s if len(lay.stages) > 1 else 0.0
    return c * work.output_tokens / (prefill + work.output_tokens * step)


def slowest_step_s(plan: Plan, split: Split, lay: Layout, hw: Hardware | None = None) -> float:
    """The longest step expected: a full prefill chunk (max_num_batched_tokens) through every stage, as
    each stage waits for the others' share of it (one batch in flight). The stall timeout is sized
    from it. Balanced CPU stages count as CPU-only: an upper bound."""
    hw = hw or hardware_of(plan)
    shape, tokens, total = split.shape, plan.max_num_batched_tokens, hw.gpu_step_s
    for k, (i, n) in enumerate(zip(lay.stages, lay.layers)):
        stage = plan.stages[i]
        if stage.is_cpu:
            # every weight, every expert included: a bound, not an estimate
            weights = n * shape.layer_bytes + (shape.embedding_bytes if k == len(lay.stages) - 1 else 0)
            flops = tokens * 2 * weights / shape.dtype_bytes
            total += (weights / (hw.dram_gbs * 1e9 * hw.cpu_decode_efficiency)
                      + flops / ((stage.cpus or 1) * hw.cpu_prefill_tflops_per_core * 1e12))
        elif lay.offload_bytes[k]:
            total += lay.offload_bytes[k] / (hw.pcie_gbs * 1e9) + tokens * hw.offload_token_s
    return total


def hardware_of(plan: Plan) -> Hardware:
    return Hardware(**dict(plan.hardware))


def resolve_split(plan: Plan, shape, gpu_memory_bytes: int | None = None, hw: Hardware | None = None,
                  api_stage: int | None = None, shared_shm: bool = True) -> tuple[Split, Layout, dict[str, float]]:
    """The split and layout to run: the strategy is chosen on the pipeline split (auto: by the cost
    model), then gets a split of its own (offload and balanced need GPU memory for other things)."""
    split = split_layers(plan, shape, gpu_memory_bytes)
    lay, estimates = resolve(plan, split, hw, api_stage, shared_shm)
    if lay.strategy != "pipeline":
        split = split_layers(plan, shape, gpu_memory_bytes, lay.strategy)
        lay = layout(plan, split, lay.strategy)
    return split, lay, estimates


def _coprocessor_refused(plan: Plan) -> str | None:
    """Why the coprocessor cannot run this plan (None: it can)."""
    if any(s.tensor_parallel > 1 for s in plan.stages if not s.is_cpu):
        return "tensor_parallel 1 on the gpu stages"
    helped = [streaming_gpu(plan.stages, i) for i, s in enumerate(plan.stages) if s.is_cpu]
    if len(set(helped)) < len(helped):  # a gpu stage's offloader streams from one region
        return ("one cpu stage per gpu stage (a gpu stage streams from one cpu stage's region); merge the cpu "
                "stages or put a gpu stage before each")
    return None


def resolve(plan: Plan, split: Split, hw: Hardware | None = None, api_stage: int | None = None,
            shared_shm: bool = True) -> tuple[Layout, dict[str, float]]:
    """The layout to run and the predicted tokens/s of each candidate at the expected workload.
    api_stage: the plan stage that must serve the API where the deployment fixes it (Kubernetes
    routes clients to stage 0's pods), so layouts that leave it out are not candidates.
    shared_shm: whether the stages of a replica share /dev/shm (balanced needs it for the helper)."""
    hw = hw or hardware_of(plan)
    work = workload_of(plan)
    candidates = ["pipeline"]
    if any(not s.is_cpu for s in plan.stages) and any(s.is_cpu for s in plan.stages):
        candidates += ["offload", "balanced"] if shared_shm else ["offload"]
        if plan.strategy in ("balanced", "coprocessor") and not shared_shm:
            raise PlanError(f"strategy: {plan.strategy} needs the stages of a replica to share /dev/shm "
                            "(sharedMemory.mode hostPath): the cpu and gpu stages meet there")
        if shared_shm and not (why := _coprocessor_refused(plan)):
            candidates.append("coprocessor")
        elif plan.strategy == "coprocessor":
            raise PlanError(f"strategy: coprocessor needs {why}")
    lays = {name: layout(plan, split, name) for name in candidates}
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
