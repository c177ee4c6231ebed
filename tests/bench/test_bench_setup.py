"""bench/'s set-up of a lease (issue 48): every strategy in a comparison runs with the CPU kernel this box measured
(a cpu_kernels.json measured on another machine is measured again by bench/run.sh and refused by bench/gpu_bench.py),
and within the GPU budget a run asks for (HYBRID_BENCH_GPU_GIB)."""
import json
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cpu_kernels  # noqa: E402
import gpu_bench  # noqa: E402
import report  # noqa: E402


def kernels_file(path: Path, machine: dict) -> None:
    ms = lambda x: {str(m): {"ms": x * m} for m in (1, 4, 16, 64)}  # noqa: E731
    path.write_text(json.dumps({"machine": machine, "placements": {
        "all": {"cpu_list": [1, 2, 3], "kernels": {"onednn": ms(2.0), "sgl": ms(1.0)}}}}))


def test_a_kernel_pick_measured_on_another_machine_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_bench, "OUT", tmp_path)
    here = cpu_kernels.machine()
    assert set(here) == {"boot_id", "cpu", "cpus"} and here["boot_id"]
    kernels_file(tmp_path / "cpu_kernels.json", {**here, "boot_id": "another lease"})
    assert not cpu_kernels.measured_here(str(tmp_path / "cpu_kernels.json"))
    with pytest.raises(SystemExit, match="measured on another machine"):
        gpu_bench.cpu_tuning()
    kernels_file(tmp_path / "cpu_kernels.json", here)
    assert cpu_kernels.measured_here(str(tmp_path / "cpu_kernels.json"))
    assert gpu_bench.cpu_tuning() == {"kernel": "sgl", "placement": "all",
                                      "env": {"HYBRID_CPUS": "1,2,3", "VLLM_CPU_SGL_KERNEL": "1"}}


def test_run_sh_measures_every_lease_and_the_file_says_which_machine(tmp_path, capsys):
    """bench/run.sh calls cpu_kernels.py whatever is on disk; it keeps only a file of this machine's."""
    run_sh = (Path(__file__).resolve().parents[2] / "bench" / "run.sh").read_text()
    line = next(ln for ln in run_sh.splitlines() if "bench/cpu_kernels.py" in ln and "python3" in ln)
    assert not line.lstrip().startswith("[") and "|| exit 1" in line  # no "[ -f ... ] ||" short-cut
    # it times the decode batches the pick scores, no others (all 13 took 4 minutes of a device call)
    ms = re.search(r"HYBRID_BENCH_MS=\$\{HYBRID_BENCH_MS:-([\d,]+)\}", run_sh)
    assert ms and [int(m) for m in ms[1].split(",")] == list(gpu_bench.TUNING_MS)
    kernels_file(tmp_path / "k.json", cpu_kernels.machine())
    cpu_kernels.main(str(tmp_path / "k.json"), None)
    assert "measured on this machine already" in capsys.readouterr().out


def test_a_gpu_budget_scales_every_configurations_share_of_the_gpu(monkeypatch):
    """HYBRID_BENCH_GPU_GIB=24 on an 80 GB card: vLLM's share of the GPU is scaled to 24 GiB, and the planner's
    budget for the planned GPU stage is that share of the GPU, as vLLM's (not 24 GiB's share: 4.8 GiB)."""
    from vllm_hybrid.plan import plan_from_dict
    from vllm_hybrid.planner import GPU_RUNTIME_RESERVE, stage_budget
    monkeypatch.setattr(gpu_bench, "box_memory", lambda: (81559, 131072))
    monkeypatch.setattr(gpu_bench, "cpu_tuning", lambda: {"env": {"HYBRID_CPUS": "1-15"}})
    assert gpu_bench.gpu_share(0.92) == 0.92
    monkeypatch.setattr(gpu_bench, "GPU_BUDGET_MIB", 24 * 1024)
    assert gpu_bench.gpu_share(0.92) == round(0.92 * 24576 / 81559, 4)
    gpu = next(s for s in gpu_bench.planned_stages("experts") if s["device"] == "gpu")
    assert gpu["memory"] == "81559Mi" and gpu["gpu_memory_utilization"] == gpu_bench.gpu_share(0.92)
    plan = plan_from_dict({"model": "m", "strategy": "experts", "stages": gpu_bench.planned_stages("experts")})
    budget = stage_budget(next(st for st in plan.stages if not st.is_cpu), None) + GPU_RUNTIME_RESERVE
    assert abs(budget / (24 << 30) - 0.92) < 0.001


