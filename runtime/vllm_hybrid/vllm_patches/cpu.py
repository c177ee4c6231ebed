"""CPU stages' start and memory: the KV check against system memory, compile without loading AOT artifacts,
forked engine core and worker, an eager masked-input op, vector-ISA probes remembered in the compile cache, and
W4A16 experts repacked by cpupod.int4_layout."""
from __future__ import annotations

import contextlib
import functools
import os


def patch_cpu_kv_memory_check() -> str | None:
    # vllm.v1.worker.cpu_worker.get_memory_node_info (from vllm.utils.cpu_resource_utils): the
    # KV-cache request is checked against the NUMA node's free memory. Some VMs report a synthetic,
    # tiny node figure while the system has plenty; opt-in (HYBRID_SYSTEM_MEMORY_CHECK=1)
    # to check against system-wide available memory instead.
    import psutil
    from vllm.utils import cpu_resource_utils
    from vllm.v1.worker import cpu_worker

    def get_memory_node_info(node_id: int = 0):
        vm = psutil.virtual_memory()
        return cpu_resource_utils.MemoryNodeInfo(total_memory=vm.total, available_memory=vm.available)

    cpu_worker.get_memory_node_info = get_memory_node_info
    return "cpu_worker.get_memory_node_info(system-wide)"


def patch_no_cpu_aot_load(decorators) -> str | None:
    # vllm.compilation.decorators._try_load_aot_compiled_fn: on CPU, 0.26's AOT artifact does not load back
    # ("'function' object has no attribute 'finalize_loading'") after ~35 s of deserializing (SmolLM2 on 2
    # cores), and vLLM compiles again anyway. Compiling straight away hits the inductor cache kept beside it
    # (spec.cache): a restarted stage's warm-up took 24 s on the real node, against 41 s with the failed
    # load and 92 s cold.
    decorators._try_load_aot_compiled_fn = lambda model, aot_compilation_path: None
    return "decorators._try_load_aot_compiled_fn(CPU: compile, do not load)"


def patch_cpu_int4_moe_repack(cpu_moe) -> str | None:
    """vllm.model_executor.layers.fused_moe.experts.cpu_moe.prepare_int4_moe_layer_for_cpu, which the CPU W4A16 MoE
    method imports when it post-processes a layer: GPTQ-layout experts (compressed-tensors' too) get the same bytes
    from cpupod.int4_layout. vLLM's op unpacks each stack to int32 expert by expert (about 45 MB/s a core): a CPU stage
    holding a 235B W4A16 model's experts would take many minutes to start; other layouts (AWQ) keep the op."""
    from ..cpupod import int4_layout
    upstream = cpu_moe.prepare_int4_moe_layer_for_cpu

    @functools.wraps(upstream)
    def prepare(w13, w2, w13_scale, w2_scale, quant_algo=cpu_moe.CPUQuantAlgo.GPTQ, w13_zeros=None, w2_zeros=None):
        return int4_layout.prepare_or(upstream, w13, w2, w13_scale, w2_scale, quant_algo, w13_zeros, w2_zeros)
    prepare.upstream = upstream
    cpu_moe.prepare_int4_moe_layer_for_cpu = prepare
    return "cpu_moe.prepare_int4_moe_layer_for_cpu(GPTQ layout: int4_layout)"


def _forking(get_mp_context):
    """A vLLM module's get_mp_context that runs upstream's (its checks, its environment for the workers it starts)
    and forks."""
    import multiprocessing

    def forking():
        get_mp_context()
        return multiprocessing.get_context("fork")
    return forking


def patch_cpu_engine_fork(engine_utils) -> str | None:
    """vllm.v1.engine.utils.get_mp_context, as CoreEngineProcManager calls it: fork the engine core on CPU.

    The CPU platform forces spawn so that each worker starts OpenMP with its own thread binding (read from
    the environment when libgomp loads). The engine core only schedules; it still spawns its workers, so
    they keep their binding, and forking it saves one fresh import of torch and vLLM on the path to ready
    (7 s of a stage's start on 2 cores)."""
    engine_utils.get_mp_context = _forking(engine_utils.get_mp_context)
    return "engine.utils.get_mp_context(CPU: fork the engine core)"


