"""Single-process vLLM reference: greedy token ids (and top logprobs) per prompt, one at a time.

Run as a script (vLLM spawns workers, so it needs the __main__ guard):
    python reference_generate.py SPEC.json OUT.json
SPEC: {"model", "dtype", "prompts", "max_tokens", "logprobs", "gpu_memory_utilization", "moe_backend" (optional),
       "score_generated" (optional: also score each prompt's own continuation teacher-forced, as pipelines.score),
       "score" (optional: [[prompt ids, continuation], ...] to score teacher-forced)}
OUT: one {"ids", "top", "prompt_ids" (, "scores")} per prompt, then one {"scores"} per pair of "score"
"""
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sys.path.insert(0, str(Path(__file__).parent / "runtime"))
    from pipelines import scored

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=512, block_size=128, max_num_seqs=8,
              max_num_batched_tokens=512, enforce_eager=spec.get("enforce_eager", True), seed=0,
              gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.9),
              moe_backend=spec.get("moe_backend", "auto"))
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))

    def score(prompt_ids: list[int], continuation: list[int]) -> list[dict]:
        """Teacher-forced: prompt_logprobs over prompt + continuation, at the continuation's tokens."""
        r = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids + continuation)],
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
        positions = [{str(t): {"logprob": lp.logprob, "rank": lp.rank} for t, lp in pos.items()}
                     for pos in r.prompt_logprobs[len(prompt_ids):]]
        return [scored(entry, token) for token, entry in zip(continuation, positions)]

    out = []
    for prompt in spec["prompts"]:  # one prompt per call: the batch shape of sequential API requests
        r = llm.generate([prompt], params)[0]
        o = r.outputs[0]
        top = [sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1]) for pos in (o.logprobs or [])]
        out.append({"ids": list(o.token_ids), "top": top, "prompt_ids": list(r.prompt_token_ids)})
        if spec.get("score_generated"):
            out[-1]["scores"] = score(out[-1]["prompt_ids"], out[-1]["ids"])
    out += [{"scores": score(prompt_ids, continuation)} for prompt_ids, continuation in spec.get("score", [])]
    # written whole or not at all (a rename): the caller can tell a finished answer from a run that died before it
    with open(sys.argv[2] + ".part", "w") as f:
        json.dump(out, f)
    os.replace(sys.argv[2] + ".part", sys.argv[2])
