"""Real weights end to end: SmolLM2-135M-Instruct (`vllm-hybrid prepare-model`, cached under build/)
on a 3-stage CPU pipeline with an uneven split gives the greedy tokens of single-process vLLM and the
right answers to factual questions; the OpenAI Python client and vLLM's own `vllm bench serve` run
against it unchanged."""
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from pipelines import plan_for, reference
from vllm_hybrid.local import LocalPipeline, post_json
from vllm_hybrid.realmodel import DEFAULT_DIR, prepare_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NAME = "smollm2"
LAYERS = [7, 10, 13]  # of 30: uneven, every stage a different size
FACTS = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
         ("What is 2 + 2?", "4"), ("What is the chemical symbol for gold?", "Au"),
         ("What is the boiling point of water in Celsius?", "100")]
MAX_TOKENS = 16  # 3 stages on 2 cores share a core: ~0.5 s a token, so short answers
ANSWER_TOKENS = 20  # enough for every answer above (most end with <|im_end|> sooner)


@pytest.fixture(scope="module")
def smollm2():
    # the repo's build/ cache, shared with `make demo`: dequantized once per checkout
    return prepare_model(ROOT / DEFAULT_DIR)


@pytest.fixture(scope="module")
def prompts(smollm2):
    """Chat-formatted questions (what the model was tuned on) and one plain-text continuation."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q, _ in FACTS[:2]]
    return [*chats, "The three primary colors are"]


@pytest.fixture(scope="module")
def pipeline(smollm2, tmp_path_factory):
    plan = plan_for(smollm2, served_model_name=NAME)
    plan["stages"] = [{"name": f"s{i}", "device": "cpu", "layers": n, "cpus": 1, "memory": "4Gi"}
                      for i, n in enumerate(LAYERS)]
    envs = [{"HYBRID_CPUS": str(i % (os.cpu_count() or 1))} for i in range(len(LAYERS))]
    pipe = LocalPipeline(plan, tmp_path_factory.mktemp("smollm2"), envs).start()
    try:
        pipe.wait_ready()
        yield pipe
    finally:
        codes = pipe.stop()
        assert all(c is not None for c in codes), "a stage did not exit after SIGTERM"


def test_prepared_model_dir_is_complete(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # plain float32 weights, nothing left for a GGUF kernel
    assert (smollm2 / "model.safetensors").stat().st_size > 500 << 20
    assert "<|im_start|>" in (smollm2 / "chat_template.jinja").read_text()
    # stages run as uid 1000 on a volume prepared by root: every file readable, every dir searchable
    modes = {p.name: p.stat().st_mode & 0o777 for p in (smollm2, *smollm2.iterdir())}
    assert set(modes.values()) <= {0o644, 0o755} and modes["model.safetensors"] == 0o644, modes


def test_greedy_tokens_match_single_process(pipeline, smollm2, prompts):
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    want = [r["ids"] for r in reference(smollm2, prompts, MAX_TOKENS, env=env)]
    got = []
    for prompt in prompts:
        r = post_json(pipeline.url + "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        got.append(r["choices"][0]["token_ids"])
    assert all(len(ids) == MAX_TOKENS for ids in got)
    assert got == want
    resolved = [json.loads(pipeline.log(i).split("vllm-hybrid resolved ", 1)[1].splitlines()[0]) for i in range(3)]
    assert [r["layers"] for r in resolved] == ["0-6", "7-16", "17-29"]


@pytest.fixture(scope="module")
def client(pipeline):
    return openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def test_openai_client_gets_factual_answers(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    for question, expected in FACTS:
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                           temperature=0, max_tokens=ANSWER_TOKENS)
        answer = r.choices[0].message.content
        assert expected in answer, (question, answer)


def test_openai_client_streams_the_answer(client):
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": FACTS[0][0]}],
                                            temperature=0, max_tokens=ANSWER_TOKENS, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 3 and "Paris" in "".join(chunks)


def test_vllm_bench_serve_runs_unchanged(pipeline, smollm2, tmp_path):
    n, out_len = 8, 16
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", pipeline.url, "--model", NAME,
           "--tokenizer", str(smollm2), "--dataset-name", "random", "--random-input-len", "32",
           "--random-output-len", str(out_len), "--num-prompts", str(n), "--ignore-eos", "--seed", "0",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    print("vllm bench serve:", {k: result[k] for k in ("completed", "failed", "duration", "output_throughput",
                                                       "mean_ttft_ms", "mean_tpot_ms") if k in result})
    assert result["completed"] == n and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == n * out_len
