"""Check bench/kt_moe.py: KtLayer against a float32 torch reference, every method, tiny shapes.

Run:  PYTHONPATH=/tmp/ktlocal taskset -c 1 .venv/bin/python bench/kt_moe_check.py   (HYBRID_KT_CHECK_THREADS=1)
Reference: y[t] = sum_j w[t,j] * w2[e] @ (silu(w13[e][:I] @ x[t]) * (w13[e][I:] @ x[t])) in fp32, on the weights
the method computes with: bf16 as given; FP8 dequantized (q * scale_inv); AMXINT8/AMXINT4 per-row symmetric
int8 resp. int4 as kt-kernel's online quantization rounds them, and int8 activations per row as its BufferA
does; so what is left is the kernel's own rounding (bf16 intermediates, fp32 sums). "vs bf16" is the error
against the unquantized weights, i.e. what the method costs in accuracy.
"""
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kt_moe  # noqa: E402

E, H, INTER, K = 4, 512, 768, 2
TOKENS = (1, 5, 16)
TOL = {"BF16": 0.02, "FP8": 0.02, "AMXINT8": 0.03, "AMXINT4": 0.03}  # rel. error vs the matching reference


def rowwise(w: torch.Tensor, bits: int) -> torch.Tensor:
    """kt-kernel's per-row symmetric quantization (BufferB weights, BufferA activations), dequantized:
    int8 q = round(w * 127 / amax); int4 first rounds to int8 at amax/112, then to a multiple of 16 (= int4 * 16)."""
    w = w.float()
    s = w.abs().amax(-1, keepdim=True).clamp_min(1e-30) / (127 if bits == 8 else 112)
    q = (w / s).round().clamp(-128, 127)
    if bits == 4:
        q = q.sign() * ((q.abs() + 8) // 16) * 16
    return q * s


def dequant(method: str, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if method == "FP8":
        b = kt_moe.FP8_BLOCK

        def deq(w):
            q, s = kt_moe.fp8_block_quant(w)
            return q.float() * s.repeat_interleave(b, 1).repeat_interleave(b, 2)
        return deq(w13), deq(w2)
    if method in ("AMXINT8", "AMXINT4"):
        bits = 8 if method == "AMXINT8" else 4
        return rowwise(w13, bits), rowwise(w2, bits)
    return w13.float(), w2.float()


def reference(x, ids, weights, w13, w2, act=lambda a: a.float()):
    """act: what the kernel does to a GEMM's input rows (the int8 methods quantize x and silu(g)*u per row)."""
    y = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ act(x[t:t + 1])[0]
            h = (torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]).to(torch.bfloat16)  # kept in bf16 between GEMMs
            y[t] += weights[t, j] * (w2[e] @ act(h[None])[0])
    return y


def main() -> int:
    torch.set_num_threads(1)
    threads = int(os.environ.get("HYBRID_KT_CHECK_THREADS", 1))
    print(f"kt-kernel variant: {kt_moe.kt_variant()}  int8 kernel: {getattr(kt_moe._ext, '__int8_kernel__', None)}  "
          f"E={E} H={H} I={INTER} top-{K} threads={threads}")
    if kt_moe.kt_variant() is None:
        print("kt_kernel not importable: put kt_kernel/ and kt_kernel.libs/ on PYTHONPATH")
        return 1
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, INTER, generator=g) / INTER ** 0.5).to(torch.bfloat16)
    failed, skipped = [], []
    for method in kt_moe.AVAILABLE_METHODS:
        try:
            layer = kt_moe.KtLayer(method, w13, w2, top_k=K, threads=threads, max_tokens=max(TOKENS))
        except Exception as err:  # noqa: BLE001 - report and go on with the other methods
            skipped.append(f"{method}: {type(err).__name__}: {err}")
            traceback.print_exc()
            continue
        r13, r2 = dequant(method, w13, w2)
        errs = []
        for t in TOKENS:
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
            wts = torch.rand(t, K, generator=g).softmax(-1)
            got = layer(x, ids, wts).float()
            act = (lambda a: rowwise(a, 8)) if method.startswith("AMXINT") else (lambda a: a.float())
            ref = reference(x, ids, wts, r13, r2, act)
            exact = reference(x, ids, wts, w13.float(), w2.float())
            rel = ((got - ref).norm() / ref.norm()).item()
            rel_bf16 = ((got - exact).norm() / exact.norm()).item()
            errs.append(rel)
            print(f"  {method:8s} ({layer.kind}) T={t:2d}: rel.err {rel:.2e} vs its dequantized weights, "
                  f"{rel_bf16:.2e} vs the bf16 weights")
        if max(errs) > TOL[method] or not all(e == e for e in errs):
            failed.append(method)
    print("could not run here:" if skipped else "all methods ran here", *skipped, sep="\n  ")
    print("FAILED (rel.err above tolerance): " + ", ".join(failed) if failed else "OK: every method that ran is within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
