"""How the CPU side of the budget is used (plan.strategy): one module per strategy behind base.Strategy,
and `auto`, whichever of them the cost model predicts fastest for the plan's expected workload.

A new strategy: a module (or a folder, where it has a CPU-pod half and vLLM patches of its own: its __init__.py the
Strategy, io.py the names and region layout both halves use) with a Strategy subclass, registered below.
Pure: a function of the plan, its layer split and the hardware figures, like the planner.
"""
from __future__ import annotations

from ..plan import Plan, PlanError
from ..planner import Split, split_layers
from .balanced import Balanced
from .base import Layout, Strategy
from .coprocessor import Coprocessor
from .cost import Hardware, Workload, hardware_of, workload_of
from .experts import Experts
from .offload import Offload
from .pipeline import Pipeline

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Pipeline(), Offload(), Balanced(), Coprocessor(), Experts())}
STRATEGY_ENV = "HYBRID_STRATEGY"  # a stage's resolved strategy (the launcher sets it): its vLLM patches apply too
NAMES = (*STRATEGIES, "auto")  # what plan.strategy may name; auto tries them in registry order (ties: the first)

__all__ = ["NAMES", "STRATEGIES", "STRATEGY_ENV", "Hardware", "Layout", "Strategy", "Workload", "get", "hardware_of", "predict",
           "check_name", "resolve", "resolve_split", "slowest_step_s", "workload_of"]


def get(name: str) -> Strategy:
    """The registered strategy `name` (auto is not one: resolve picks one for it)."""
    if name not in STRATEGIES:
        raise PlanError(f"strategy: unknown strategy {name!r} (known: {', '.join(STRATEGIES)})")
    return STRATEGIES[name]


def serving(shape, but: str) -> str:
    """A model refusal's advice: the other strategies whose kernels take this checkpoint (registry order)."""
    names = [name for name, s in STRATEGIES.items() if name != but and s.refused_model(shape) is None]
    if not names:
        return "no strategy serves it"
    return "use strategy " + (" or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0])


def check_name(plan: Plan) -> None:
    """plan.strategy names a registered strategy or auto (the plan file itself does not know them)."""
    if plan.strategy not in NAMES:
        raise PlanError(f"strategy: expected one of {NAMES}, got {plan.strategy!r}")


def predict(plan: Plan, split: Split, lay: Layout, work: Workload, hw: Hardware = Hardware()) -> float:
    """Output tokens/s of one wave of `concurrency` requests (all prefill, then decode) under `lay`."""
    strategy, prefill, step = get(lay.strategy), 0.0, 0.0
    for k in range(len(lay.stages)):
        cost = strategy.cost(plan, split, lay, k, work, hw)
        step += cost.step_s
        prefill += cost.prefill_s
    step += hw.gpu_step_s if len(lay.stages) > 1 else 0.0
    step = max(step, hw.gpu_step_s)  # a lone gpu stage's step costs nothing above: no division by zero
    return work.concurrency * work.output_tokens / (prefill + work.output_tokens * step)


def slowest_step_s(plan: Plan, split: Split, lay: Layout, hw: Hardware | None = None) -> float:
    """The longest step expected: a full prefill chunk (max_num_batched_tokens) through every stage, as
    each stage waits for the others' share of it (one batch in flight). The stall timeout is sized
    from it."""
    hw = hw or hardware_of(plan)
    strategy, total = get(lay.strategy), hw.gpu_step_s
    for k in range(len(lay.stages)):
        total += strategy.chunk_bound_s(plan, split, lay, k, hw)
    return total


def resolve_split(plan: Plan, shape, gpu_memory_bytes: int | None = None, hw: Hardware | None = None,
                  api_stage: int | None = None, shared_shm: bool = True) -> tuple[Split, Layout, dict[str, float]]:
    """The split and layout to run: the strategy is chosen on the pipeline split (auto: by the cost
    model), then gets a split of its own (its budget rules: base.Strategy's planner hooks)."""
    check_name(plan)
    split = split_layers(plan, shape, gpu_memory_bytes)
    lay, estimates = resolve(plan, split, hw, api_stage, shared_shm)
    if lay.strategy != "pipeline":
        split = split_layers(plan, shape, gpu_memory_bytes, get(lay.strategy))
        lay = get(lay.strategy).layout(plan, split)
    return split, lay, estimates


def resolve(plan: Plan, split: Split, hw: Hardware | None = None, api_stage: int | None = None,
            shared_shm: bool = True) -> tuple[Layout, dict[str, float]]:
    """The layout to run and the predicted tokens/s of each candidate at the expected workload.
    api_stage: the plan stage that must serve the API where the deployment fixes it (Kubernetes
    routes clients to stage 0's pods), so layouts that leave it out are not candidates.
    shared_shm: whether the stages of a replica share /dev/shm (balanced and coprocessor meet there)."""
    check_name(plan)
    hw = hw or hardware_of(plan)
    work = workload_of(plan)
    mixed = any(not s.is_cpu for s in plan.stages) and any(s.is_cpu for s in plan.stages)
    candidates = []
    for name, strategy in STRATEGIES.items():
        if strategy.hybrid and not mixed:
            continue  # refused below, once the API stage is checked
        if plan.strategy == "auto" and not strategy.auto:
            continue
        why = strategy.refused(plan, shared_shm)
        if why is None and (why := strategy.refused_model(split.shape) or strategy.refused_node(split.shape, hw)):
            why += f"; {serving(split.shape, but=name)}"
        if why is None:
            candidates.append(name)
        elif plan.strategy == name:
            raise PlanError(f"strategy: {name} needs {why}")
    lays, unfit = {}, {}
    for name in candidates:
        try:
            lays[name] = get(name).layout(plan, split)
        except PlanError as e:  # one that does not fit this box: a candidate less, an error only where it was asked for
            if plan.strategy == name:
                raise
            unfit[name] = str(e)
    if not lays:
        raise PlanError("strategy: auto: no strategy fits: " + "; ".join(unfit.values()))
    if api_stage is not None:
        lays = {name: lay for name, lay in lays.items() if lay.stages[0] == api_stage}
        if plan.strategy not in ("auto", *lays):
            raise PlanError(f"strategy: {plan.strategy} would serve the API from another stage than stage "
                            f"{api_stage} ({plan.stages[api_stage].name}); put a gpu stage first")
    estimates = {name: round(predict(plan, split, lay, work, hw), 2) for name, lay in lays.items()}
    if plan.strategy == "auto":
        return lays[max(estimates, key=estimates.get)], estimates
    if plan.strategy not in lays:
        raise PlanError(f"strategy: {plan.strategy} needs a gpu stage and a cpu stage")
    return lays[plan.strategy], estimates
