"""The interface every strategy implements: its layout, its budget rules for the planner, its part of a
stage's resolved record, its cost, and why it refuses a plan."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cpubind import THP_ENV, CpuBinding
from ..identity import Identity
from ..plan import Plan, PlanError
from ..planner import BudgetRules, ModelShape, Split
from .cost import NO_COST, Hardware, StageCost, Workload, lm_head_bytes


def unquantized(shape: ModelShape) -> str | None:
    """Why a strategy whose CPU kernels read plain weights refuses a quantized checkpoint (None: it is not one)."""
    fmt = shape.weight_format
    if not fmt.quantized:
        return None
    return (f"unquantized weights (bf16, fp16 or fp32): its CPU pod computes from plain weights, and this checkpoint "
            f"is {fmt.name} ({fmt.method})")


# why balanced and coprocessor refuse a replica whose stages do not share /dev/shm
SHARED_SHM = "the stages of a replica to share /dev/shm (sharedMemory.mode hostPath): the cpu and gpu stages meet there"


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


@dataclass(frozen=True)
class StageExtras:
    """A strategy's part of a stage's resolved record; the launcher renders it as it is."""
    flags: tuple[str, ...] = ()                     # vLLM flags (the weights it streams)
    env: tuple[tuple[str, str], ...] = ()           # vLLM's env, set
    env_defaults: tuple[tuple[str, str], ...] = ()  # and set unless the stage's env has them (the user's wins)
    expect_offloader: str | None = None             # the offloader class vLLM must report (vllm_patches.worker.patch_check_offloader)
    sidecar: tuple[str, ...] = ()                   # a process started before vLLM (python's args), stopping it if it dies
    sidecar_ready: str | None = None                # the path it creates once ready; vLLM waits for it
    summary: tuple[tuple[str, Any], ...] = ()       # its keys in `vllm-hybrid resolved`


@dataclass(frozen=True)
class Server:
    """A process a strategy runs on a stage vLLM leaves out, on every core of the stage."""
    argv: tuple[str, ...]                         # python's args
    summary: dict[str, Any]                       # its keys in `vllm-hybrid resolved` (role, ...)
    env: Callable[[CpuBinding, dict[str, str]], dict[str, str]]  # its env on the stage's binding, from the pod's


def shm_socket(env: dict[str, str], replica: int, stage: int, kind: str) -> str:
    """A socket of the replica's stages in their shared /dev/shm (HYBRID_SHM_DIR moves it)."""
    name = f"hybrid-{env.get('HYBRID_INSTANCE', 'local')}-r{replica}-s{stage}.{kind}"
    return os.path.join(env.get("HYBRID_SHM_DIR", "/dev/shm"), name)


WAIT_ENV = "HYBRID_SERVER_WAIT"  # the stage's env may override how the server's threads wait: spin | passive
WAITS = ("spin", "passive")


def server_env(binding: CpuBinding, base: dict[str, str], stage: int, name: str) -> dict[str, str]:
    """Its torch threads one per core of the stage's binding (libgomp places thread i on the i-th CPU), waiting
    between two calls as HYBRID_SERVER_WAIT says, whatever the image sets: spin (the default, libgomp's own: spin
    ~300k rounds, then sleep) or passive (asleep at once)."""
    # woken from sleep at every call, the threads start one after another: one H100 lease, coprocessor's decode
    # 2.5-17% slower (bench/results/gpu_bench-coproc-h100-spin.json), the expert server's replica 70 GB/s against 81
    wait = base.get(WAIT_ENV) or "spin"
    if wait not in WAITS:
        raise ValueError(f"{WAIT_ENV}={wait!r}: one of {', '.join(WAITS)}")
    env = {k: v for k, v in base.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(binding.threads_per_rank), HYBRID_STAGE=str(stage),
               HYBRID_STAGE_NAME=name)
    env = {**THP_ENV, **env}  # unless the stage's env says otherwise
    if wait == "passive":  # never ACTIVE: spinning for ever, each product took 8 ms instead of 1.3 (coproc_probe.json)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if binding.pinned:
        env["GOMP_CPU_AFFINITY"] = binding.omp_bind.replace(",", " ")
    return env


