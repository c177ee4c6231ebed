"""strategy experts' changes to vLLM, in the main stage's worker: the remote experts loaded into the CPU pod's
region and computed there (client.py)."""
from __future__ import annotations

import collections
import functools
import os

from .io import BYTES_ENV, REMOTE_ENV, SERVED_FORMATS, SOCKET_ENV, UVA_SHARE_ENV, parse_placement


def quantized_roles(layer) -> tuple[str, dict[str, str]]:
    """The CPU pod's format (quantized.FORMATS) for a quantized MoE layer's experts and which of the layer's
    parameters is which of its roles (w13, w2, w13_scale, w2_scale); NotImplementedError naming what it is
    otherwise (the start fails: nothing is computed in a format the CPU pod would read wrongly)."""
    method = layer.quant_method
    kind = type(method).__name__
    weight = getattr(method, "weight_quant", None)
    if kind in ("Fp8MoEMethod", "CompressedTensorsW8A8Fp8MoEMethod") and method.block_quant:
        if list(method.weight_block_size) == [128, 128]:
            scale = "weight_scale_inv" if kind == "Fp8MoEMethod" else "weight_scale"
            return "fp8-block", {"w13": "w13_weight", "w2": "w2_weight", "w13_scale": f"w13_{scale}",
                                 "w2_scale": f"w2_{scale}"}
        what = f"FP8 in {list(method.weight_block_size)} blocks"
    elif kind in ("CompressedTensorsWNA16MoEMethod", "CompressedTensorsWNA16MarlinMoEMethod"):
        order = getattr(method.actorder, "value", method.actorder)
        if method.num_bits == 4 and weight.symmetric and order in (None, "static"):
            return "w4a16", {"w13": "w13_weight_packed", "w2": "w2_weight_packed", "w13_scale": "w13_weight_scale",
                             "w2_scale": "w2_weight_scale"}
        what = (f"W{method.num_bits}A16 {'symmetric' if weight.symmetric else 'with zero points'}"
                + (f", activation order {order} (the CPU kernel takes no g_idx)" if order not in (None, "static") else ""))
    elif kind == "AutoGPTQMoEMethod":
        config = method.quant_config
        # symmetric (uint4b8): as vLLM's own CPU preparation of it, the stored zero points are not read
        if config.quant_type.size_bits == 4 and not config.desc_act:
            return "w4a16", {"w13": "w13_qweight", "w2": "w2_qweight", "w13_scale": "w13_scales",
                             "w2_scale": "w2_scales"}
        what = f"GPTQ {config.quant_type.size_bits}-bit" + (" with act-order (desc_act)" if config.desc_act else "")
    elif kind == "AutoAWQMoEMethod":  # 4-bit only (AutoAWQConfig refuses others); zero points read
        return "w4a16-awq", {"w13": "w13_qweight", "w2": "w2_qweight", "w13_scale": "w13_scales",
                             "w2_scale": "w2_scales", "w13_zeros": "w13_qzeros", "w2_zeros": "w2_qzeros"}
    elif kind == "GptOssMxfp4MoEMethod":  # biased experts, gpt-oss's clamped SwiGLU (quantized.GPT_OSS_SWIGLU)
        return "mxfp4", {"w13": "w13_weight", "w2": "w2_weight", "w13_scale": "w13_weight_scale",
                         "w2_scale": "w2_weight_scale", "w13_bias": "w13_bias", "w2_bias": "w2_bias"}
    elif kind == "CompressedTensorsW8A8Int8MoEMethod":
        return "int8", {"w13": "w13_weight", "w2": "w2_weight", "w13_scale": "w13_weight_scale",
                        "w2_scale": "w2_weight_scale"}
    else:
        what = kind
    raise NotImplementedError(f"strategy experts: {layer.layer_name}: {what} experts are not computed by the CPU "
                              f"pod (it computes {SERVED_FORMATS})")


def keep_shadows(layer, shadow_params: dict) -> None:
    """A quantized layer's shadow parameters (its remote experts', in the CPU pod's region) by name. Not beside the
    layer's own parameters: its quant method's post-processing replaces those (Marlin's repack, vLLM's CPU
    preparation), and a reference kept here kept the old ones alive (a 235B W4A16 main stage held its 32 GiB of
    local experts twice)."""
    layer._hybrid_shadow = shadow_params


