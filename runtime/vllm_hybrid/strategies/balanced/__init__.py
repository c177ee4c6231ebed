"""balanced: every CPU stage computes its layers, and each of its matrix products is split row-wise with the
GEMM helper of a GPU stage (gemm_split.py in the cpu stage, gemm_helper.py beside the gpu stage's vLLM), which streams its share of the weights over
PCIe while the CPU reads the rest from DRAM."""
from __future__ import annotations

from ...plan import Plan
from ...planner import GiB, ModelShape, Split
from ..base import SHARED_SHM, Layout, StageExtras, Strategy, shm_socket, unquantized
from ..cost import NO_COST, Hardware, StageCost, Workload, cpu_pass_s, hardware_of, lm_head_bytes, moe_calls_s
from ..streaming import streaming_gpu
from .io import HELPER_RING_SLOTS, RATES_ENV, SOCKET_ENV, Rates

HELPER_CONTEXT = GiB // 2  # its CUDA context and kernels


def split_rates(hw: Hardware, cores: int) -> Rates:
    """What a CPU stage and its GEMM helper reach side by side (gemm_split picks each split by them)."""
    return Rates(pcie_gbs=hw.split_pcie_gbs, cpu_gbs=hw.dram_gbs * hw.cpu_decode_efficiency * hw.split_dram_share,
                 cpu_tflops=cores * hw.cpu_prefill_tflops_per_core)


def split_pass_s(weights: float, k: int, rows: int, elem: int, rates: Rates) -> float:
    """One pass over `weights` bytes of (n, k) products at `rows` rows, each split at gemm_split's point:
    the two sides work in parallel, so their rates per weight row add up."""
    t_gpu, t_cpu = rates.row_seconds(k, rows, elem)
    return weights / (k * elem) * t_gpu * t_cpu / (t_gpu + t_cpu)


def biggest_split_weight(shape: ModelShape, lm_head: bool) -> tuple[int, int]:
    """(rows, cols) of the largest 2-D product a CPU stage splits (experts are 3-D: not split)."""
    qkv = ((shape.heads + 2 * shape.kv_heads) * shape.head_dim, shape.hidden)
    candidates = [qkv, (shape.hidden, shape.heads * shape.head_dim)]
    if not shape.experts:
        candidates += [(2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)]
    if lm_head:
        candidates.append((shape.vocab, shape.hidden))
    return max(candidates, key=lambda rc: rc[0] * rc[1])


def helper_gpu_bytes(plan: Plan, shape: ModelShape, gpu: int) -> int:
    """GPU memory that gpu stage `gpu`'s GEMM helper takes beside vLLM: a ring of the biggest split weight
    per CPU worker it serves, the largest output of a prefill chunk, its CUDA context."""
    served = [i for i, s in enumerate(plan.stages) if s.is_cpu and streaming_gpu(plan.stages, i) == gpu]
    if not served:
        return 0
    n = len(plan.stages)
    rows, cols = max((biggest_split_weight(shape, lm_head=i == n - 1) for i in served), key=lambda rc: rc[0] * rc[1])
    workers = sum(plan.stages[i].tensor_parallel for i in served)
    ring = workers * HELPER_RING_SLOTS * rows * cols * shape.dtype_bytes
    return ring + plan.max_num_batched_tokens * (rows + cols) * shape.dtype_bytes + HELPER_CONTEXT


def gemm_socket(env: dict[str, str], replica: int, gpu_stage: int) -> str:
    """Where GPU stage `gpu_stage`'s GEMM helper listens: the replica's shared /dev/shm."""
    return shm_socket(env, replica, gpu_stage, "gemm")