def test_autos_picks_in_the_bench_use_what_its_stages_would_measure_here(monkeypatch):
    """Issue 48, item 4: the bench's auto@c picks come from the node's figures as a live `auto` measures them (the
    cpu part in the CPU stage's environment, timing the model's own experts: the 235B's W4A16 ones), not from the
    cost model's defaults."""
    from vllm_hybrid import node
    monkeypatch.setattr(gpu_bench, "MODEL", "qwen3-235b-a22b-w4a16")
    monkeypatch.setattr(gpu_bench, "box_memory", lambda: (81559, 131072))
    monkeypatch.setattr(gpu_bench, "cpu_tuning", lambda: {"env": {"HYBRID_CPUS": "0-1"}})
    monkeypatch.setenv(node.MEASURE_BYTES_ENV, str(64 << 20))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    figures = gpu_bench.node_figures()
    # 64 MiB hold 6 of its 9.7 MB experts: it times top-8 at least
    assert figures["moe_experts_held"] == 8 and figures["moe_expert_gbs"] > 0 and figures["dram_gbs"] > 0
    assert "copy_gbs" not in figures and figures["gpu_measure_s"] >= 0  # no CUDA here
    measured, default = gpu_bench.planned_splits(figures), gpu_bench.planned_splits()
    assert measured["node_figures"] == figures and default["node_figures"] is None
    assert measured["auto@1"]["predicted_tok_s"] != default["auto@1"]["predicted_tok_s"]


def test_the_plans_node_figures_are_timed_with_the_kernel_the_cpu_stages_run(monkeypatch):
    """The cpu part of node_figures() runs in the CPU stages' tuned environment, kernel included (bench/cpu_kernels.py's
    pick, as every configuration's CPU stage and a live auto's get it): its layer timing is what pipeline's stage runs."""
    from vllm_hybrid import node
    seen = {}
    monkeypatch.setattr(gpu_bench, "MODEL", "mixtral-8x7b-w4a16")
    monkeypatch.setattr(gpu_bench, "cpu_tuning", lambda: {"env": {"HYBRID_CPUS": "1-15", "VLLM_CPU_SGL_KERNEL": "0"}})
    monkeypatch.setattr(node, "measured_part", lambda part, env: seen.setdefault(part, env) and {})
    gpu_bench.node_figures()
    assert seen["cpu"]["VLLM_CPU_SGL_KERNEL"] == "0" and seen["cpu"]["HYBRID_CPUS"] == "1-15"
    assert seen["cpu"]["CUDA_VISIBLE_DEVICES"] == "" and "gpu" in seen


def test_p_experts_rows_gives_an_explicit_experts_plan_what_auto_would_have_measured(monkeypatch):
    """p-experts-rows: the node's figures as the plan's `hardware`, so an explicit `strategy: experts` gets the pod's
    step limit auto would set (W4A16 Mixtral at 24 GiB on the 2026-11-29 H200 lease's figures: 32 tokens with the GPU's
    in-place share of one of a layer's two remote experts, 8 with the pod alone); without them the limit stays 64."""
    from vllm_hybrid.plan import plan_from_dict
    from vllm_hybrid.planner import model_shape, split_layers
    from vllm_hybrid.strategies import get, hardware_of
    from vllm_hybrid.strategies.experts import pod_rows
    monkeypatch.setattr(gpu_bench, "MODEL", "mixtral-8x7b-w4a16")
    monkeypatch.setattr(gpu_bench, "box_memory", lambda: (143771, 128887))
    monkeypatch.setattr(gpu_bench, "GPU_BUDGET_MIB", 24 * 1024)
    monkeypatch.setattr(gpu_bench, "cpu_tuning", lambda: {"env": {"HYBRID_CPUS": "1-15"}})
    monkeypatch.setenv("HYBRID_BENCH_NODE_FIGURES", str(Path(gpu_bench.__file__).parent / "results"
                                                        / "gpu_bench-mixtral-w4a16-24gib-h200-2026-11-29.json"))
    lease = gpu_bench.lease_figures()  # that lease's, not measured here: the file says so
    assert lease["from_file"] == 1.0 and lease["copy_gbs"] == 55.05
    hardware = gpu_bench.measured_hardware(lease)
    assert hardware["moe_expert_gbs"] == 71.4 and hardware["prefetch_pcie_gbs"] == 55.05
    rows = {}
    for name, given in (("measured", hardware), ("plain", None)):
        plan = plan_from_dict({"model": "m", "dtype": "bfloat16", "strategy": "experts", **gpu_bench.SHAPE,
                               "stages": gpu_bench.planned_stages("experts"), **({"hardware": given} if given else {})})
        split = split_layers(plan, model_shape(gpu_bench.MODELS[gpu_bench.MODEL]), None, get("experts"))
        lay = get("experts").layout(plan, split)
        rows[name] = pod_rows(plan, split, lay, hardware_of(plan))
        rows[name + " alone"] = pod_rows(plan, split, lay, hardware_of(plan), shared=False)
    assert rows == {"measured": 32, "measured alone": 8, "plain": 64, "plain alone": 64}


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@pytest.mark.parametrize("lease_file, bound", [
    ("gpu_bench-coproc-int8-h200-2026-12-02.json", "bound = 3.49 GB (llama-3.1-8b-int8)"),  # int8 weights: a byte each
    ("gpu_bench-coproc-bf16-h200-2026-12-02.json", "bound = 6.98 GB (llama-3.1-8b)"),
])
def test_the_reports_bound_reads_the_bytes_of_the_model_the_runs_served(tmp_path, lease_file, bound):
    """Issue 48 item 5: an INT8 run's bound is its 16 streamed layers' int8 bytes, not the bf16 shape's."""
    path = tmp_path / "gpu_bench.json"
    lease = json.loads((RESULTS / lease_file).read_text())
    lease.pop("model", None)  # a file from before the field: the model is read off the shape folder its plan names
    path.write_text(json.dumps(lease))
    report.main(str(path))
    md = path.with_suffix(".md").read_text()
    assert bound in md
    gb, dram = float(bound.split()[2]), lease["dram_read_gbs"]
    assert f"over its bound ({1e3 * gb / dram + report.GPU_STEP_MS:.1f} ms)" in md