def shadow_of(layer, param):
    """The shadow parameter of the same name as the layer's `param` (None: it has no remote part)."""
    return next((p for name, p in getattr(layer, "_hybrid_shadow", {}).items() if getattr(layer, name, None) is param),
                None)


def patch_experts(routed_experts, unquantized, base_loader, gpu_worker) -> str | None:
    # strategy experts (client.py), in the main stage: some routed experts of each MoE layer live in the CPU pod.
    # - vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.__init__: before its weights are created,
    #   the layer's ExpertMapManager gets the map its expert-parallel path builds for a rank (global id -> local
    #   index, -1 elsewhere; with ep_size 1 it builds none), the remote experts being the -1s: create_weights makes
    #   room for the local experts only, and the weight loader and the fused kernels skip the others. After it,
    #   room for the remote experts in the CPU pod's region (connecting on the first such layer). A quantized
    #   layer's remote experts get the quant method's own parameters (create_weights on a shadow module), those the
    #   CPU pod reads (quantized_roles) placed in the region.
    # - RoutedExperts.weight_loader: upstream drops an expert the map says is not local; a remote one is written
    #   into its room in the region instead, with upstream's own w1/w3 (halves of w13) and w2 shard helpers (a
    #   quantized layer's: upstream's whole loader on the shadow parameter, the expert's remote index its local id;
    #   gpt-oss's loader hands every expert's tensor at once, expert_id None: its rows split by the map).
    # - RoutedExperts.forward_modular / forward_monolithic (quantized layers; each quant method has its own apply):
    #   as UnquantizedFusedMoEMethod.apply(_monolithic) below; their local experts by upstream's kernel for them.
    # - base_loader.BaseModelLoader.load_model: once the weights are in, the manifest goes to the CPU pod (and a
    #   quantized layer whose upstream kernel cannot leave the remote experts out fails the start by name).
    # - gpu_worker.Worker.execute_model (CPUWorker inherits it): the routing counts start at the first real step
    #   (warm-up and graph capture route dummy tokens) and are saved for the next start's placement now and then.
    # - UnquantizedFusedMoEMethod.apply (the modular path, CUDA: called with the router's top-k in global ids) and
    #   .apply_monolithic (the CPU backend, which routes inside; routed here with its own select_experts): such
    #   layers go through the opaque op client.experts_moe, which hands the remote experts' tokens to the CPU pod,
    #   computes the local experts as upstream does (CPU: upstream's kernels take no expert map, so local indexes
    #   with the remote slots weighted 0) and adds the CPU pod's y.
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.platforms import current_platform

    from . import client as side
    from . import quantized
    logger = init_logger("vllm.hybrid.patches")
    cls, method_cls = routed_experts.RoutedExperts, unquantized.UnquantizedFusedMoEMethod
    original_init, original_loader = cls.__init__, cls.weight_loader
    original_apply, original_monolithic = method_cls.apply, method_cls.apply_monolithic
    original_load_model = base_loader.BaseModelLoader.load_model
    original_modular, original_monolithic_forward = cls.forward_modular, cls.forward_monolithic
    device = "cpu" if current_platform.is_cpu() else "cuda"
    placement = parse_placement(os.environ.get(REMOTE_ENV, ""))

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
            if moe_config.moe_parallel_config.use_ep:
                refuse(f"{layer_name}: an expert-parallel MoE layer")
            count, emap = side.expert_map(moe_config.num_experts, remote)
            expert_map_manager._local_num_experts, expert_map_manager._expert_map = count, emap
            moe_config.num_local_experts = count
        original_init(self, layer_name, params_dtype, moe_config, quant_config, expert_map_manager, *args, **kwargs)
        if not remote:
            return
        if not isinstance(self.quant_method, method_cls):
            return hold_quantized(self, layer, remote)
        if moe_config.has_bias:  # the CPU pod's bf16 kernels take no biases
            refuse(f"{layer_name}: a biased unquantized MoE layer")
        backend = self.quant_method.unquantized_backend.name
        if backend not in ("CPU", "TRITON") or self.apply_router_weight_on_input:
            refuse(f"{layer_name}: vLLM's {backend} MoE kernels (they take no expert map; the Triton ones do), or "
                   "router weights on the input")
        client = side.client_from_env(device)
        w13, w2 = tuple(self.w13_weight.shape[1:]), tuple(self.w2_weight.shape[1:])
        if not hasattr(client, "flat"):  # the first layer with remote experts: the region for them all
            need = client.region_bytes(sum(map(len, placement.values())), w13, w2, self.w13_weight.dtype)
            where = client.open_weights(int(os.environ.get(BYTES_ENV) or need))
            logger.info("experts: remote experts' weights go to the CPU pod's region, %s", where)
        client.hold(layer, w13, w2, self.w13_weight.dtype, self.top_k, moe_config.num_experts)
        client.local[layer] = functools.partial(local_experts, self)
        self._hybrid_layer = layer

    def hold_quantized(self, layer: int, remote: list[int]):
        """A quantized layer's remote experts: the quant method's own parameters for them (create_weights on a
        shadow module, E = the remote experts, as RoutedExperts.__init__ calls it for the local ones), the roles the
        CPU pod reads placed in its region, so upstream's loader writes each remote expert there as it would here."""
        fmt, roles = quantized_roles(self)
        if self.moe_config.has_bias and "w13_bias" not in roles:  # biases reach the CPU pod only as roles (MXFP4)
            refuse(f"{self.layer_name}: a biased MoE layer in {fmt}")
        if self.apply_router_weight_on_input:
            refuse(f"{self.layer_name}: router weights on the input")
        params = dict(num_experts=len(remote), hidden_size=self.hidden_size,
                      unpadded_hidden_size=self.moe_config.hidden_dim_unpadded,
                      intermediate_size_per_partition=self.moe_config.intermediate_size_per_partition,
                      params_dtype=self.params_dtype, weight_loader=self.weight_loader,
                      global_num_experts=self.global_num_experts)
        if self._needs_intermediate_size_param(self.quant_method):
            params["intermediate_size_full"] = self.moe_config.intermediate_size
        shadow = torch.nn.Module()
        # create_weights keeps sizes on the method too (GptOssMxfp4MoEMethod: num_experts, which its kernel set-up
        # checks against the layer's): the shadow's call leaves the method as the layer's own call left it
        method_state = dict(vars(self.quant_method))
        with torch.device("cpu"):
            self.quant_method.create_weights(layer=shadow, **params)
        vars(self.quant_method).update(method_state)
        shadow_params = dict(shadow.named_parameters())
        client = side.client_from_env(device)
        if not hasattr(client, "flat"):  # the first layer with remote experts: the region for them all
            per_expert = sum(shadow_params[name].nbytes for name in roles.values()) // len(remote)
            need = sum(per_expert * len(ids) + 4096 * len(roles) for ids in placement.values())  # every layer alike
            # page-locked only where large steps copy from it (kept); else the pod gives its pages back once prepared
            where = client.open_weights(int(os.environ.get(BYTES_ENV) or need), page_lock=client.keeps(fmt))
            logger.info("experts: remote %s experts' weights go to the CPU pod's region, %s", fmt, where)
        stacks = client.hold_quantized(
            layer, fmt, {role: torch.empty_like(shadow_params[name], device="meta") for role, name in roles.items()},
            self.hidden_size, self.params_dtype, self.top_k, self.global_num_experts)
        for role, name in roles.items():
            shadow_params[name].data = stacks[role]  # the loader writes the region (the attributes it reads stay)
        if client.keeps(fmt):  # large steps: vLLM's Marlin MoE over the staged stacks, as for the layer's own experts
            args = getattr(self.quant_method, "weight_quant", None) or self.quant_method.quant_config
            client.layers[layer].large = quantized.Marlin(self, args, remote, self.global_num_experts)
        client.local[layer] = functools.partial(local_experts, self)
        self._hybrid_layer, self._hybrid_format = layer, fmt
        keep_shadows(self, shadow_params)
        self._hybrid_remote_index = {e: i for i, e in enumerate(remote)}

    def local_experts(layer, x, topk_weights, topk_ids):
        method = layer.quant_method
        if getattr(layer, "_hybrid_format", None) is not None:
            return local_quantized(layer, x, topk_weights, topk_ids)
        if device == "cuda":
            return original_apply(method, layer, x, topk_weights, topk_ids, None, None)
        local = layer.expert_map[topk_ids.long()]
        ids, weights = side.local_topk(local, layer.local_num_experts), torch.where(local >= 0, topk_weights, 0.0)
        # upstream's CPU kernel object (CPUFusedMOE / SGLFusedMOE) routes first: a routing function returning ours
        return method.cpu_fused_moe(layer, x, use_grouped_topk=False, top_k=layer.top_k, router_logits=None,
                                    renormalize=False, global_num_experts=layer.local_num_experts,
                                    custom_routing_function=lambda **_: (weights, ids), activation=layer.activation)

    def quantized_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success):
        """A remote expert's tensor of a quantized layer: upstream's loader, on the shadow parameter of the same
        name, with the expert's index among the remote ones as its local id."""
        shadow = shadow_of(self, param)
        if shadow is None:
            return False if return_success else None
        self._map_global_expert_id_to_local_expert_id = self._hybrid_remote_index.__getitem__  # this call only
        try:
            return original_loader(self, shadow, loaded_weight, weight_name, shard_id, expert_id, return_success)
        finally:
            del self._map_global_expert_id_to_local_expert_id

    def check_local_kernel(layer):
        """The quantized layer's own kernel can leave the remote experts out: on CUDA a modular kernel under the
        expert map (not every one reads it), on CPU vLLM's CPU kernels (routed here)."""
        kernel = layer.quant_method.moe_kernel
        experts = getattr(getattr(kernel, "impl", None), "fused_experts", None)
        name = type(experts).__name__
        if device == "cuda" and (layer.quant_method.is_monolithic
                                 or not getattr(experts, "supports_expert_map", lambda: True)()):
            refuse(f"{layer.layer_name}: vLLM's {name} kernel for these experts takes no expert map")
        if device == "cpu" and layer.quant_method.is_monolithic and not name.startswith("CPUExperts"):
            refuse(f"{layer.layer_name}: vLLM's {name} kernel (routing inside, not by cpu_fused_moe.select_experts)")

    def local_quantized(layer, x, topk_weights, topk_ids):
        """The main stage's experts of a quantized layer, by upstream's kernel: a modular one takes the global top-k
        and the expert map (CUDA); vLLM's CPU ones (monolithic, no expert map) route inside, so their routing
        (cpu_fused_moe.select_experts, which they import when called) gives local indexes, remote slots weighted 0."""
        if not layer.quant_method.is_monolithic:
            return original_modular(layer, x, topk_weights, topk_ids, None, None)
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        local = layer.expert_map[topk_ids.long()]
        ids, weights = side.local_topk(local, layer.local_num_experts), torch.where(local >= 0, topk_weights, 0.0)
        upstream, cpu_fused_moe.select_experts = cpu_fused_moe.select_experts, lambda *a, **k: (weights, ids)
        try:
            return original_monolithic_forward(layer, x, x.new_zeros(x.shape[0], layer.global_num_experts))
        finally:
            cpu_fused_moe.select_experts = upstream

    def stacked_loader(self, param, loaded_weight, weight_name, shard_id, return_success):
        """Every expert's tensor at once (gpt-oss's loader: expert_id None, upstream copies the stack whole): the
        main stage's experts' rows to upstream's loader on the layer's parameter, the remote ones' to it on the
        shadow parameter of the same name."""
        local = (self.expert_map >= 0).nonzero().squeeze(1)
        local = local[self.expert_map[local].argsort()]  # in local index order
        ok = original_loader(self, param, loaded_weight[local.to(loaded_weight.device)], weight_name, shard_id, None,
                             return_success)
        shadow = shadow_of(self, param)
        if shadow is not None:
            remote = torch.tensor(list(self._hybrid_remote_index), device=loaded_weight.device)  # remote index order
            original_loader(self, shadow, loaded_weight[remote], weight_name, shard_id, None, return_success)
        return ok

    @functools.wraps(original_loader)
    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        if getattr(self, "_hybrid_format", None) is not None:
            if expert_id is None:
                return stacked_loader(self, param, loaded_weight, weight_name, shard_id, return_success)
            if self._map_global_expert_id_to_local_expert_id(expert_id) == -1:
                return quantized_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success)
            return original_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success)
        layer = getattr(self, "_hybrid_layer", None)
        if (layer is None or loaded_weight.ndim != 2 or (param is not self.w13_weight and param is not self.w2_weight)
                or self._map_global_expert_id_to_local_expert_id(expert_id) != -1):
            return original_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success)
        w13, w2 = side.CLIENT.expert(layer, expert_id)
        if shard_id == "w2":
            self._load_w2(expert_data=w2, shard_dim=1, loaded_weight=loaded_weight, tp_rank=self.moe_config.tp_rank)
        else:
            self._load_w13(expert_data=w13, shard_dim=0, shard_id=shard_id, loaded_weight=loaded_weight,
                           tp_rank=self.moe_config.tp_rank)
        return True if return_success else None

    @functools.wraps(original_load_model)
    def load_model(self, *args, **kwargs):
        model = original_load_model(self, *args, **kwargs)
        client = side.CLIENT
        for module in model.modules():  # upstream's kernel for the local experts is chosen by now
            if getattr(module, "_hybrid_format", None) is not None:
                check_local_kernel(module)
        if client is not None and client.side is None:
            threads = client.publish()
            laid, took = client.lay_out_kept()
            if laid:
                logger.info("experts: the kept stacks of %d layers rewritten in Marlin's layout in %.1f s", laid, took)
            if shared := client.share_in_place():
                here = {rows: sum(len(ip.ids) for h in client.layers.values() for most, ip in h.in_place if most == rows and ip)
                        for rows, _ in client.uva_shares}
                logger.info("experts: %d layers' remote experts shared at the pod's steps (%s=%s, read %s): of %d, "
                            "computed here in place at steps of up to %s", shared, UVA_SHARE_ENV,
                            os.environ.get(UVA_SHARE_ENV), client.share_read, sum(len(h.ids) for h in client.layers.values()),
                            ", ".join(f"{rows} tokens: {n}" for rows, n in here.items()))
            layers = client.layers.values()
            larger = collections.Counter("here from the stacks the pod keeps" if h.nearby else
                                         "by the pod in parts" if h.fmt is not None else "here from the region"
                                         for h in layers)
            logger.info("experts: %d remote experts of %d MoE layers (%.2f GB) computed by the CPU pod (%d threads) "
                        "for steps of up to %d tokens; larger steps: %s", sum(len(h.ids) for h in layers),
                        len(client.layers), client.used / 1e9, threads, client.max_rows,
                        ", ".join(f"{n} layers {how}" for how, n in larger.items()))
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

    @functools.wraps(original_modular)
    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if getattr(self, "_hybrid_format", None) is None:
            return original_modular(self, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return apply(None, self, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    @functools.wraps(original_monolithic_forward)
    def forward_monolithic(self, x, router_logits=None, input_ids=None):
        if getattr(self, "_hybrid_format", None) is None:
            return original_monolithic_forward(self, x, router_logits, input_ids)
        return apply_monolithic(None, self, x, router_logits, input_ids)

    step_original = gpu_worker.Worker.execute_model

    @functools.wraps(step_original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        client = side.CLIENT
        if client is None:
            return step_original(self, scheduler_output, *args, **kwargs)
        client.counts.serving()
        out = step_original(self, scheduler_output, *args, **kwargs)
        client.counts.maybe_save(client.top_k)
        return out

    cls.__init__, cls.weight_loader = __init__, weight_loader
    cls.forward_modular, cls.forward_monolithic = forward_modular, forward_monolithic
    method_cls.apply, method_cls.apply_monolithic = apply, apply_monolithic
    gpu_worker.Worker.execute_model = execute_model
    base_loader.BaseModelLoader.load_model = load_model
    return ("RoutedExperts.__init__/weight_loader/forward_modular/forward_monolithic + "
            "UnquantizedFusedMoEMethod.apply(_monolithic) + BaseModelLoader.load_model + "
            "Worker.execute_model(experts: remote experts in the CPU pod's region, computed there)")


def apply() -> list[str]:
    """In the main stage's worker of an experts pipeline (the launcher gives it the expert server's socket)."""
    if not os.environ.get(SOCKET_ENV):
        return []
    from vllm.model_executor.layers.fused_moe import routed_experts, unquantized_fused_moe_method
    from vllm.model_executor.model_loader import base_loader
    from vllm.v1.worker import gpu_worker
    return [patch_experts(routed_experts, unquantized_fused_moe_method, base_loader, gpu_worker)]
