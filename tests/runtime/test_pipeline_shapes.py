"""Other pipeline shapes give exactly the greedy tokens of single-process vLLM on the same weights:
tensor parallelism inside every stage (2 stages x TP 2, four CPU workers), three stages,
compiled (not eager) CPU stages, stages whose GEMMs are split with a GEMM helper (balanced), and a
mixture-of-experts model (Mixtral)."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from pipelines import CPU_ENVS, MAX_TOKENS, PROMPTS, plan_for, reference
from vllm_hybrid.local import LocalPipeline, post_json

pytestmark = pytest.mark.slow


def complete(pipe, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return post_json(pipe.url + "/v1/completions", body)["choices"][0]["token_ids"]


def alone_and_together(plan, workdir, envs):
    """Greedy tokens of PROMPTS one at a time (1 row per step), then all at once; and the stage logs."""
    pipe = LocalPipeline(plan, workdir, envs).start()
    try:
        pipe.wait_ready(timeout=900)
        alone = [complete(pipe, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: complete(pipe, p), PROMPTS))
        return alone, together, [pipe.log(i) for i in (0, 1)]
    finally:
        pipe.stop()


def resolved(log):
    return json.loads(log.split("vllm-hybrid resolved ", 1)[1].splitlines()[0])


def test_tp2_per_stage_matches_single_process(tiny_llama, reference_ids, tmp_path):
    plan = plan_for(tiny_llama)
    for stage in plan["stages"]:
        stage.update(tensor_parallel=2, cpus=2)
    # stage 0 with an inductor cache of its own (the last stage compiles upstream's sampler, into the shared one)
    inductor = tmp_path / "inductor"
    envs = [{"HYBRID_CPUS": "0-1", "TORCHINDUCTOR_CACHE_DIR": str(inductor)}, {"HYBRID_CPUS": "0-1"}]
    pipe = LocalPipeline(plan, tmp_path, envs).start()
    try:
        pipe.wait_ready(timeout=600)
        got = [complete(pipe, p) for p in PROMPTS]
        logs = [pipe.log(i) for i in (0, 1)]
    finally:
        pipe.stop()
    # four workers ran, one per (stage, TP rank), each in its own stage's process tree
    for stage, log in enumerate(logs):
        assert f"Worker_PP{stage}_TP0" in log and f"Worker_PP{stage}_TP1" in log
    assert "tensor_parallel_size=2, pipeline_parallel_size=2" in logs[0]
    # an eager first stage compiles nothing, not even upstream's TP-only masked-input kernel (its ranks raced on
    # one inductor lock: in CI one waited out the lock's 600 s)
    assert not list(inductor.rglob("*.so")), sorted(p.name for p in inductor.rglob("*.so"))
    assert got == reference_ids


def test_three_stages_match_single_process(tiny_llama, reference_ids, tmp_path):
    plan = plan_for(tiny_llama)
    plan["stages"] = [{"name": f"s{i}", "device": "cpu", "layers": n, "cpus": 1, "memory": "4Gi"}
                      for i, n in enumerate([1, 1, 2])]
    envs = [{"HYBRID_CPUS": str(i % (os.cpu_count() or 1))} for i in range(3)]
    pipe = LocalPipeline(plan, tmp_path, envs).start()
    try:
        pipe.wait_ready()
        got = [complete(pipe, p) for p in PROMPTS]
        layers = [resolved(pipe.log(i))["layers"] for i in range(3)]
    finally:
        pipe.stop()
    assert layers == ["0-0", "1-1", "2-3"]
    assert got == reference_ids


def test_compiled_stages_match_single_process(tiny_llama, reference_ids, tmp_path):
    # the other tests run eager for speed; vLLM compiles CPU models by default (traced once for
    # every batch size): sequential requests (1 row per step) and concurrent ones give the same tokens
    alone, together, logs = alone_and_together(plan_for(tiny_llama, extra_args=[]), tmp_path, CPU_ENVS)
    assert all("AOT compil" in log for log in logs)  # each stage compiled its model (or loaded it)
    assert alone == reference_ids
    assert together == reference_ids


def test_split_gemms_match_single_process(tiny_llama, reference_ids, tmp_path):
    # strategy balanced without a GPU: both stages split every GEMM with one GEMM helper process
    # (on the CPU here; the GPU machine runs it on CUDA), compiled graphs calling the split op
    sock = str(tmp_path / "helper.gemm")
    helper = subprocess.Popen([sys.executable, "-m", "vllm_hybrid.strategies.balanced.gemm_helper", "--socket", sock, "--device", "cpu"],
                              stdout=open(tmp_path / "helper.log", "wb"), stderr=subprocess.STDOUT)
    split = {"HYBRID_GEMM_SOCKET": sock, "HYBRID_SPLIT_SHARE": "0.5", "HYBRID_STRATEGY": "balanced"}
    try:
        alone, together, logs = alone_and_together(plan_for(tiny_llama, extra_args=[]), tmp_path,
                                                   [{**e, **split} for e in CPU_ENVS])
    finally:
        helper.terminate()
        helper.wait(10)
    for log in logs:  # stage 0: 1 layer (4 GEMMs); stage 1: 3 layers and the LM head
        assert "GEMMs of" in log and "split with the GEMM helper on cpu" in log
        assert "loaded in place" in log  # the loader wrote the weights straight into the shared region
    assert "GEMMs of 4 linear layers" in logs[0] and "GEMMs of 13 linear layers" in logs[1]
    assert (tmp_path / "helper.log").read_text().count("serving") == 2
    assert alone == reference_ids
    assert together == reference_ids
    assert not os.path.exists(sock)  # the helper removes its socket when stopped


def test_mixture_of_experts_stages_match_single_process(tiny_mixtral, tmp_path):
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    want = [r["ids"] for r in reference(tiny_mixtral, PROMPTS, MAX_TOKENS, env=env)]
    pipe = LocalPipeline(plan_for(tiny_mixtral), tmp_path, CPU_ENVS).start()
    try:
        pipe.wait_ready(timeout=900)
        got = [complete(pipe, p) for p in PROMPTS]
        layers = [resolved(pipe.log(i))["layers"] for i in (0, 1)]
        engine = pipe.log(1)
    finally:
        pipe.stop()
    assert layers == ["0-0", "1-3"]
    assert "MixtralForCausalLM" in engine
    assert got == want
