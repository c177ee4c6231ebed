"""End to end on CPU: a 2-stage pipeline started by the launcher from a plan file gives exactly
the greedy tokens of single-process vLLM on the same weights; streaming chat and /metrics work."""
import json
import os
import urllib.error

import httpx
import pytest
from pipelines import CPU_ENVS, MAX_TOKENS, PROMPTS, drift, plan_for, score
from vllm_hybrid.local import LocalPipeline, post_json
from vllm_hybrid.stage_metrics import scrape, scrape_text, total

pytestmark = pytest.mark.slow


# small request limits on stage 0, the API's (api_guard), so their tests need no huge request; the other tests send
# one prompt with n = 1
GUARD_ENV = {"HYBRID_MAX_PROMPTS_PER_REQUEST": "4", "VLLM_MAX_N_SEQUENCES": "3"}


@pytest.fixture(scope="module")
def pipeline(tiny_llama, tmp_path_factory):
    envs = [{**CPU_ENVS[0], **GUARD_ENV}, *CPU_ENVS[1:]]
    pipe = LocalPipeline(plan_for(tiny_llama), tmp_path_factory.mktemp("pipe"), envs).start()
    try:
        pipe.wait_ready()
        yield pipe
    finally:
        codes = pipe.stop()
        assert all(c is not None for c in codes), "a stage did not exit after SIGTERM"


def test_greedy_tokens_match_single_process(pipeline, reference_ids):
    got = []
    for prompt in PROMPTS:
        r = post_json(pipeline.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        got.append(r["choices"][0]["token_ids"])
    assert all(len(ids) == MAX_TOKENS for ids in got)
    assert got == reference_ids


def test_teacher_forced_scores_agree_with_generation_and_the_reference(pipeline, reference_outputs):
    """pipelines.score, the GPU tests' measure of how far two devices' kernels are apart, on the real pipeline: a
    greedy continuation scored teacher-forced has each token as the top candidate, with the logprob generation
    reported; and single-process vLLM's scoring of the same tokens (reference_generate) is the same, in float32."""
    r = post_json(pipeline.url + "/v1/completions", {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                                     "logprobs": 1})["choices"][0]
    scores = score(pipeline.url, r["prompt_token_ids"], r["token_ids"])
    assert [x["top"] for x in scores] == r["token_ids"] and all(x["logprob"] == x["top_logprob"] for x in scores)
    assert all(x["second_logprob"] < x["top_logprob"] for x in scores)
    assert max(abs(x["logprob"] - lp) for x, lp in zip(scores, r["logprobs"]["token_logprobs"])) < 1e-3
    for ref in reference_outputs:
        got = score(pipeline.url, ref["prompt_ids"], ref["ids"])
        report = drift(ref["scores"], got)
        assert report["flips"] == [] and report["max_logprob_diff"] < 1e-3, report
    # other tokens are scored as such: the measure tells two continuations apart
    other = score(pipeline.url, ref["prompt_ids"], [(t + 1) % 400 for t in ref["ids"]])
    apart = drift(ref["scores"], other)
    assert apart["max_logprob_diff"] > 1 and 0 < apart["mean_logprob_diff"] <= apart["max_logprob_diff"], apart


def test_a_token_id_past_the_vocabulary_is_refused_and_the_pipeline_serves_on(pipeline, tiny_llama):
    """vLLM 0.26 lets the id equal to the vocabulary's size through its own check (the tokenizer's vocab_size is a
    count), and with prompt_logprobs that id killed the engine of this pipeline (index out of bounds in the prompt
    logprobs' gather: EngineDeadError, the stages exit). The API guard answers 400 from the model's vocab_size."""
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    for ids in ([1, vocab], [[1, 2], [vocab + 7]]):
        with pytest.raises(urllib.error.HTTPError) as err:
            post_json(pipeline.url + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                         "prompt_logprobs": 1})
        assert err.value.code == 400
        assert f"is outside the model's vocabulary (0-{vocab - 1})" in json.loads(err.value.read())["error"]["message"]
    r = post_json(pipeline.url + "/v1/completions", {"model": "tiny", "prompt": [1, vocab - 1], "max_tokens": 2,
                                                     "prompt_logprobs": 1})
    assert len(r["choices"][0]["prompt_logprobs"]) == 2


def test_layer_split_is_what_the_plan_says(pipeline):
    logs = [pipeline.log(0), pipeline.log(1)]
    resolved = [json.loads(l.split("vllm-hybrid resolved ", 1)[1].splitlines()[0]) for l in logs]
    assert [r["layers"] for r in resolved] == ["0-0", "1-3"]
    assert [r["role"] for r in resolved] == ["api", "headless"]
    assert all("vllm_hybrid patches applied" in l for l in logs)


