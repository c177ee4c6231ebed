"""CUDA stream memory operations on host memory: how a GPU stream and a CPU process meet without a host
thread in between (strategies/coprocessor, strategies/experts). A flag write and a wait on a flag are stream work, so CUDA graphs capture
them (batch mem-op nodes) and replay them every step: the GPU tells the CPU pod that a product's input is
in host memory, and waits for its rows of the output, inside the captured decode step.

ctypes over the driver API (libcuda), since torch exposes neither call.
"""
from __future__ import annotations

import ctypes

import torch

WAIT_GEQ, WAIT_EQ = 0x0, 0x1  # CU_STREAM_WAIT_VALUE_*
REGISTER_PORTABLE, REGISTER_DEVICEMAP = 0x1, 0x2  # cudaHostRegister flags

_lib = None


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
            # cuda.h maps the plain names to the _v2 entry points (memops on by default since CUDA 11.7)
            fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            setattr(lib, "_" + name, fn)
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.restype = ctypes.c_int
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


def register(ptr: int, nbytes: int, mapped: bool = True) -> None:
    """Page-lock host memory another process may share (cudaHostRegister); mapped: kernels and memops reach it."""
    flags = REGISTER_PORTABLE | (REGISTER_DEVICEMAP if mapped else 0)
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags)
    _check(int(rc), f"cudaHostRegister of {nbytes / 1e9:.2f} GB")


def unregister(ptr: int) -> None:
    """Undo register before the memory is unmapped: CUDA keeps the range pinned, and a later mapping at the same
    addresses would fail to register (cudaErrorHostMemoryAlreadyRegistered)."""
    _check(int(torch.cuda.cudart().cudaHostUnregister(ptr)), "cudaHostUnregister")


def device_pointer(ptr: int) -> int:
    out = ctypes.c_uint64()
    _check(_driver().cuMemHostGetDevicePointer_v2(ctypes.byref(out), ptr, 0), "cuMemHostGetDevicePointer")
    return out.value


def _stream(stream: torch.cuda.Stream | None) -> int:
    return (stream or torch.cuda.current_stream()).cuda_stream


def write(addr: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
    """Stream-ordered store of `value` to a device pointer of mapped host memory (with a system-wide fence
    first, so the CPU sees every earlier write of the stream before the flag)."""
    _check(_driver()._cuStreamWriteValue32(_stream(stream), addr, value, 0), "cuStreamWriteValue32")


def wait(addr: int, value: int, stream: torch.cuda.Stream | None = None, flags: int = WAIT_EQ) -> None:
    """The stream waits until the word at `addr` equals (WAIT_EQ) or reaches (WAIT_GEQ) `value`."""
    _check(_driver()._cuStreamWaitValue32(_stream(stream), addr, value, flags), "cuStreamWaitValue32")


class _HostView:
    """__cuda_array_interface__ of mapped host memory: with unified addressing a kernel reads it in place."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def as_device(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same (registered, mapped) host memory as CPU tensor `t`: kernels read and
    write it over PCIe in place, which does not queue behind copy-engine traffic such as a weight stream."""
    ptr = device_pointer(t.data_ptr())
    raw = torch.as_tensor(_HostView(ptr, t.numel() * t.element_size()), device="cuda")
    return raw.view(t.dtype).view(t.shape)


def device_words(raw: torch.Tensor, line: int, words: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
    """A registered io region as a GPU process uses it: an in-place device view, and the device pointers of its
    words (one per `line` bytes), which stream memory operations store to and wait on."""
    base = device_pointer(raw.data_ptr())
    return as_device(raw), [base + w * line for w in words]
