"""What spec.serving.extraArgs may set. They are read with vLLM's own `serve` parser, as vLLM reads them
(abbreviations, --flag=value, underscores, -tp, --config files), and any that would replace a value the launcher
pins or the planner sized against is refused, naming the spec field to use instead."""
from __future__ import annotations

import argparse
import functools

from .plan import PlanError


def _use(field: str) -> str:
    return f"set {field} instead"


_WIRING = "the launcher wires the pipeline from spec.stages"
_OFFLOAD = "use spec.strategy offload (the strategies stream weights themselves)"
# vLLM's argument (its dest) -> what to do instead (the plan file's key in brackets)
PINNED = {
    "model": _use("spec.model (plan: model)"), "model_tag": _use("spec.model (plan: model)"),
    "served_model_name": _use("spec.model.servedModelName (plan: served_model_name)"),
    "revision": _use("spec.model.revision (plan: revision)"),
    "dtype": _use("spec.model.dtype (plan: dtype)"),
    "load_format": _use("spec.model.loadFormat (plan: load_format)"),
    "max_model_len": _use("spec.model.maxModelLen (plan: max_model_len)"),
    "quantization": "vLLM takes the format from the checkpoint's quantization_config, which the planner sized",
    "block_size": _use("spec.serving.blockSize (plan: block_size)"),
    "max_num_seqs": _use("spec.serving.maxNumSeqs (plan: max_num_seqs)"),
    "max_num_batched_tokens": _use("spec.serving.maxNumBatchedTokens (plan: max_num_batched_tokens)"),
    "host": _use("spec.serving.port (plan: api_port)"), "port": _use("spec.serving.port (plan: api_port)"),
    "api_key": _use("spec.serving.apiKeySecretRef"),
    "tensor_parallel_size": _use("spec.stages[].tensorParallel (plan: stages[].tensor_parallel)"),
    "gpu_memory_utilization": _use("spec.stages[].gpuMemoryUtilization (plan: stages[].gpu_memory_utilization)"),
    "kv_cache_memory_bytes": _use("spec.stages[].gpuMemoryUtilization (plan: stages[].gpu_memory_utilization)"),
    **dict.fromkeys(("pipeline_parallel_size", "data_parallel_size", "data_parallel_size_local", "nnodes",
                     "node_rank", "master_addr", "master_port", "headless", "distributed_executor_backend"), _WIRING),
    **dict.fromkeys(("cpu_offload_gb", "cpu_offload_params", "offload_backend", "offload_group_size",
                     "offload_num_in_group", "offload_prefetch_step", "offload_params"), _OFFLOAD),
}

# pinned by the launcher only where it sets them
_LAUNCHER = {"async_scheduling": "a pipeline of several stages runs without async scheduling (sampled tokens "
                                 "would travel over the pipeline's device group)"}


class _Parser:
    """vLLM's `vllm serve` parser with no defaults, so a parse yields only what the arguments set."""

    def __init__(self):
        from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        class Raising(FlexibleArgumentParser):
            def error(self, message):  # argparse would print and exit: the launcher reports it instead
                raise PlanError(f"spec.serving.extraArgs: {message}")

        self.parser = make_arg_parser(Raising())
        for action in self.parser._actions:
            action.default = argparse.SUPPRESS
        self.options = {o: a for a in self.parser._actions for o in a.option_strings}

    def dests(self, args: list[str]) -> set[str]:
        # FlexibleArgumentParser.parse_args first rewrites as vLLM does (underscores, --config files, -O3)
        return set(vars(self.parser.parse_args(list(args))))

    def written_as(self, dest: str, args: list[str]) -> str:
        """The argument that set `dest`, as the user wrote it (vLLM takes unique prefixes of long options)."""
        for arg in args:
            key = arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else arg.split("=", 1)[0]
            exact = self.options.get(key)
            hits = {exact.dest} if exact else {a.dest for o, a in self.options.items()
                                               if key.startswith("--") and o.startswith(key)}
            if hits == {dest}:
                return arg
        return "--config" if "--config" in args else dest


@functools.cache
def _parser() -> _Parser:
    return _Parser()


def refuse_pinned(launcher_args: list[str], extra: list[str]) -> None:
    """PlanError naming the first extra argument that sets what the launcher pins (`launcher_args`: the rest of
    the `vllm serve` arguments, model first) or what the planner sized against."""
    if not extra:
        return
    p = _parser()
    pinned = p.dests(launcher_args) | set(PINNED)
    for action in p.parser._actions:
        if isinstance(action, argparse._AppendAction):
            pinned.discard(action.dest)  # appended to the launcher's (another --middleware), not replacing it
    for dest in sorted(p.dests(extra) & pinned):
        flag = next((a.option_strings[0] for a in p.parser._actions if a.dest == dest and a.option_strings),
                    "the model argument")
        instead = PINNED.get(dest) or _LAUNCHER.get(dest, "spec.strategy decides it")
        raise PlanError(f"spec.serving.extraArgs: {p.written_as(dest, extra)!r} sets {flag}, which the launcher "
                        f"pins: {instead}")


def refuse_in_serve_argv(serve_argv: list[str], extra: list[str]) -> None:
    """The same, for the arguments after `vllm serve` (the model first) that end with the extra ones."""
    if extra and serve_argv[-len(extra):] == list(extra):
        refuse_pinned(serve_argv[:-len(extra)], list(extra))
