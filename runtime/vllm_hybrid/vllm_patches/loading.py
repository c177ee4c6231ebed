"""Loading weights: dummy weights filled once (large CPU tensors tiled), and processed CPU weights kept in their
own host storage (the offloader's, or a CPU pod's region)."""
from __future__ import annotations

import contextlib
import functools

from .distributed import swapped


def patch_dummy_weights_once(dummy_loader) -> str | None:
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

        with swapped(dummy_loader, "initialize_dummy_weights", once):
            return original_load(self, model, model_config)

    cls.load_weights = load_weights
    return "DummyModelLoader.load_weights(fill each tensor once, large CPU ones tiled)"


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


def patch_loading_keeps_host_storage(loader_utils) -> str | None:
    # vllm.model_executor.model_loader.utils.device_loading_context: weight processing moves a module's
    # CPU parameters (the prefetch offloader's pinned copies) to the GPU and back into new pageable
    # tensors, which the offloader re-pins only in its post_init: until then every streamed weight has
    # two host copies (a 70B shape's 65 GB streamed did not fit a 125 GiB host). Copy the processed
    # values back into the parameter's own host storage at once (coprocessor: the CPU pod's region); a
    # weight processed into its transpose (CUTLASS's int8 and FP8 layouts: weight.t()) goes back as the
    # transpose of its own storage.
    original = loader_utils.device_loading_context

    @contextlib.contextmanager
    def device_loading_context(module, target_device):
        before = {name: p.data for name, p in module.named_parameters() if p.device.type == "cpu"}
        with original(module, target_device) as m:
            yield m
        for name, p in module.named_parameters():
            own = before.get(name)
            if own is None or p.device.type != "cpu" or p.data.data_ptr() == own.data_ptr() or p.dtype != own.dtype:
                continue
            if p.data.shape == own.shape and p.data.stride() == own.stride():
                own.copy_(p.data)
                p.data = own
            elif p.ndim == 2 and p.data.t().shape == own.shape and p.data.t().stride() == own.stride():
                own.copy_(p.data.t())
                p.data = own.t()

    loader_utils.device_loading_context = device_loading_context
    return "device_loading_context(processed CPU weights back into their own host storage)"


def patch_prefetch_empty_params(prefetch) -> str | None:
    # vllm.model_executor.offloader.prefetch._ModuleOffloader.start_onload_to_static asserts that each streamed
    # parameter's host copy is pinned, and a zero-element one cannot be (torch pins no allocation): a W4A16 MoE's g_idx
    # without act-order. An H200 lease's Qwen3-235B W4A16 under strategy offload stopped at start on
    # `w13_weight_g_idx is not pinned`. Once its (empty) GPU buffer is assigned such a parameter has nothing to copy:
    # its offloader is dropped there, as upstream's open fix skips it (vllm-project/vllm#47380).
    cls = prefetch._ModuleOffloader
    original = cls.assign_buffer_slot

    @functools.wraps(original)
    def assign_buffer_slot(self, pool, slot_idx):
        original(self, pool, slot_idx)
        for name in [n for n, o in self._param_offloaders.items()
                     if getattr(o, "_cpu_storage", None) is not None and o._cpu_storage.numel() == 0]:
            del self._param_offloaders[name]

    cls.assign_buffer_slot = assign_buffer_slot
    return "_ModuleOffloader.assign_buffer_slot(empty parameters: nothing to stream)"
