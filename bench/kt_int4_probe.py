"""kt-kernel's W4A16 methods (GPTQ_INT4, RAWINT4) on a checkpoint's own int4, one case a subprocess (a method that
crashes on this CPU says so and the rest still run): the result against the dequantized reference (rel) and GB/s at
one token (the experts' stored bytes; experts taken in turn so they come from DRAM).
Run:  PYTHONPATH=runtime:<kt_kernel's dir> python bench/kt_int4_probe.py OUT.json [method:H:I:E:group:keep ...]
  keep 1: the layer's source tensors stay alive (a class that reads its words in place needs them)."""
import json
import os
import subprocess
import sys
import time

CASES = ["GPTQ_INT4:256:256:3:128:0", "RAWINT4:256:256:3:128:1", "RAWINT4:256:256:3:128:0", "RAWINT4:256:256:3:32:1",
         "RAWINT4:512:512:4:128:1", "GPTQ_INT4:4096:1536:16:128:0", "RAWINT4:4096:1536:16:128:1"]


def one(case: str) -> dict:
    import torch
    from vllm_hybrid.cpupod import kt
    from vllm_hybrid.strategies.experts.quantized import quantize
    method, h, inter, e, group, keep = case.split(":")
    h, inter, e, group = int(h), int(inter), int(e), int(group)
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g) * 0.05, torch.randn(e, h, inter, generator=g) * 0.05
    q13, q2 = quantize("w4a16", w13, group), quantize("w4a16", w2, group)
    threads = max(1, len(os.sched_getaffinity(0)) - 2)
    if keep == "1":  # every class keeps the copies it was given, not only kt.READS_IN_PLACE's
        kt.READS_IN_PLACE = ("AMXInt4_KGroup_MOE", "AVXVNNI256RawInt4_MOE", "AVX2RawInt4_MOE",
                             "AVXVNNI256GPTQInt4Packed_MOE", "AVXVNNI256GPTQInt4_MOE", "AVX2GPTQInt4_MOE")
    layer = kt.KtLayer(method, q13["w"], q2["w"], top_k=2, threads=threads, max_tokens=64,
                       w13_scale=q13["scale"], w2_scale=q2["scale"])
    sources = [q13, q2] if keep == "1" else None
    if keep != "1":
        del q13["w"], q2["w"]
    out = {"kind": layer.kind}
    x = torch.randn(7, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g).softmax(-1)
    d13, d2 = quantize("w4a16", w13, group)["dequantized"], quantize("w4a16", w2, group)["dequantized"]
    want = torch.zeros(7, h)
    for t in range(7):
        for j in range(2):
            hh = d13[ids[t, j]] @ x[t].float()
            want[t] += weights[t, j] * (d2[ids[t, j]] @ (torch.nn.functional.silu(hh[:inter]) * hh[inter:]))
    for tokens in (1, 7):
        y = layer(x[:tokens], ids[:tokens], weights[:tokens]).float()
        out[f"rel_{tokens}"] = round(float((y - want[:tokens]).norm() / want[:tokens].norm()), 4)
    expert_bytes = 3 * h * inter // 2 + 3 * h * inter // group * 2
    torch.set_num_threads(1)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        layer(x[:1], torch.tensor([[calls % e]]), torch.ones(1, 1))
        calls += 1
    out["gbs_one_token"] = round(expert_bytes * calls / (time.perf_counter() - t0) / 1e9, 2)
    del sources
    return out


def main(path: str, cases: list[str]) -> None:
    got = {}
    for case in cases:
        p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--one", case], capture_output=True, text=True, timeout=120)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("{")), None)
        got[case] = json.loads(line) if p.returncode == 0 and line else {"rc": p.returncode,
                                                                          "stderr": p.stderr[-600:]}
        print(case, got[case], flush=True)
    with open(path, "w") as f:
        json.dump(got, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2])))
    else:
        main(sys.argv[1], sys.argv[2:] or CASES)