def patch_cpu_worker_fork(multiproc_executor) -> str | None:
    """vllm.v1.executor.multiproc_executor.get_mp_context and WorkerProc.worker_main: fork a CPU stage's one worker
    where it runs one OpenMP thread (the launcher sets HYBRID_FORK_WORKER and OMP_NUM_THREADS=1 for the stage).

    vLLM spawns CPU workers so that each loads libgomp with its own thread count and places from the environment.
    With one thread there is nothing to place but the worker itself, pinned here to its core as vLLM's OMP_PLACES
    would; and no OpenMP thread pool exists to be lost in the fork. Saves a fresh import of torch and vLLM on each
    stage's way to ready (7 s on 2 cores). Several threads or ranks: spawned, as upstream."""
    upstream_main = multiproc_executor.WorkerProc.worker_main
    core = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    def worker_main(*args, **kwargs):
        if core.isdigit():
            os.sched_setaffinity(0, {int(core)})
        return upstream_main(*args, **kwargs)

    multiproc_executor.get_mp_context = _forking(multiproc_executor.get_mp_context)
    multiproc_executor.WorkerProc.worker_main = staticmethod(worker_main)
    return "multiproc_executor.get_mp_context + WorkerProc.worker_main(CPU, one thread: fork the worker)"


def patch_cpu_masked_input(vocab_embedding) -> str | None:
    # vllm.model_executor.layers.vocab_parallel_embedding.get_masked_input_and_mask, torch.compile'd at import and
    # used only with tensor parallelism: on CPU every rank of a TP>1 stage compiled it with g++ at its first step,
    # all on one inductor file lock; in CI a rank once waited out that lock's 600 s while the engine hung. It is a
    # few pointwise ops on the token ids: eager on CPU, with no compile and no lock.
    compiled = vocab_embedding.get_masked_input_and_mask
    vocab_embedding.get_masked_input_and_mask = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    return "vocab_parallel_embedding.get_masked_input_and_mask(CPU: eager)"


def remember_vec_isa_checks(cache_root: str) -> str | None:
    # torch._inductor.cpu_vec_isa.VecISA.check_build: the first C++ compile of every process (vLLM's sampler
    # is torch.compile'd even with --enforce-eager) probes each vector ISA by loading a test library in a fresh
    # `python -c "import torch ..."`: 10 interpreters, 16 s of every CPU stage's start on 2 cores, cache or not.
    # The answer depends only on the CPU, the compiler and torch: keep it under the compile cache (a pod's
    # cache volume), so a restart asks once per node.
    import hashlib
    import platform

    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
    record = os.path.join(cache_root, "hybrid-vec-isa")
    check_build = cpu_vec_isa.VecISA.check_build
    cpu_flags = ",".join(cpu_vec_isa.x86_isa_checker()) if platform.machine() in ("x86_64", "AMD64") else ""
    machine = f"{platform.machine()}={cpu_flags}={get_compiler_version_info(get_cpp_compiler())}"

    @functools.wraps(check_build)
    def remembered_check_build(self, code: str) -> bool:
        key = hashlib.sha256(f"{machine}={self._arch_flags}={code}".encode()).hexdigest()[:32]
        path = os.path.join(record, f"{key}-{cpu_vec_isa.torch.__version__}")
        with contextlib.suppress(OSError):
            return open(path).read() == "1"
        ok = check_build(self, code)
        with contextlib.suppress(OSError):  # a read-only cache only costs the probe again
            os.makedirs(record, exist_ok=True)
            with open(f"{path}.{os.getpid()}", "w") as f:
                f.write("1" if ok else "0")
            os.replace(f"{path}.{os.getpid()}", path)  # whole or absent: processes of a group start at once
        return ok

    cpu_vec_isa.VecISA.check_build = remembered_check_build
    return f"VecISA.check_build(remembered in {record})"