def cpu_pod_server(plan: Plan, lay: Layout, ident: Identity, env: dict[str, str], kind: str, module: str,
                   role: str) -> Server | None:
    """A cpu stage's server (python -m vllm_hybrid.<module>) for the gpu stage lay.servers pairs it with, on the
    socket shm_socket names by `kind`; None on any other stage."""
    served = dict(lay.servers)
    if ident.stage not in served:
        return None
    sock, name = shm_socket(env, ident.replica, ident.stage, kind), plan.stages[ident.stage].name
    port = int(env.get("HYBRID_METRICS_PORT", plan.metrics_port))
    return Server(argv=("-m", f"vllm_hybrid.{module}", "--socket", sock, "--metrics-port", str(port)),
                  summary={"role": role, "for_stage": served[ident.stage], "socket": sock},
                  env=lambda binding, base: server_env(binding, base, ident.stage, name))


class Strategy(BudgetRules):
    """How the CPU side of the budget is used. A strategy names itself and lays out what runs; every other
    hook defaults to adding nothing (no refusal, no budget beyond each stage's layers and their KV (the planner's
    BudgetRules), nothing in the record, no server, no cost, no change to vLLM)."""
    name: str
    hybrid = True  # needs a gpu stage and a cpu stage (else refused, after the API stage check)
    auto = True    # a candidate of `auto` (a strategy whose cost model no run has checked yet is not)

    def refused(self, plan: Plan, shared_shm: bool) -> str | None:
        """Why it cannot run `plan` (the end of "strategy: NAME needs ..."); None: it can. `plan` has a gpu
        and a cpu stage; shared_shm: whether a replica's stages share /dev/shm."""
        return None

    def refused_model(self, shape: ModelShape) -> str | None:
        """Why it cannot run this model (the middle of "strategy: NAME needs ...; use strategy ...", resolve names
        the strategies that can); None: it can."""
        return None

    def refused_node(self, shape: ModelShape, hw: Hardware) -> str | None:
        """Why it cannot run this model on these nodes, by what their stages measured at start (hw); None: it can."""
        return None

    # what runs
    def layout(self, plan: Plan, split: Split) -> Layout:
        raise NotImplementedError

    def describe(self, plan: Plan, split: Split, lay: Layout) -> str:
        """What each stage holds, for `vllm-hybrid plan` (the memory a user sizes the stages by): the split's."""
        return split.describe()

    def stage(self, plan: Plan, split: Split, lay: Layout, ident: Identity, env: dict[str, str],
              hw: Hardware | None = None) -> StageExtras:
        """Its part of the record of the stage `ident` names (one of lay.stages); env: the pod's; hw: the cost model's
        figures the strategy was resolved on (None: the plan's, hardware_of)."""
        return StageExtras()

    def server(self, plan: Plan, lay: Layout, ident: Identity, env: dict[str, str]) -> Server | None:
        """What runs on a stage outside lay.stages instead of vLLM (None: the stage idles)."""
        return None

    def patch_vllm(self) -> list[str]:
        """Its changes to vLLM, in each vLLM process of a stage it runs (vllm_patches.apply_all calls it after the
        core patches); what each changed. A strategy's patches live in its folder and import vLLM only here."""
        return []

    # cost (auto's choice, the stall timeout)
    def cost(self, plan: Plan, split: Split, lay: Layout, k: int, work: Workload, hw: Hardware) -> StageCost:
        """The decode step and prefill seconds of lay.stages[k]."""
        return NO_COST

    def chunk_bound_s(self, plan: Plan, split: Split, lay: Layout, k: int, hw: Hardware) -> float:
        """At most how long lay.stages[k] takes over a full prefill chunk (max_num_batched_tokens): a bound,
        not an estimate. CPU stages count as computing every weight alone, streamed bytes as crossing UVA."""
        shape, stage, n = split.shape, plan.stages[lay.stages[k]], lay.layers[k]
        if stage.is_cpu:
            # every weight, every expert included
            weights = n * shape.layer_bytes + lm_head_bytes(shape, lay, k)
            flops = plan.max_num_batched_tokens * 2 * (n * shape.layer_elems + lm_head_bytes(shape, lay, k) / shape.dtype_bytes)
            return (weights / (hw.dram_gbs * 1e9 * hw.cpu_decode_efficiency)
                    + flops / ((stage.cpus or 1) * hw.cpu_prefill_tflops_per_core * 1e12))
        if lay.offload_bytes[k]:
            return lay.offload_bytes[k] / (hw.pcie_gbs * 1e9) + plan.max_num_batched_tokens * hw.offload_token_s
        return 0.0

    def require_gpu(self, plan: Plan) -> None:
        """Refuses a plan without a gpu stage to stream layers to."""
        if all(s.is_cpu for s in plan.stages):
            raise PlanError(f"strategy: {self.name} needs a gpu stage to stream layers to")
