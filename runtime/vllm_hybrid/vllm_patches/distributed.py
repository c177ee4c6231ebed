"""vLLM's pipeline hop between a CUDA process and a CPU process: gloo process groups, the pp group
without a device communicator, activations sent via host memory and moved to the receiver's device, and the
response queues of a node that is one stage."""
from __future__ import annotations

import contextlib
import functools
import time

from .. import stage_metrics


def _nbytes(tensor_dict) -> int:
    return sum(v.numel() * v.element_size() for v in tensor_dict.values() if hasattr(v, "element_size"))


class _TimedRecv:
    """A receive handle whose wait() is timed: the time a stage waits for the previous one."""

    def __init__(self, handle, metrics, nbytes):
        self.handle, self.metrics, self.nbytes = handle, metrics, nbytes

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.handle.wait(*args, **kwargs)
        self.metrics.transfer("recv", self.nbytes, time.perf_counter() - t0)
        return out


@contextlib.contextmanager
def swapped(module, name: str, value):
    """A module global replaced for the duration of one upstream call."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _is_pp(group) -> bool:
    return group.unique_name.startswith("pp")


def patch_cuda_dist_backend(platform) -> str | None:
    # vllm.platforms.cuda.CudaPlatform.dist_backend ("nccl"): the world and pipeline groups span
    # CUDA and CPU processes, so every process must create them with the CPU platform's gloo.
    # Tensor-parallel traffic inside a CUDA stage still goes through PyNccl (CudaCommunicator).
    if platform.is_cuda_alike():
        type(platform).dist_backend = "gloo"
        return "CudaPlatform.dist_backend=gloo"


def patch_pp_group_without_device_communicator(parallel_state) -> str | None:
    # vllm.distributed.parallel_state.init_model_parallel_group: the "pp" group must be built
    # without a device communicator. Otherwise the CUDA side initialises NCCL while the CPU side
    # waits in a gloo all-gather for its shared-memory communicator, and they never meet; between
    # CPU pods without a shared /dev/shm the SHM communicator would not work either.
    original = parallel_state.init_model_parallel_group

    @functools.wraps(original)
    def init_model_parallel_group(group_ranks, local_rank, backend, use_message_queue_broadcaster=False,
                                  group_name=None, use_device_communicator=True):
        if group_name == "pp":
            use_device_communicator = False
        return original(group_ranks, local_rank, backend, use_message_queue_broadcaster=use_message_queue_broadcaster,
                        group_name=group_name, use_device_communicator=use_device_communicator)

    parallel_state.init_model_parallel_group = init_model_parallel_group
    return "init_model_parallel_group(pp: no device communicator)"


def patch_pp_send_via_host(parallel_state) -> str | None:
    # vllm.distributed.parallel_state.GroupCoordinator.isend_tensor_dict: upstream sends CUDA
    # tensors over the (NCCL) device group and tells the receiver to allocate them on the sender's
    # device. Across a CUDA->CPU hop we copy to host memory so the tensors travel over gloo and
    # the receiver allocates them on CPU; and we skip the TP all-gather split (the receiving stage
    # may run a different device communicator), so each TP rank sends its full tensors.
    cls = parallel_state.GroupCoordinator
    original = cls.isend_tensor_dict

    @functools.wraps(original)
    def isend_tensor_dict(self, tensor_dict, dst=None, all_gather_group=None, all_gather_tensors=None):
        if not _is_pp(self):
            return original(self, tensor_dict, dst, all_gather_group, all_gather_tensors)
        t0 = time.perf_counter()
        host = {k: (v.to("cpu") if hasattr(v, "is_cpu") and not v.is_cpu else v) for k, v in tensor_dict.items()}
        handles = original(self, host, dst, None, None)
        # gloo send of host copies: wait here so the copies outlive the transfer.
        for h in handles:
            h.wait()
        if (m := stage_metrics.current()) is not None:
            m.transfer("send", _nbytes(host), time.perf_counter() - t0)
        return []

    cls.isend_tensor_dict = isend_tensor_dict
    return "GroupCoordinator.isend_tensor_dict(pp: via host)"


def patch_pp_recv_to_device(parallel_state) -> str | None:
    # vllm.distributed.parallel_state.GroupCoordinator.irecv_tensor_dict: what arrives over the
    # pipeline is always host memory now (see isend above); a CUDA stage moves it onto its GPU
    # once the receive completes (CPU->GPU hop). No TP all-gather, matching the sender.
    cls = parallel_state.GroupCoordinator
    original = cls.irecv_tensor_dict

    @functools.wraps(original)
    def irecv_tensor_dict(self, src=None, all_gather_group=None, all_gather_tensors=None):
        if not _is_pp(self):
            return original(self, src, all_gather_group, all_gather_tensors)
        t0 = time.perf_counter()
        tensor_dict, handles, postprocess = original(self, src, None, None)
        if tensor_dict is not None and (m := stage_metrics.current()) is not None:
            # the metadata arrives synchronously in that call: it is most of the wait for the previous stage
            m.transfer("recv", 0, time.perf_counter() - t0)
            handles = [_TimedRecv(h, m, _nbytes(tensor_dict) if i == 0 else 0) for i, h in enumerate(handles)]
        if tensor_dict is not None and self.device.type != "cpu":
            def to_device(d=tensor_dict, device=self.device):
                for k, v in d.items():
                    if hasattr(v, "is_cpu") and v.is_cpu:
                        d[k] = v.to(device)
            postprocess = [*postprocess, to_device]
        return tensor_dict, handles, postprocess

    cls.irecv_tensor_dict = irecv_tensor_dict
    return "GroupCoordinator.irecv_tensor_dict(pp: host -> device)"


def patch_response_queue_locality(multiproc_executor) -> str | None:
    # vllm.v1.executor.multiproc_executor.WorkerProc._init_message_queues: with nnodes > 1 each
    # worker's response queue comes from MessageQueue.create_from_process_group_single_reader,
    # which counts a node as current_platform.device_count() ranks. That is 1 on a CPU stage, so
    # with tensor parallelism the head's local TP ranks look remote, get no local queue, and the
    # executor fails (`assert local_message_queue is not None`). A node is local_world_size ranks
    # (the stage's TP size, the same on every stage); tell that function so for this one call.
    from vllm.distributed.device_communicators import shm_broadcast
    cls = multiproc_executor.WorkerProc
    original = cls._init_message_queues

    class _NodeSized:
        def __init__(self, platform, ranks_per_node):
            self._platform, self._ranks_per_node = platform, ranks_per_node

        def device_count(self):
            return self._ranks_per_node

        def __getattr__(self, name):
            return getattr(self._platform, name)

    @functools.wraps(original)
    def _init_message_queues(self, input_shm_handle, vllm_config):
        node = _NodeSized(shm_broadcast.current_platform, vllm_config.parallel_config.local_world_size)
        with swapped(shm_broadcast, "current_platform", node):
            return original(self, input_shm_handle, vllm_config)

    cls._init_message_queues = _init_message_queues
    return "WorkerProc._init_message_queues(node = local_world_size ranks)"
