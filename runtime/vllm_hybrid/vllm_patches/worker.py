"""The workers and runners of every stage: received activations padded to the batch, one batch in flight, the
stage's step metrics and progress, and a check that vLLM really offloads where a strategy asked it to."""
from __future__ import annotations

import functools
import os

from .. import progress, stage_metrics


def patch_pad_received_activations(gpu_model_runner) -> str | None:
    # vllm.v1.worker.gpu_model_runner.GPUModelRunner.sync_and_gather_intermediate_tensors: a CUDA
    # stage pads each batch to a CUDA-graph size (3 tokens -> 4) and copies that many rows of the
    # received activations; a CPU stage before it sends the unpadded batch, so the copy fails
    # ("size of tensor a (4) must match ... (3)"). Pad what arrived with zero rows; padded
    # positions' outputs are discarded anyway.
    cls = gpu_model_runner.GPUModelRunner
    original = cls.sync_and_gather_intermediate_tensors

    @functools.wraps(original)
    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if sync_self and intermediate_tensors is not None:
            import torch
            for k, v in list(intermediate_tensors.tensors.items()):
                if v.shape[0] < num_tokens:
                    pad = v.new_zeros((num_tokens - v.shape[0], *v.shape[1:]))
                    intermediate_tensors.tensors[k] = torch.cat([v, pad])
        return original(self, num_tokens, intermediate_tensors, sync_self)

    cls.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
    return "GPUModelRunner.sync_and_gather_intermediate_tensors(pad short batches)"


def patch_batches_in_flight(config_vllm) -> str | None:
    # vllm.config.vllm.VllmConfig.max_concurrent_batches: with pipeline parallelism the engine keeps
    # pp_size batches in flight, so the running requests are split into micro-batches that take turns.
    # A CPU stage is bound by reading its weights, which costs the same for 2 sequences as for 20:
    # two half batches read them twice per token (concurrency 4 ran at half the speed of one batch).
    # HYBRID_BATCHES_IN_FLIGHT (the launcher sets 1) caps it.
    cap = int(os.environ.get("HYBRID_BATCHES_IN_FLIGHT", "0"))
    if cap < 1:
        return
    cls = config_vllm.VllmConfig
    original = cls.max_concurrent_batches

    cls.max_concurrent_batches = property(lambda self: min(cap, original.fget(self)), doc=original.__doc__)
    return f"VllmConfig.max_concurrent_batches(<= {cap})"


def patch_worker_step_metrics(gpu_worker) -> str | None:
    # vllm.v1.worker.gpu_worker.Worker.initialize_from_config / execute_model (CPUWorker inherits
    # both): time every step and count its tokens for the per-stage metrics (stage_metrics), publish
    # the stage's progress for the launcher's stall watch (progress), and start both once the KV
    # cache (its block count) exists, i.e. after the weights loaded.
    cls = gpu_worker.Worker
    init_original, step_original = cls.initialize_from_config, cls.execute_model

    @functools.wraps(init_original)
    def initialize_from_config(self, kv_cache_config):
        out = init_original(self, kv_cache_config)
        from vllm.distributed import get_tp_group
        rank = get_tp_group().rank_in_group
        progress.start(rank)
        stage_metrics.start(kv_cache_config.num_blocks, self.device.type, rank)
        return out

    @functools.wraps(step_original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        m, p = stage_metrics.current(), progress.current()
        if p is not None:
            p.step_started(scheduler_output)
        if m is None or not scheduler_output.total_num_scheduled_tokens:
            out = step_original(self, scheduler_output, *args, **kwargs)
            if m is not None:
                m.track_blocks(scheduler_output)  # an empty step brings the finished requests' ids
        else:
            t0 = m.begin_step()
            out = step_original(self, scheduler_output, *args, **kwargs)
            m.end_step(t0, scheduler_output)
        if p is not None:
            p.step_finished()
        return out

    cls.initialize_from_config, cls.execute_model = initialize_from_config, execute_model
    return "Worker.execute_model(stage metrics)"


def patch_check_offloader(gpu_worker) -> str | None:
    # vllm.v1.worker.gpu_worker.Worker.load_model: vLLM 0.26 silently ignores offload flags it cannot
    # honour (Model Runner V2 ignores --offload-group-size and --cpu-offload-gb and keeps every weight
    # on the GPU). When the launcher streams weights, fail at start, naming what runs instead.
    from vllm.model_executor.offloader.base import get_offloader
    cls = gpu_worker.Worker
    original = cls.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        wanted, running = os.environ["HYBRID_EXPECT_OFFLOADER"], type(get_offloader()).__name__
        if running != wanted:
            raise RuntimeError(f"strategy offload: vLLM runs {running}, not {wanted}: the layers meant to be "
                               "streamed from host memory stay on the GPU (Model Runner V2 ignores vLLM's "
                               "offload flags, VLLM_USE_V2_MODEL_RUNNER must be 0; or the size to offload is 0)")
        return out

    cls.load_model = load_model
    return f"Worker.load_model(check offloader is {os.environ['HYBRID_EXPECT_OFFLOADER']})"