def test_one_thread_stages_fork_their_processes_and_pin_the_worker_to_the_stage_core(pipeline):
    """Each stage runs one OpenMP thread on its own core: vLLM's engine core and worker are forked, not spawned (one
    interpreter start each, vllm_patches.cpu.patch_cpu_engine_fork / patch_cpu_worker_fork), so the plugin ran once per stage,
    and the worker still sits on the stage's core, as vLLM's spawned worker did through OMP_PLACES."""
    import re
    for i, env in enumerate(CPU_ENVS):
        log = pipeline.log(i)
        assert log.count("vllm_hybrid patches applied") == 1, log[-3000:]
        pid = int(re.search(rf"Worker_PP{i} pid=(\d+)", log).group(1))
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
        assert status["Cpus_allowed_list"].strip() == env["HYBRID_CPUS"]


def test_streaming_chat(pipeline):
    body = {"model": "tiny", "stream": True, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}]}
    chunks = []
    with httpx.stream("POST", pipeline.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(chunks) >= 16 and text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_metrics_served(pipeline):
    text = scrape_text(pipeline.url + "/metrics")
    assert "vllm:generation_tokens_total" in text
    assert 'model_name="tiny"' in text


def metric(samples: dict[str, float], name: str, **labels) -> float:
    assert total({k: 1 for k in samples}, name, **labels), f"{name} {labels} not exported"
    return total(samples, name, **labels)


def test_every_stage_exports_pipeline_metrics(pipeline):
    post_json(pipeline.url + "/v1/completions", {"model": "tiny", "prompt": "metrics", "max_tokens": 8, "ignore_eos": True})
    head, tail = scrape(pipeline.metrics_url(0)), scrape(pipeline.metrics_url(1))
    for i, s in enumerate((head, tail)):
        assert metric(s, "hybrid_stage_step_seconds_count", stage=str(i), replica="0") > 0
        assert metric(s, "hybrid_stage_forward_seconds_count", stage=str(i)) > 0
        assert metric(s, "hybrid_stage_tokens_total", stage=str(i)) >= 8
        assert metric(s, "hybrid_stage_kv_blocks_total", stage=str(i)) > 0
    assert metric(head, "hybrid_stage_info", stage="0", device="cpu", layers="0-0", cpus="0") == 1
    assert metric(tail, "hybrid_stage_info", stage="1", layers="1-3", stage_name="tail") == 1
    # activations leave stage 0 and arrive at stage 1: the same bytes on both sides
    sent = metric(head, "hybrid_stage_transfer_bytes_total", direction="send")
    assert sent > 0 and sent == metric(tail, "hybrid_stage_transfer_bytes_total", direction="recv")


LONG = "word " * 700  # > max_model_len (512) tokens
BAD_REQUESTS = [
    ("completions", b"{not json", "invalid JSON"),
    ("completions", b"[1, 2, 3]", "JSON array body"),
    ("completions", b"", "empty body"),
    ("completions", b'{"model": "tiny", "prompt": "\xff\xfe\xfa"}', "invalid UTF-8"),
    ("completions", {"model": "nope", "prompt": "hi"}, "unknown model"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "negative max_tokens"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens wrong type"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, "huge max_tokens"),
    ("completions", {"model": "tiny", "prompt": LONG, "max_tokens": 4}, "prompt longer than the model length"),
    ("completions", {"model": "tiny", "prompt": {"a": 1}}, "prompt wrong type"),
    ("completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "negative temperature"),
    ("completions", {"model": "tiny", "prompt": "hi", "top_p": 2}, "top_p > 1"),
    ("completions", {"model": "tiny", "prompt": "hi", "n": 0}, "n = 0"),
    ("completions", {"model": "tiny", "prompt": "hi", "logprobs": 10**6}, "huge logprobs"),
    ("completions", {"model": "tiny", "prompt": "hi", "stop": 5}, "stop wrong type"),
    ("completions", {"model": "tiny", "prompt": "hi", "stream": {"on": 1}}, "stream wrong type"),
    ("completions", b'"just a string"', "JSON scalar body"),
    ("completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 50}, "presence_penalty out of range"),
    ("completions", {"model": "tiny", "prompt": "hi", "seed": "abc"}, "seed wrong type"),
    ("completions", {"model": "tiny", "prompt": [10**9]}, "token id beyond the vocabulary"),
    ("chat/completions", {"model": "tiny", "messages": "hello"}, "messages not a list"),
    ("chat/completions", {"model": "tiny", "messages": ["hi"]}, "message not an object"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 42}]}, "content wrong type"),
    ("chat/completions", {"model": "tiny", "messages": []}, "no messages"),
    ("completions", b'{"model": "tiny", "prompt": "' + b"x" * (64 << 20) + b'"}', "oversized body (64 MiB)"),
]


@pytest.mark.parametrize("path,body,what", BAD_REQUESTS, ids=[b[2] for b in BAD_REQUESTS])
def test_bad_request_gets_4xx(pipeline, path, body, what):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{pipeline.url}/v1/{path}", content=content, headers={"Content-Type": "application/json"},
                   timeout=120)
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    assert pipeline.healthy()


