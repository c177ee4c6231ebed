"""Single-process vLLM reference: greedy token ids (and top logprobs) per prompt, one at a time.

Run as a script (vLLM spawns workers, so it needs the __main__ guard):
    python reference_generate.py SPEC.json OUT.json
SPEC: {"model", "dtype", "prompts", "max_tokens", "logprobs", "gpu_memory_utilization", "moe_backend" (optional)}
"""
import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=512, block_size=128, max_num_seqs=8,
              max_num_batched_tokens=512, enforce_eager=True, seed=0,
              gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.9),
              moe_backend=spec.get("moe_backend", "auto"))
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    out = []
    for prompt in spec["prompts"]:  # one prompt per call: the batch shape of sequential API requests
        o = llm.generate([prompt], params)[0].outputs[0]
        top = [sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1]) for pos in (o.logprobs or [])]
        out.append({"ids": list(o.token_ids), "top": top})
    json.dump(out, open(sys.argv[2], "w"))
