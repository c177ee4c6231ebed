"""The interface every strategy implements: its layout, its budget rules for the planner, its part of a
stage's resolved record, its cost, and why it refuses a plan."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..cpubind import CpuBinding
from ..plan import Plan, PlanError, Stage
from ..planner import ModelShape, Split
from .cost import NO_COST, Hardware, StageCost, Workload, lm_head_bytes

if TYPE_CHECKING:
    from ..launcher import Identity

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
    expect_offloader: str | None = None             # the offloader class vLLM must report (patches.patch_check_offloader)
    sidecar: tuple[str, ...] = ()                   # a process started before vLLM (python's args), stopping it if it dies
    sidecar_ready: str | None = None                # the path it creates once ready; vLLM waits for it
    summary: tuple[tuple[str, Any], ...] = ()       # its keys in `vllm-hybrid resolved`


@dataclass(frozen=True)
class Server:
    """A process a strategy runs on a stage vLLM leaves out, on every core of the stage."""
    argv: tuple[str, ...]                         # python's args
    summary: dict[str, Any]                       # its keys in `vllm-hybrid resolved` (role, ...)
    env: Callable[[CpuBinding, dict[str, str]], dict[str, str]]  # its env on the stage's binding, from the pod's


def streaming_gpu(stages: tuple[Stage, ...], index: int) -> int:
    """The gpu stage serving cpu stage `index` under offload, balanced and coprocessor: the one before it
    (layers stay contiguous), else the first."""
    gpus = [i for i, s in enumerate(stages) if not s.is_cpu]
    return max((j for j in gpus if j < index), default=min(gpus))


def shm_socket(env: dict[str, str], replica: int, stage: int, kind: str) -> str:
    """A socket of the replica's stages in their shared /dev/shm (HYBRID_SHM_DIR moves it)."""
    name = f"hybrid-{env.get('HYBRID_INSTANCE', 'local')}-r{replica}-s{stage}.{kind}"
    return os.path.join(env.get("HYBRID_SHM_DIR", "/dev/shm"), name)


class Strategy:
    """How the CPU side of the budget is used. A strategy names itself and lays out what runs; every other
    hook defaults to adding nothing (no refusal, no budget beyond each stage's layers and their KV, nothing
    in the record, no server, no cost)."""
    name: str
    hybrid = True  # needs a gpu stage and a cpu stage (else refused, after the API stage check)
    auto = True    # a candidate of `auto` (a strategy whose cost model no run has checked yet is not)

    def refused(self, plan: Plan, shared_shm: bool) -> str | None:
        """Why it cannot run `plan` (the end of "strategy: NAME needs ..."); None: it can. `plan` has a gpu
        and a cpu stage; shared_shm: whether a replica's stages share /dev/shm."""
        return None

    def refused_model(self, shape: ModelShape) -> str | None:
        """Why it cannot run this model (the end of "strategy: NAME needs ..."); None: it can."""
        return None

    # planner (split_layers): what the strategy takes of each stage's budget
    gpu_buffer_layers = 0  # >0: the gpu stages compute the cpu stages' layers, streaming them through this many buffers

    def beside_vllm_bytes(self, plan: Plan, shape: ModelShape, gpu: int) -> int:
        """GPU memory gpu stage `gpu` needs beside vLLM (its sidecar's)."""
        return 0

    def cpu_layer_bytes(self, shape: ModelShape, per_layer: int) -> int:
        """A cpu stage's budget per layer as the planner fills it (per_layer: its weights and minimum KV)."""
        return per_layer

    def streamed_layer_bytes(self, shape: ModelShape) -> int:
        """A streamed layer's weights in its cpu stage's budget (gpu_buffer_layers > 0)."""
        return shape.layer_bytes

    # what runs
    def layout(self, plan: Plan, split: Split) -> Layout:
        raise NotImplementedError

    def stage(self, plan: Plan, split: Split, lay: Layout, ident: Identity, env: dict[str, str]) -> StageExtras:
        """Its part of the record of the stage `ident` names (one of lay.stages); env: the pod's."""
        return StageExtras()

    def server(self, plan: Plan, lay: Layout, ident: Identity, env: dict[str, str]) -> Server | None:
        """What runs on a stage outside lay.stages instead of vLLM (None: the stage idles)."""
        return None

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
            flops = plan.max_num_batched_tokens * 2 * weights / shape.dtype_bytes
            return (weights / (hw.dram_gbs * 1e9 * hw.cpu_decode_efficiency)
                    + flops / ((stage.cpus or 1) * hw.cpu_prefill_tflops_per_core * 1e12))
        if lay.offload_bytes[k]:
            return lay.offload_bytes[k] / (hw.pcie_gbs * 1e9) + plan.max_num_batched_tokens * hw.offload_token_s
        return 0.0

    def require_gpu(self, plan: Plan) -> None:
        """Refuses a plan without a gpu stage to stream layers to."""
        if all(s.is_cpu for s in plan.stages):
            raise PlanError(f"strategy: {self.name} needs a gpu stage to stream layers to")