# every POST route vLLM 0.26 serves for this generate model (test_post_routes_are_these holds the list to what stage 0
# logged at start), then paths it does not serve here: the pooling models' and none at all
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
               "/v1/responses/{response_id}/cancel", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
               "/detokenize", "/ping", "/invocations", "/generative_scoring", "/scale_elastic_ep",
               "/is_scaling_elastic_ep", "/v1/chat/completions/render", "/v1/completions/render",
               "/v1/chat/completions/derender", "/v1/completions/derender", "/inference/v1/generate"]
UNSERVED = ["/pooling", "/score", "/rerank", "/classify", "/v1/embeddings", "/no/such/route"]
MAX_BODY = 32 << 20  # api_guard's default
JSON = {"Content-Type": "application/json"}


def test_post_routes_are_these(pipeline):
    import re
    routes = re.findall(r"Route: (\S+), Methods: (.+)", pipeline.log(0))
    assert {path for path, methods in routes if "POST" in methods} == set(POST_ROUTES)


@pytest.mark.parametrize("path", POST_ROUTES + UNSERVED)
def test_every_post_is_guarded(pipeline, path):
    url = pipeline.url + path.replace("{response_id}", "resp_1")
    big = httpx.post(url, content=b"x" * (MAX_BODY + 1), headers=JSON, timeout=120)
    assert big.status_code == 413, big.text[:300]
    assert big.json()["error"]["message"].startswith(f"request body larger than {MAX_BODY} bytes; set HYBRID_MAX_BODY_BYTES")
    array = httpx.post(url, content=b"[1, 2, 3]", headers=JSON, timeout=120)
    assert array.status_code == 400, array.text[:300]
    assert array.json()["error"]["message"] == "request body must be a JSON object, got list"
    assert pipeline.healthy()


def test_a_body_at_the_cap_is_served(pipeline):
    body = b'{"model": "tiny", "tokens": [1]}'
    r = httpx.post(pipeline.url + "/detokenize", content=body + b" " * (MAX_BODY - len(body)), headers=JSON, timeout=120)
    assert r.status_code == 200, r.text[:300]


CHAT = [{"role": "user", "content": "hi"}]
# (path, a request at the limit of GUARD_ENV, the field one more goes into, the answers it gets; None: a path not
# served here, which the guard still bounds)
BOUNDED = [
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", 4),
    ("/v1/completions", {"prompt": [[1, 2], [3], [4], [5]]}, "prompt", 4),
    ("/v1/completions/render", {"prompt": ["a", "b", "c", "d"]}, "prompt", 4),
    ("/invocations", {"prompt": ["a", "b", "c", "d"]}, "prompt", 4),
    ("/v1/chat/completions/batch", {"messages": [CHAT] * 4}, "messages", 4),
    ("/generative_scoring", {"query": "q", "items": ["a", "b", "c", "d"], "label_token_ids": [1, 2]}, "items", 4),
    ("/v1/embeddings", {"input": ["a", "b", "c", "d"]}, "input", None),
    ("/pooling", {"input": [[1], [2], [3], [4]]}, "input", None),
    ("/classify", {"input": ["a", "b", "c", "d"]}, "input", None),
    ("/score", {"text_1": "q", "text_2": ["a", "b", "c", "d"]}, "text_2", None),
    ("/rerank", {"query": "q", "documents": ["a", "b", "c", "d"]}, "documents", None),
    ("/v1/completions", {"prompt": "a", "n": 3, "temperature": 1}, "n", 3),
    ("/v1/completions", {"prompt": "a", "n": 3, "use_beam_search": True}, "n", 3),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "temperature": 1}, "n", 3),
    ("/invocations", {"messages": CHAT, "n": 3, "temperature": 1}, "n", 3),
    # output_kind 2 (FINAL_ONLY), as /v1/completions/render writes it: vLLM's default answers only the samples
    # that finished in the last step
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"n": 3, "temperature": 1, "max_tokens": 2,
                                                                         "output_kind": 2}}, "n", 3),
]


