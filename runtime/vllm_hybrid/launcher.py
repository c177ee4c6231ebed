"""Turns the pipeline plan + this pod's identity into the vLLM invocation for one stage (pure)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .cpubind import CpuBinding, format_cpulist
from .plan import Plan, PlanError
from .planner import COPROC_PREFETCH_STEP, HELPER_CONTEXT, GiB, Split
from .strategy import Layout, hardware_of, layout, prefetch_groups, slowest_step_s, split_rates

GPU_VLLM_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # the V2 runner's pipeline path does not go through our hop patches
}


@dataclass(frozen=True)
class Identity:
    stage: int
    replica: int
    master_addr: str
    host_ip: str | None


def identity_from_env(env: dict[str, str], stage: int | None = None, replica: int | None = None) -> Identity:
    """Pod identity: explicit arguments win, then HYBRID_* variables (set by the operator)."""
    def number(value, name):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise PlanError(f"{name}: expected a stage/replica index, got {value!r}") from None

    if stage is None:
        if "HYBRID_STAGE" not in env:
            raise PlanError("stage: pass --stage N or set HYBRID_STAGE")
        stage = number(env["HYBRID_STAGE"], "HYBRID_STAGE")
    if replica is None:
        replica = number(env.get("HYBRID_REPLICA", "0"), "HYBRID_REPLICA")
    master = env.get("HYBRID_MASTER_ADDR", "127.0.0.1").replace("{replica}", str(replica))
    return Identity(stage, replica, master, env.get("HYBRID_HOST_IP") or None)


def cpu_kv_cache_gib(plan: Plan, split: Split, stage: int, env: dict[str, str] | None = None) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB): the stage's budget after its weights, at least 1; a value in the
    stage's env (spec.stages[].env) wins, as vLLM's own setting: the user owns what it costs."""
    override = (env or {}).get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if override:
        if not override.isdigit() or int(override) < 1:
            raise PlanError(f"VLLM_CPU_KVCACHE_SPACE: expected whole GiB (at least 1), got {override!r}")
        return int(override)
    return max(1, split.stages[stage].kv_bytes // GiB)


def gemm_socket(env: dict[str, str], replica: int, gpu_stage: int) -> str:
    """Where GPU stage `gpu_stage`'s GEMM helper listens: the replica's shared /dev/shm."""
    name = f"hybrid-{env.get('HYBRID_INSTANCE', 'local')}-r{replica}-s{gpu_stage}.gemm"
    return os.path.join(env.get("HYBRID_SHM_DIR", "/dev/shm"), name)


def coproc_socket(env: dict[str, str], replica: int, cpu_stage: int) -> str:
    """Where cpu stage `cpu_stage`'s product server listens (coprocessor): the replica's shared /dev/shm."""
    name = f"hybrid-{env.get('HYBRID_INSTANCE', 'local')}-r{replica}-s{cpu_stage}.coproc"
    return os.path.join(env.get("HYBRID_SHM_DIR", "/dev/shm"), name)


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
    return default_timeouts(slowest_step_s(plan, split, lay or layout(plan, split, "pipeline")))


OFFLOADERS = {"prefetch": "PrefetchOffloader", "uva": "UVAOffloader"}  # plan.offload_backend -> vLLM's class


@dataclass(frozen=True)
class StageRecord:
    """One stage of one replica, resolved once from the plan, the layer split and the strategy's layout:
    the launcher only renders it into vLLM's argv and env and the GEMM helper's command."""
    index: int                     # in the plan
    rank: int                      # in what runs (a strategy may leave stages out)
    stages: int                    # how many run
    name: str
    device: str
    tp: int
    strategy: str
    partition: str                 # VLLM_PP_LAYER_PARTITION
    layers: str                    # this stage's layer range
    offload_flags: tuple[str, ...]  # vLLM's flags for the weights it streams (offload)
    offload_gib: float
    expect_offloader: str | None   # the offloader class vLLM must report (patches.patch_check_offloader)
    split_with: int | None         # balanced, cpu stage: the gpu stage whose helper splits its GEMMs
    split_socket: str | None       # and where that helper listens
    split_rates: str | None
    helper_for: tuple[int, ...]    # balanced, gpu stage: the cpu stages its helper serves
    helper_socket: str | None      # and where it listens
    helper_reserve_bytes: int      # and the GPU memory it takes before vLLM starts (planner.helper_gpu_bytes)
    coproc_socket: str | None      # coprocessor, gpu stage: its cpu stage's product server
    coproc_bytes: int              # and the bytes of streamed weights that live in the server's region
    kv_cache_gib: int | None       # cpu stages: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float | None  # gpu stages: vLLM's share, less what runs beside it (the helper)
    stall_timeout: float
    compile_grace: float
    progress_file: str

    @property
    def role(self) -> str:
        return "api" if self.rank == 0 else "headless"


def resolve_stage(plan: Plan, split: Split, ident: Identity, env: dict[str, str], lay: Layout | None = None) -> StageRecord:
    lay = lay or layout(plan, split, "pipeline")
    stage, rank = plan.stages[ident.stage], lay.stages.index(ident.stage)
    flags: tuple[str, ...] = ()
    streamed = lay.offload_bytes[rank]
    servers = [cpu for cpu, gpu in lay.servers if gpu == ident.stage]
    if streamed and (plan.offload_backend == "prefetch" or servers):
        count = round(streamed / split.shape.layer_bytes)
        group, in_group = prefetch_groups(lay.layers[rank], count)
        # vLLM's offloader puts streamed layer i in buffer slot i % step and prefetches (i + step) % count:
        # unless step divides count, the prefetch across steps overwrites a slot a later layer still needs
        step = COPROC_PREFETCH_STEP if servers and count % COPROC_PREFETCH_STEP == 0 else 1
        flags = ("--offload-group-size", str(group), "--offload-num-in-group", str(in_group),
                 "--offload-prefetch-step", str(step))
    elif streamed:
        # per GPU: vLLM offloads this much of each tensor-parallel rank's weights
        # (6 significant digits: a small model's layers round to 0.00 GiB, which vLLM takes as no offload)
        flags = ("--cpu-offload-gb", f"{streamed / GiB / stage.tensor_parallel:.6g}")
    split_with, helper_for = lay.helper_of(ident.stage), tuple(lay.helped_by(ident.stage))
    timeout, grace = stall_timeouts(plan, split, lay)
    return StageRecord(
        index=ident.stage, rank=rank, stages=len(lay.stages), name=stage.name, device=stage.device,
        tp=stage.tensor_parallel, strategy=lay.strategy, partition=lay.partition, layers=lay.ranges()[ident.stage],
        offload_flags=flags, offload_gib=round(streamed / GiB, 2),
        expect_offloader=OFFLOADERS["prefetch" if servers else plan.offload_backend] if streamed else None,
        split_with=split_with,
        split_socket=gemm_socket(env, ident.replica, split_with) if split_with is not None else None,
        split_rates=split_rates(hardware_of(plan), stage.cpus or 1).encode() if split_with is not None else None,
        helper_for=helper_for,
        helper_socket=gemm_socket(env, ident.replica, ident.stage) if helper_for else None,
        helper_reserve_bytes=max(0, split.stages[ident.stage].beside_vllm_bytes - HELPER_CONTEXT) if helper_for else 0,
        # one server per gpu stage for now: the offloader streams from one region
        coproc_socket=coproc_socket(env, ident.replica, servers[0]) if servers else None,
        coproc_bytes=streamed + (64 << 20) if servers else 0,  # + norms and alignment
        kv_cache_gib=cpu_kv_cache_gib(plan, split, ident.stage, env) if stage.is_cpu else None,
        gpu_memory_utilization=None if stage.is_cpu else split.stages[ident.stage].gpu_memory_utilization,
        stall_timeout=timeout, compile_grace=grace, progress_file=progress_file(env, ident.replica, ident.stage))


def helper_command(rec: StageRecord, python: str = sys.executable) -> list[str] | None:
    """balanced: a GPU stage whose GPU computes part of CPU stages' GEMMs also runs the GEMM helper."""
    if rec.helper_socket is None:
        return None
    # it takes its GPU memory before vLLM starts: vLLM counts memory another process takes while it profiles
    # as its own overhead (a helper connecting then left a 70B shape's GPU stage no KV cache)
    reserve = ("--reserve-bytes", str(rec.helper_reserve_bytes)) if rec.helper_reserve_bytes else ()
    return [python, "-m", "vllm_hybrid.gemm_helper", "--socket", rec.helper_socket, "--device", "cuda", *reserve]


def server_command(socket_path: str, metrics_port: int, python: str = sys.executable) -> list[str]:
    """coprocessor, cpu stage: the product server instead of vLLM."""
    return [python, "-m", "vllm_hybrid.coproc", "--socket", socket_path, "--metrics-port", str(metrics_port)]


def server_env(binding: CpuBinding, base: dict[str, str], stage: int, name: str) -> dict[str, str]:
    """Its torch threads one per core of the stage's binding (libgomp places thread i on the i-th CPU)."""
    # OMP_WAIT_POLICY=ACTIVE made each product 8 ms instead of 1.3 (the server's own thread spins too;
    # bench/results/coproc_probe.json): passive, whatever the image sets
    env = dict(base, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(binding.threads_per_rank), OMP_WAIT_POLICY="PASSIVE",
               HYBRID_STAGE=str(stage), HYBRID_STAGE_NAME=name)
    if binding.pinned:
        env["GOMP_CPU_AFFINITY"] = binding.omp_bind.replace(",", " ")
    return env


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
            "--distributed-executor-backend", "mp",
            # sampled tokens would travel over the pipeline's device group under async scheduling
            "--no-async-scheduling"]
    if rec.stages > 1:
        argv += ["--nnodes", str(rec.stages), "--node-rank", str(rec.rank),
                 "--master-addr", ident.master_addr, "--master-port", str(plan.master_port)]
    if plan.revision:
        argv += ["--revision", plan.revision]
    if not stage.is_cpu:
        argv += ["--gpu-memory-utilization", str(rec.gpu_memory_utilization), *rec.offload_flags]
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
    # one batch in flight: micro-batches would make a CPU stage read its weights once per micro-batch
    env.setdefault("HYBRID_BATCHES_IN_FLIGHT", "1")
    # local runs put several stages on one host: they pass each stage its own metrics port
    env.setdefault("HYBRID_METRICS_PORT", str(plan.metrics_port))
    if ident.host_ip:
        env["VLLM_HOST_IP"] = ident.host_ip
    if Path(plan.model).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")
    if rec.coproc_socket:
        # coprocessor: the streamed layers' weights live in that server's region (patches.patch_coprocessor)
        env["HYBRID_COPROC_SOCKET"] = rec.coproc_socket
        env["HYBRID_COPROC_BYTES"] = str(rec.coproc_bytes)
    if rec.expect_offloader:
        # vLLM ignores offload flags it cannot honour (the V2 runner does): patches.patch_check_offloader
        env["HYBRID_EXPECT_OFFLOADER"] = rec.expect_offloader
    if rec.device == "cpu":
        assert binding is not None
        env.update({
            "CUDA_VISIBLE_DEVICES": "",  # a CPU stage must not pick up a GPU on a shared node
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(rec.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": binding.omp_bind,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # the reserve is already left out of omp_bind
        })
        if not binding.pinned:  # "nobind": vLLM leaves the threads alone; size the pool to the request
            env["OMP_NUM_THREADS"] = str(binding.threads_per_rank)

        if rec.split_socket:
            # balanced: this stage's GEMMs are split with that GPU stage's helper (patches.patch_split_gemm)
            env["HYBRID_GEMM_SOCKET"] = rec.split_socket
            env.setdefault("HYBRID_SPLIT_RATES", rec.split_rates)
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
    if rec.split_with is not None:
        out["gemm_split_with"] = rec.split_with
    if rec.helper_for:
        out["gemm_helper_for"] = list(rec.helper_for)
    if rec.coproc_socket:
        out["coprocessor"] = rec.coproc_socket
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


def which(name: str) -> str | None:
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None
