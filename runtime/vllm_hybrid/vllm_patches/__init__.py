"""Every change this project makes to vLLM 0.26.0 that every hybrid stage needs, by what it changes (distributed,
worker, loading, cpu, process); a strategy's own changes live in its folder (strategies/<name>/patches.py) and are
applied through its Strategy.patch_vllm.

Each patch names the upstream function it replaces and why, and returns what it changed (None: nothing here). The
plugin (vllm_hybrid.plugin) applies them in every vLLM process of a hybrid pipeline, before any process group
exists.
"""
from __future__ import annotations

import os

from .cpu import (
    patch_cpu_engine_fork,
    patch_cpu_int4_moe_repack,
    patch_cpu_kv_memory_check,
    patch_cpu_masked_input,
    patch_cpu_worker_fork,
    patch_no_cpu_aot_load,
    remember_vec_isa_checks,
)
from .distributed import (
    patch_cuda_dist_backend,
    patch_pp_group_without_device_communicator,
    patch_pp_recv_to_device,
    patch_pp_send_via_host,
    patch_response_queue_locality,
)
from .loading import patch_dummy_weights_once, patch_loading_keeps_host_storage, patch_prefetch_empty_params
from .process import die_with_parent, journal_shm_names
from .worker import (
    patch_batches_in_flight,
    patch_check_offloader,
    patch_pad_received_activations,
    patch_worker_step_metrics,
)

APPLIED: list[str] = []


def apply_all() -> list[str]:
    if APPLIED:
        return APPLIED  # plugins may be loaded several times in one process
    done = [die_with_parent()]
    if journal := os.environ.get("HYBRID_SHM_JOURNAL"):
        done.append(journal_shm_names(journal))
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    done += [patch_cuda_dist_backend(current_platform), patch_pp_group_without_device_communicator(parallel_state),
             patch_pp_send_via_host(parallel_state), patch_pp_recv_to_device(parallel_state)]
    from vllm.config import vllm as config_vllm
    from vllm.model_executor.model_loader import dummy_loader
    from vllm.v1.executor import multiproc_executor
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    done += [patch_response_queue_locality(multiproc_executor), patch_batches_in_flight(config_vllm),
             patch_dummy_weights_once(dummy_loader), patch_worker_step_metrics(gpu_worker),
             patch_pad_received_activations(gpu_model_runner)]
    if not current_platform.is_cpu():
        from vllm.model_executor.model_loader import utils as loader_utils
        from vllm.model_executor.offloader import prefetch
        done += [patch_loading_keeps_host_storage(loader_utils), patch_prefetch_empty_params(prefetch)]
    if os.environ.get("HYBRID_EXPECT_OFFLOADER"):
        done.append(patch_check_offloader(gpu_worker))
    if current_platform.is_cpu():
        import vllm.envs
        from vllm.compilation import decorators
        from vllm.model_executor.kernels import linear as linear_kernels
        from vllm.model_executor.layers import vocab_parallel_embedding
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.v1.engine import utils as engine_utils

        from .cpu_fp8 import patch_cpu_fp8_channel_kernel
        done += [remember_vec_isa_checks(vllm.envs.VLLM_CACHE_ROOT), patch_no_cpu_aot_load(decorators),
                 patch_cpu_masked_input(vocab_parallel_embedding), patch_cpu_engine_fork(engine_utils),
                 patch_cpu_int4_moe_repack(cpu_moe), patch_cpu_fp8_channel_kernel(linear_kernels)]
        if os.environ.get("HYBRID_FORK_WORKER") == "1":
            done.append(patch_cpu_worker_fork(multiproc_executor))
        if os.environ.get("HYBRID_SYSTEM_MEMORY_CHECK") == "1":
            done.append(patch_cpu_kv_memory_check())
    from ..strategies import STRATEGY_ENV, get  # the stage's resolved strategy: its patches apply too
    if name := os.environ.get(STRATEGY_ENV):
        done += get(name).patch_vllm()
    APPLIED.extend(d for d in done if d)
    from vllm.logger import init_logger
    init_logger("vllm.hybrid.patches").info("vllm_hybrid patches applied (pid %d): %s", os.getpid(), ", ".join(APPLIED))
    return APPLIED