def one_more(body: dict, field: str) -> dict:
    if field != "n":
        return {**body, field: body[field] + body[field][:1]}
    if "sampling_params" in body:
        return {**body, "sampling_params": one_more(body["sampling_params"], "n")}
    return {**body, "n": body["n"] + 1}


@pytest.mark.parametrize("path,body,field,answers", BOUNDED, ids=[f"{b[0]} {b[2]}" for b in BOUNDED])
def test_prompts_and_n_are_bounded(pipeline, path, body, field, answers):
    body = {"model": "tiny", "max_tokens": 2, **body}
    limit, setting = (3, "VLLM_MAX_N_SEQUENCES") if field == "n" else (4, "HYBRID_MAX_PROMPTS_PER_REQUEST")
    over = httpx.post(pipeline.url + path, json=one_more(body, field), timeout=120)
    assert over.status_code == 400, over.text[:300]
    error = over.json()["error"]
    assert error["param"] == field and f"at most {limit}" in error["message"], error
    assert f"set {setting} in the first stage's env (spec.stages[0].env of the HybridInference)" in error["message"]
    r = httpx.post(pipeline.url + path, json=body, timeout=120)
    if answers is None:
        assert r.status_code == 404, r.text[:300]  # through the guard to vLLM, which serves no pooling here
        return
    assert r.status_code == 200, r.text[:300]
    got = r.json()
    assert len(got if isinstance(got, list) else got.get("choices") or got["data"]) == answers


def test_still_serving_after_bad_input(pipeline):
    r = post_json(pipeline.url + "/v1/completions", {"model": "tiny", "prompt": "fine", "max_tokens": 4})
    assert r["usage"]["completion_tokens"] == 4


LOAD_SECONDS = float(os.environ.get("HYBRID_LOAD_SECONDS", "90"))  # 30 RSS samples, one each RSS_EVERY_S; CI has an hour
RSS_EVERY_S, WARM_S = 3, 30
LOAD_CLIENTS = 32


def stage_rss(pipe) -> int:
    from vllm_hybrid.supervise import process_tree
    total = 0
    for p in pipe.procs:
        for pid in process_tree(p.pid):
            try:
                total += int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
    return total


def test_bounded_load_no_failures_flat_memory(pipeline):
    """32 concurrent streaming clients on loopback for LOAD_SECONDS: no failed request, memory flat."""
    import statistics
    import threading
    import time

    from vllm_hybrid.loadgen import stream_completion

    deadline = time.monotonic() + LOAD_SECONDS
    results, failures, rss = [], [], []

    def client(k):
        i = 0
        while time.monotonic() < deadline:
            try:
                results.append(stream_completion(pipeline.url, "tiny", f"client {k} request {i} pipeline", 64))
            except Exception as e:  # noqa: BLE001 - counted, then asserted on
                failures.append(repr(e))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(LOAD_CLIENTS)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        rss.append(stage_rss(pipeline))
        time.sleep(RSS_EVERY_S)
    for t in threads:
        t.join()
    e2e = sorted(r["e2e"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    warm = rss[min(len(rss) - 1, WARM_S // RSS_EVERY_S)]  # the allocators' warm-up is over by then
    report = {"clients": LOAD_CLIENTS, "seconds": LOAD_SECONDS, "requests": len(results), "failed": len(failures),
              "tokens": sum(r["tokens"] for r in results),
              "ttft_s": {"p50": q(ttft, .5), "p90": q(ttft, .9), "p99": q(ttft, .99)},
              "e2e_s": {"p50": q(e2e, .5), "p90": q(e2e, .9), "p99": q(e2e, .99), "mean": statistics.mean(e2e)},
              "rss_mib": {"after_warmup": warm >> 20, "end": rss[-1] >> 20, "max": max(rss) >> 20}}
    (pipeline.workdir / "load.json").write_text(json.dumps(report, indent=1))
    print("load:", json.dumps(report))
    assert failures == [] and len(results) >= LOAD_CLIENTS
    assert all(r["tokens"] == 64 for r in results)
    assert rss[-1] <= warm * 1.10, report["rss_mib"]  # flat: < 10% growth after warm-up