class Balanced(Strategy):
    name = "balanced"

    def refused(self, plan: Plan, shared_shm: bool) -> str | None:
        return None if shared_shm else SHARED_SHM  # a cpu stage hands its weights to the helper there

    def refused_model(self, shape: ModelShape) -> str | None:
        return unquantized(shape)  # its split GEMMs (the CPU's rows and the helper's) take plain weights only

    def beside_vllm_bytes(self, plan: Plan, shape: ModelShape, gpu: int) -> int:
        return helper_gpu_bytes(plan, shape, gpu)

    def layout(self, plan: Plan, split: Split) -> Layout:
        self.require_gpu(plan)
        counts, everyone = tuple(sp.layers for sp in split.stages), range(len(split.stages))
        helpers = tuple(streaming_gpu(plan.stages, i) if plan.stages[i].is_cpu else None for i in everyone)
        return Layout(self.name, tuple(everyone), counts, (0,) * len(counts), helpers)

    def stage(self, plan, split, lay, ident, env, hw=None) -> StageExtras:
        split_with, helper_for = lay.helper_of(ident.stage), lay.helped_by(ident.stage)
        if split_with is not None:  # a cpu stage: its GEMMs are split with that helper (patches.py)
            rates = split_rates(hardware_of(plan), plan.stages[ident.stage].cpus or 1).encode()
            return StageExtras(env=((SOCKET_ENV, gemm_socket(env, ident.replica, split_with)),),
                               env_defaults=((RATES_ENV, rates),), summary=(("gemm_split_with", split_with),))
        if not helper_for:
            return StageExtras()
        # a gpu stage runs the helper. It takes its GPU memory before vLLM starts: vLLM counts memory another
        # process takes while it profiles as its own overhead (a helper connecting then left a 70B shape's GPU
        # stage no KV cache)
        sock = gemm_socket(env, ident.replica, ident.stage)
        reserve = max(0, split.stages[ident.stage].beside_vllm_bytes - HELPER_CONTEXT)
        return StageExtras(
            sidecar=("-m", "vllm_hybrid.strategies.balanced.gemm_helper", "--socket", sock, "--device", "cuda",
                     *(("--reserve-bytes", str(reserve)) if reserve else ())),
            sidecar_ready=sock, summary=(("gemm_helper_for", helper_for),))

    def cost(self, plan: Plan, split: Split, lay: Layout, k: int, work: Workload, hw: Hardware) -> StageCost:
        stage = plan.stages[lay.stages[k]]
        if not stage.is_cpu:
            return NO_COST  # its helper's work is in the CPU stage's split products
        shape, c, n, prompt = split.shape, work.concurrency, lay.layers[k], work.prompt
        cores = stage.cpus or 1
        # the helper splits the 2-D products; a mixture's experts (3-D) stay on the CPU, as in pipeline
        weights = n * (shape.layer_bytes - shape.layer_expert_bytes) + lm_head_bytes(shape, lay, k)
        rates, calls, gb = split_rates(hw, cores), (4 * n + 1) * hw.split_call_s, weights / 1e9
        moe_flops = 2 * n * shape.routed * shape.expert_elems
        moe = moe_calls_s(hw, shape, shape.experts, c)  # the MoE kernel's call as measured on this node, if it was
        step = (split_pass_s(weights, shape.hidden, c, shape.dtype_bytes, rates) + calls
                + c * gb * hw.split_token_s_per_gb / hw.cpu_token_speed
                + (n * moe if moe is not None else cpu_pass_s(n * shape.expert_read_bytes(c), moe_flops, c, cores, shape, hw)))
        chunk = min(prompt, plan.max_num_batched_tokens)
        prefill = (work.chunks(plan) * (split_pass_s(weights, shape.hidden, chunk, shape.dtype_bytes, rates) + calls)
                   + prompt * gb * hw.split_prefill_s_per_gb
                   + prompt * moe_flops / (cores * hw.cpu_prefill_tflops_per_core * 1e12))
        return StageCost(step, prefill)

    def patch_vllm(self) -> list[str]:
        from .patches import apply  # vLLM's modules: only in a stage's vLLM process
        return apply()
