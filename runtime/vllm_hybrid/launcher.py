"""Turns the pipeline plan + this pod's identity into the vLLM invocation for one stage (pure)."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .cpubind import THP_ENV, CpuBinding, format_cpulist
from .identity import Identity
from .plan import Plan, PlanError
from .planner import GiB, Split
from .strategies import STRATEGY_ENV, Layout, get, slowest_step_s
from .strategies.base import StageExtras

GPU_VLLM_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # the V2 runner's pipeline path does not go through our hop patches
}


def cpu_kv_cache_gib(plan: Plan, split: Split, stage: int, env: dict[str, str] | None = None) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB): the stage's budget after its weights, at least 1; a value in the
    stage's env (spec.stages[].env) wins, as vLLM's own setting, up to that budget: beyond it the kernel would
    OOM-kill the stage at load (vLLM checks it against the node's free memory, not the pod's limit)."""
    planned = max(1, split.stages[stage].kv_bytes // GiB)
    override = (env or {}).get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not override:
        return planned
    if not override.isdigit() or int(override) < 1:
        raise PlanError(f"VLLM_CPU_KVCACHE_SPACE: expected whole GiB (at least 1), got {override!r}")
    if int(override) > planned:
        s = plan.stages[stage]
        raise PlanError(f"VLLM_CPU_KVCACHE_SPACE={override} GiB: stage {s.name}'s memory "
                        f"({(s.memory_bytes or 0) / GiB:.3g} GiB) leaves "
                        f"{planned} GiB for its KV cache after its weights and vLLM's own; the kernel would OOM-kill "
                        "it at load: lower it or raise the stage's memory")
    return int(override)


def progress_file(env: dict[str, str], replica: int, stage: int) -> str:
    """Where the stage's first worker publishes its progress for the launcher's stall watch."""
    name = f".hybrid-{env.get('HYBRID_INSTANCE', 'local')}-r{replica}-s{stage}.progress"
    return os.path.join(env.get("HYBRID_SHM_DIR", "/dev/shm"), name)


def stall_timeouts(plan: Plan, split: Split, lay: Layout | None = None) -> tuple[float, float]:
    """(stall timeout, compile grace) in seconds: the plan's stall_timeout, else sized from the slowest
    step the cost model expects; 0 turns stall detection off."""
    from .progress import compile_grace, default_timeouts
    if plan.stall_timeout is not None:
        return float(plan.stall_timeout), compile_grace(float(plan.stall_timeout))
    return default_timeouts(slowest_step_s(plan, split, lay or get("pipeline").layout(plan, split)))


@dataclass(frozen=True)
class StageRecord:
    """One stage of one replica, resolved once from the plan, the layer split and the strategy's layout:
    the launcher only renders it into vLLM's argv and env and its sidecar's command."""
    index: int                     # in the plan
    rank: int                      # in what runs (a strategy may leave stages out)
    stages: int                    # how many run
    name: str
    device: str
    tp: int
    strategy: str
    partition: str                 # VLLM_PP_LAYER_PARTITION
    layers: str                    # this stage's layer range
    offload_gib: float             # the weights it streams from host RAM
    kv_cache_gib: int | None       # cpu stages: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float | None  # gpu stages: vLLM's share, less what runs beside it (a sidecar)
    stall_timeout: float
    compile_grace: float
    progress_file: str
    extras: StageExtras            # the strategy's part (strategies/<name>.py)
    vocab: int = 0                 # the model's vocabulary: the API guard refuses token ids past it

    @property
    def role(self) -> str:
        return "api" if self.rank == 0 else "headless"


def resolve_stage(plan: Plan, split: Split, ident: Identity, env: dict[str, str], lay: Layout | None = None,
                  hw=None) -> StageRecord:
    """hw: the cost model's figures `lay` was resolved on (node-measured for auto), which a strategy may size by."""
    lay = lay or get("pipeline").layout(plan, split)
    stage, rank = plan.stages[ident.stage], lay.stages.index(ident.stage)
    extras = get(lay.strategy).stage(plan, split, lay, ident, env, hw)
    timeout, grace = stall_timeouts(plan, split, lay)
    return StageRecord(
        index=ident.stage, rank=rank, stages=len(lay.stages), name=stage.name, device=stage.device,
        tp=stage.tensor_parallel, strategy=lay.strategy, partition=lay.partition, layers=lay.ranges()[ident.stage],
        offload_gib=round(lay.offload_bytes[rank] / GiB, 2),
        kv_cache_gib=cpu_kv_cache_gib(plan, split, ident.stage, env) if stage.is_cpu else None,
        gpu_memory_utilization=None if stage.is_cpu else split.stages[ident.stage].gpu_memory_utilization,
        stall_timeout=timeout, compile_grace=grace, progress_file=progress_file(env, ident.replica, ident.stage),
        extras=extras, vocab=split.shape.vocab)


def helper_command(rec: StageRecord, python: str = sys.executable) -> list[str] | None:
    """The process the strategy runs beside vLLM (balanced, gpu stage: the GEMM helper), if any."""
    return [python, *rec.extras.sidecar] if rec.extras.sidecar else None


def vllm_command(plan: Plan, rec: StageRecord, ident: Identity, python: str = sys.executable) -> list[str]:
    stage = plan.stages[rec.index]
    argv = [python, "-m", "vllm_hybrid.vllm_entry", "serve", plan.model,
            "--served-model-name", plan.served_model_name or Path(plan.model).name,
            "--dtype", plan.dtype,
            "--max-model-len", str(plan.max_model_len),
            "--block-size", str(plan.block_size),
            "--max-num-seqs", str(plan.max_num_seqs),
            "--max-num-batched-tokens", str(plan.max_num_batched_tokens),
            "--load-format", plan.load_format,
            "--tensor-parallel-size", str(rec.tp),
            "--pipeline-parallel-size", str(rec.stages),
            "--distributed-executor-backend", "mp"]
    if rec.stages > 1:
        # no async scheduling: sampled tokens would travel over the pipeline's device group (one stage keeps it: the
        # next step is scheduled while this one runs)
        argv += ["--no-async-scheduling", "--nnodes", str(rec.stages), "--node-rank", str(rec.rank),
                 "--master-addr", ident.master_addr, "--master-port", str(plan.master_port)]
    if plan.revision:
        argv += ["--revision", plan.revision]
    if not stage.is_cpu:
        argv += ["--gpu-memory-utilization", str(rec.gpu_memory_utilization)]
    argv += rec.extras.flags
    if rec.rank == 0:
        argv += ["--host", "0.0.0.0", "--port", str(plan.api_port),
                 "--middleware", "vllm_hybrid.api_guard.RequestGuard"]
    else:
        argv += ["--headless"]
    return argv + list(plan.extra_args)


def vllm_env(plan: Plan, rec: StageRecord, ident: Identity, binding: CpuBinding | None,
             base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update(GPU_VLLM_ENV)
    env.update({
        "HYBRID_PIPELINE": "1",
        "VLLM_PP_LAYER_PARTITION": rec.partition,
        "HYBRID_STAGE": str(rec.index),
        # position in what runs: differs from the plan's stage index when a strategy leaves stages out
        "HYBRID_PIPELINE_RANK": str(rec.rank),
        "HYBRID_PIPELINE_STAGES": str(rec.stages),
        "HYBRID_REPLICA": str(ident.replica),
        "HYBRID_STAGE_NAME": rec.name,
        "HYBRID_LAYER_RANGE": rec.layers,
        "VLLM_NO_USAGE_STATS": "1",
        # the first worker publishes its progress there; the launcher restarts the stage on a stall
        "HYBRID_PROGRESS_FILE": rec.progress_file,
        "HYBRID_STALL_TIMEOUT": f"{rec.stall_timeout:g},{rec.compile_grace:g}",
    })
    # whose vLLM patches the stage's processes apply besides the core ones (Strategy.patch_vllm); the stage's env may
    # name another for experiments (tests/runtime/test_pipeline_shapes.py: balanced's split on a CPU-only plan)
    env.setdefault(STRATEGY_ENV, rec.strategy)
    if rec.stages > 1:  # one batch in flight: micro-batches would make a CPU stage read its weights once each
        env.setdefault("HYBRID_BATCHES_IN_FLIGHT", "1")
    if plan.extra_args:  # vllm_entry refuses those that would replace what the launcher pins
        env["HYBRID_EXTRA_ARGS"] = json.dumps(list(plan.extra_args))
    # local runs put several stages on one host: they pass each stage its own metrics port
    env.setdefault("HYBRID_METRICS_PORT", str(plan.metrics_port))
    if rec.rank == 0 and rec.vocab:  # api_guard: vLLM lets a token id equal to the vocabulary's size through
        env["HYBRID_VOCAB_SIZE"] = str(rec.vocab)
    if ident.host_ip:
        env["VLLM_HOST_IP"] = ident.host_ip
    if Path(plan.model).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")
    if rec.device == "cpu":
        assert binding is not None
        env.update({
            "CUDA_VISIBLE_DEVICES": "",  # a CPU stage must not pick up a GPU on a shared node
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(rec.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": binding.omp_bind,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # the reserve is already left out of omp_bind
        })
        for key, value in THP_ENV.items():  # every strategy's CPU stage alike (the baselines too)
            env.setdefault(key, value)
        if not binding.pinned:  # "nobind": vLLM leaves the threads alone; size the pool to the request
            env["OMP_NUM_THREADS"] = str(binding.threads_per_rank)
        if binding.threads_per_rank == 1 and rec.tp == 1:
            # one worker of one thread: its OpenMP setup needs no fresh process (vllm_patches.cpu.patch_cpu_worker_fork)
            env.update({"HYBRID_FORK_WORKER": "1", "OMP_NUM_THREADS": "1"})
    env.update(rec.extras.env)
    for key, value in rec.extras.env_defaults:
        env.setdefault(key, value)
    if rec.extras.expect_offloader:
        # vLLM ignores offload flags it cannot honour (the V2 runner does): vllm_patches.worker.patch_check_offloader
        env["HYBRID_EXPECT_OFFLOADER"] = rec.extras.expect_offloader
    if rec.device == "cpu":
        # AMX CPUs: sgl-kernel GEMMs read the weights at 87% of DRAM bandwidth at batch 1 against oneDNN's
        # 73% (bench/results/cpu_kernels.json); oneDNN wins from batch ~64 and in prefill, where `auto`
        # streams to the GPU instead. vLLM ignores it where the CPU has no AMX. Overridable per stage.
        env.setdefault("VLLM_CPU_SGL_KERNEL", "1")
    return env


def numactl_prefix(binding: CpuBinding | None, numactl: str | None) -> list[str]:
    """Bind memory to the stage's NUMA node where the host has several and numactl exists."""
    if binding is None or binding.numa_node is None or not numactl:
        return []
    return [numactl, f"--membind={binding.numa_node}"]


def resolved_summary(plan: Plan, rec: StageRecord, ident: Identity, binding: CpuBinding | None,
                     env: dict[str, str]) -> dict:
    out = {"stage": rec.index, "name": rec.name, "device": rec.device, "replica": ident.replica,
           "stages": rec.stages, "layers": rec.layers, "strategy": rec.strategy,
           "partition": rec.partition, "tp": rec.tp, "master": f"{ident.master_addr}:{plan.master_port}",
           "role": rec.role, "model": plan.model, "stall_timeout_s": rec.stall_timeout}
    if rec.offload_gib:
        out["offload_gib"] = rec.offload_gib
    out.update(rec.extras.summary)
    if binding:
        out.update(cpus=binding_cpus(binding), numa_node=binding.numa_node, kv_cache_gib=rec.kv_cache_gib)
    else:
        out.update(gpu_memory_utilization=rec.gpu_memory_utilization,
                   cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES", "all"))
    return out


def binding_cpus(binding: CpuBinding) -> str:
    """The resolved record's cpus: the pinned cpulist(s), or the shared cpuset the threads float over."""
    if binding.pinned:
        return binding.omp_bind
    return f"unpinned: {binding.threads_per_rank} threads over {format_cpulist(binding.all_cpus)}"

