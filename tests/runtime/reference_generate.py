"""Single-process vLLM reference: greedy token ids for each prompt, one prompt at a time.

Run as a script (vLLM spawns workers, so it needs the __main__ guard):
    python reference_generate.py MODEL OUT.json MAX_TOKENS PROMPT...
"""
import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model, out, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    llm = LLM(model=model, dtype="float32", max_model_len=512, block_size=128, max_num_seqs=8,
              max_num_batched_tokens=512, enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # one prompt per call: the same batch shape as the sequential requests sent to the pipeline
    ids = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
    json.dump(ids, open(out, "w"))
