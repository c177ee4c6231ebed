"""Which ISA torch's oneDNN uses for bf16 GEMMs on this CPU, and what it reaches (AMX or not).
Run with ONEDNN_VERBOSE=1 to see the primitive's ISA; prints TFLOP/s at M=1024 on all threads."""
import ctypes
import time

import torch

ARCH_REQ_XCOMP_PERM, ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1023, 0x1022, 18
libc = ctypes.CDLL(None, use_errno=True)
perm = ctypes.c_ulong(0)
req = libc.syscall(158, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
libc.syscall(158, ARCH_GET_XCOMP_PERM, ctypes.byref(perm))
print(f"amx_tile_supported={torch.cpu._is_amx_tile_supported()} arch_prctl(REQ_XTILEDATA)={req} "
      f"errno={ctypes.get_errno()} xcomp_perm={perm.value:#x} threads={torch.get_num_threads()}")
w = torch.randn(14336, 4096, dtype=torch.bfloat16)
x = torch.randn(1024, 4096, dtype=torch.bfloat16)
for _ in range(3):
    torch.nn.functional.linear(x, w)
t0 = time.perf_counter()
for _ in range(10):
    torch.nn.functional.linear(x, w)
s = (time.perf_counter() - t0) / 10
print(f"bf16 linear 1024x4096x14336: {s * 1e3:.1f} ms, {2 * 1024 * 4096 * 14336 / s / 1e12:.2f} TFLOP/s")
