"""Shared by the CPU pipeline tests (and tests/gpu): prompts, a 2-stage plan, the vLLM reference."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_hybrid.local import local_ports, post_json

PROMPTS = ["Hello pipeline", "The first stage holds one layer and the second", "gpu cpu node pod",
           "One two three four five six seven eight nine ten"]
MAX_TOKENS = 40
# the tiny gpt-oss's runs (conftest's fixtures and the tests that compare with them): here, not in conftest, which
# another folder's conftest can stand in for when pytest collects both
GPT_OSS_TOKENS = 16
GPT_OSS_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def plan_for(model, **over):
    plan = {"model": str(model), "served_model_name": "tiny", "dtype": "float32", "max_model_len": 512,
            "block_size": 128, "max_num_seqs": 8, "max_num_batched_tokens": 512,
            "extra_args": ["--enforce-eager"], **local_ports(),
            "stages": [{"name": "head", "device": "cpu", "layers": 1, "cpus": 1, "memory": "4Gi"},
                       {"name": "tail", "device": "cpu", "layers": 3, "cpus": 1, "memory": "4Gi"}]}
    plan.update(over)
    return plan


CPU_ENVS = [{"HYBRID_CPUS": "0"}, {"HYBRID_CPUS": "1" if (os.cpu_count() or 1) > 1 else "0"}]


def reference(model, prompts, max_tokens, dtype="float32", env=None, python=sys.executable, **extra):
    """Greedy outputs of single-process vLLM (tests/reference_generate.py) in a subprocess."""
    work = Path(tempfile.mkdtemp())
    spec = {"model": str(model), "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens, **extra}
    (work / "spec.json").write_text(json.dumps(spec))
    # plain vLLM, with only the plugin's opt-in memory of torch's vector-ISA probes (16 s of each start on 2 cores),
    # on the GEMMs the launcher picks for every cpu stage (VLLM_CPU_SGL_KERNEL: on an AMX CPU oneDNN's W8A8 rounds
    # otherwise, and the tiny int8 Llama's tokens parted at its 23rd)
    run = subprocess.run([python, str(Path(__file__).parents[1] / "reference_generate.py"), str(work / "spec.json"),
                          str(work / "out.json")], env={"VLLM_CPU_SGL_KERNEL": "1", **os.environ,
                                                         "HYBRID_REMEMBER_VEC_ISA": "1", **(env or {})},
                         timeout=900)
    # its answer is written last and whole: a process that died after it (vLLM's CPU build once aborted in its
    # teardown, "terminate called without an active exception", gpt-oss on an H200 lease) still answered
    if not (work / "out.json").exists():
        run.check_returncode()
    return json.loads((work / "out.json").read_text())


def score(url: str, prompt_ids: list[int], continuation: list[int], model: str = "tiny") -> list[dict]:
    """Teacher-forced through a served model's completions API (vLLM's prompt_logprobs: one prefill, no sampling):
    at each token of `continuation`, its logprob after everything before it, and the model's own two best candidates
    there."""
    r = post_json(url + "/v1/completions", {"model": model, "prompt": prompt_ids + continuation, "max_tokens": 1,
                                             "temperature": 0, "prompt_logprobs": 2})
    positions = r["choices"][0]["prompt_logprobs"][len(prompt_ids):]
    return [scored(entry, token) for token, entry in zip(continuation, positions)]


def scored(entry: dict, token: int) -> dict:
    """One position of prompt_logprobs ({token id: {"logprob", "rank"}}, the API's and reference_generate's)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1]["rank"])
    return {"logprob": entry[str(token)]["logprob"], "top": int(ranked[0][0]), "top_logprob": ranked[0][1]["logprob"],
            "second_logprob": ranked[1][1]["logprob"] if len(ranked) > 1 else None}


def drift(ref: list[dict], got: list[dict]) -> dict:
    """Two teacher-forced scorings of the same tokens: the largest and the mean difference of a token's logprob, and
    each position where their best candidates differ, with the reference's margin there (its top-2 gap)."""
    diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(ref, got)]
    return {"max_logprob_diff": round(max(diffs), 5), "mean_logprob_diff": round(sum(diffs) / len(diffs), 5),
            "flips": [{"at": i, "ref_margin": round(a["top_logprob"] - a["second_logprob"], 5)}
                      for i, (a, b) in enumerate(zip(ref, got)) if a["top"] != b["top"]]}