def test_a_results_file_of_another_model_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_bench, "OUT", tmp_path)
    monkeypatch.setattr(gpu_bench, "MODEL", "llama-3.1-8b-int8")
    monkeypatch.setattr(gpu_bench.signal, "signal", lambda *a: None)
    monkeypatch.setattr(gpu_bench, "make_shaped_model", lambda *a: pytest.fail("built a model"))
    (tmp_path / "gpu_bench.json").write_text(json.dumps({"model": "llama-3.1-8b", "e-coproc": {"waves": []}}))
    with pytest.raises(SystemExit, match="holds runs of llama-3.1-8b, not llama-3.1-8b-int8"):
        gpu_bench.main(["e-coproc"])
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["e-coproc"] == {"waves": []}  # nothing lost


def test_the_reports_auto_column_counts_every_run_of_the_picked_strategy():
    """p-experts-rows and a live p-auto that resolved experts both serve `experts`: the pick is held against the
    fastest of them (2026-12-07: the live auto, on its own figures, ran experts with 32 pod rows against the named
    run's 4)."""
    md = report.planned_table(json.loads((RESULTS / "gpu_bench-mixtral-w4a16-24gib-auto-h100-2026-12-07.json").read_text()))
    assert report.ran({"strategy": "auto", "resolved": [{"strategy": "experts"}]}) == "experts"
    assert "| decode tok/s, concurrency 1 | 33.64 | 34.51 | 34.7 | pipeline | 0.97x |" in md
    assert "| decode tok/s, concurrency 16 | 100.57 | 167.07 | 190.36 | experts | 1.00x |" in md


def test_a_run_stopped_by_the_calls_timeout_keeps_the_waves_it_measured(tmp_path, monkeypatch):
    """A device call's limit stops run.sh with SIGTERM, which the bench turns into SystemExit: gpu_bench.json keeps the
    stopped configuration's waves, TTFTs and resolved strategy so far, and the earlier configurations (the 235B's
    p-auto, cut during its TTFT runs on 2026-12-07e, wrote nothing)."""
    monkeypatch.setattr(gpu_bench, "OUT", tmp_path)
    monkeypatch.setattr(gpu_bench, "make_shaped_model", lambda *a: "m")
    monkeypatch.setattr(gpu_bench, "read_dram", lambda results: None)

    def done(model):
        return {"waves": [{"concurrency": 1, "decode_tok_per_s": 9.0}], "ttft_s": {}}

    def cut(model):
        gpu_bench.SO_FAR.update(strategy="auto", resolved=[{"strategy": "experts"}])
        gpu_bench.SO_FAR.update(waves=[{"concurrency": 1, "decode_tok_per_s": 17.29}], ttft_s={})
        gpu_bench.stop_on_sigterm()  # what the SIGTERM handler does
    monkeypatch.setattr(gpu_bench, "CONFIGS", {"a-done": done, "b-cut": cut, "c-never": done})
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            gpu_bench.main(["a-done", "b-cut", "c-never"])
    finally:  # main's handler and the handler's SIG_IGN: not this pytest's
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 143
    got = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert got["a-done"]["waves"][0]["decode_tok_per_s"] == 9.0 and "c-never" not in got
    assert got["b-cut"]["waves"][0]["decode_tok_per_s"] == 17.29 and "SystemExit(143)" in got["b-cut"]["stopped"]
    assert report.ran(got["b-cut"]) == "experts" and "wall_s" in got["b-cut"]
