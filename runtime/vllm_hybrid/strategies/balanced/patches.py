"""strategy balanced's changes to vLLM, in a cpu stage's worker: its linear layers' products split with the GEMM
helper, the weights loaded into the region shared with it."""
from __future__ import annotations

import functools
import os

from .io import SOCKET_ENV


def patch_split_gemm(layer_utils, cpu_model_runner) -> str | None:
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
    return ("dispatch_cpu_unquantized_gemm + CPUModelRunner.load_model + initialize_model"
                   "(split GEMMs with the GPU, weights loaded into the shared region)")


def apply() -> list[str]:
    """In a cpu stage's worker that splits its products with a GEMM helper (the launcher gives it the socket)."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu() or not os.environ.get(SOCKET_ENV):
        return []
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.v1.worker import cpu_model_runner
    return [patch_split_gemm(layer_utils, cpu_model_runner)]
