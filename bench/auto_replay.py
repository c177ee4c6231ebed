"""`auto` replayed on a lease's results, off the device (issue 48, item 4): the plan bench/gpu_bench.py made on that
box (gpu_bench.stages_for its memories and the cpu stage's tuned cores), resolved on the figures the lease's stages
measured at start (`planned.node_figures`), at each concurrency the files measured; beside it what each strategy
decoded there.

    PYTHONPATH=runtime python bench/auto_replay.py RESULT.json [RESULT.json ...] [--prompt-tokens 32 --output-tokens 16]
        [--figure NAME=VALUE ...]

The first file gives the box and its figures; the others add strategies measured on the same figures
(HYBRID_BENCH_NODE_FIGURES), a later file's run of a strategy in place of an earlier one's. A pick within 0.95x of the
fastest measured is item 4's goal. --figure adds or replaces one of the lease's node figures: what a start would have
measured since (cpu_layer_1_s: a pipeline CPU stage's layer, timed by bench/cpu_stage_profile.py on a box of that kind). Two measures of "fastest": the wave's tokens/s (prefill included: what `auto`
predicts and picks by, for the workload the plan expects, here each wave's prompt and output tokens) and decode tokens/s
(the leases' tables: concurrency / TPOT).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import resolve_planned, stages_for  # noqa: E402
from vllm_hybrid.cpubind import parse_cpulist  # noqa: E402


def decoded(results: list[dict], key: str = "decode_tok_per_s") -> dict[int, dict[str, float]]:
    """Per concurrency, each strategy's tok/s by `key` (decode_tok_per_s, or tok_per_s: the wave's) in the files (a
    file of one run, or of several)."""
    out: dict[int, dict[str, float]] = {}
    for r in results:
        for run in [r] if "waves" in r else [v for v in r.values() if isinstance(v, dict) and "waves" in v]:
            strategy = run.get("strategy") or run["config"].removeprefix("p-")
            for wave in run["waves"]:
                out.setdefault(wave["concurrency"], {})[strategy] = wave[key]
    return out


def replay(first: dict, concurrency: int, prompt_tokens: int, output_tokens: int) -> tuple[str, dict[str, float]]:
    """auto's pick and its predictions, on the plan gpu_bench made on the lease's box and its node figures."""
    box = first["planned"]
    cpus = next(r["cpu_tuning"]["env"]["HYBRID_CPUS"] for r in first.values() if isinstance(r, dict) and "waves" in r)
    stages = stages_for("auto", box["gpu_mib"], box["host_mib"], box["gpu_budget_mib"], len(parse_cpulist(cpus)))
    _, lay, estimates = resolve_planned(box["model"], "auto", stages, box["node_figures"],
                                        expected_concurrency=concurrency, expected_prompt_tokens=prompt_tokens,
                                        expected_output_tokens=output_tokens)
    return lay.strategy, estimates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--figure", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in args.results]
    for name, value in (f.split("=", 1) for f in args.figure):
        results[0]["planned"]["node_figures"][name] = float(value)
    waves = decoded(results, "tok_per_s")
    for c, measured in sorted(decoded(results).items()):
        pick, estimates = replay(results[0], c, args.prompt_tokens, args.output_tokens)
        print(f"concurrency {c}: auto picks {pick}; predicted (the wave) {', '.join(f'{k} {v:.1f}' for k, v in estimates.items())}")
        for name, by in (("wave", waves[c]), ("decode", measured)):
            best = max(by, key=by.get)
            share = f"{by[pick] / by[best]:.2f}x" if pick in by else "not measured"
            print(f"  by {name} tok/s: {share} of the fastest measured ({best} {by[best]}); measured "
                  f"{', '.join(f'{k} {v}' for k, v in by.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
