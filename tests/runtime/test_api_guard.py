"""api_guard.RequestGuard on its own (no vLLM): what it refuses on any POST, what it counts as prompts and `n`, and
that what it lets through reaches the app unchanged. The real server's endpoints: test_pipeline_cpu.py."""
import asyncio
import json

import pytest
from vllm_hybrid.api_guard import RequestGuard


def call(body: bytes | dict, method="POST", path="/anything", content_type: bytes | None = b"application/json",
         chunk: int = 1 << 20):
    """(status, json answer, what the app received or None when it was not called)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    parts = [raw[i:i + chunk] for i in range(0, len(raw), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    messages.append({"type": "http.disconnect"})
    sent, seen = [], {}

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        first, after = await receive(), await receive()
        seen.update(body=first["body"], more=first["more_body"], after=after["type"], path=scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    headers = [(b"content-type", content_type)] if content_type else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(RequestGuard(app)(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"]), seen or None


@pytest.fixture(autouse=True)
def limits(monkeypatch):
    monkeypatch.setenv("HYBRID_MAX_BODY_BYTES", "1000")
    monkeypatch.setenv("HYBRID_MAX_PROMPTS_PER_REQUEST", "3")
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "2")


def test_defaults_are_openais(monkeypatch):
    for name in ("HYBRID_MAX_BODY_BYTES", "HYBRID_MAX_PROMPTS_PER_REQUEST", "VLLM_MAX_N_SEQUENCES"):
        monkeypatch.delenv(name)
    guard = RequestGuard(None)
    assert (guard.max_body, guard.max_prompts, guard.max_n) == (32 << 20, 2048, 128)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/pooling", "/invocations", "/no/such/route"])
def test_any_post_over_the_body_cap_gets_413_naming_the_setting(path):
    status, answer, seen = call(b'{"prompt": "' + b"x" * 1000 + b'"}', path=path, chunk=100)
    assert (status, seen) == (413, None)
    assert answer["error"]["code"] == 413
    assert answer["error"]["message"].startswith("request body larger than 1000 bytes; set HYBRID_MAX_BODY_BYTES")
    assert "spec.stages[0].env" in answer["error"]["message"]


def test_a_body_at_the_cap_passes_whole_and_once():
    body = b'{"prompt": "' + b"x" * (1000 - 14) + b'"}'
    assert len(body) == 1000
    status, _, seen = call(body, path="/detokenize", chunk=300)
    assert status == 200
    assert seen == {"body": body, "more": False, "after": "http.disconnect", "path": "/detokenize"}


@pytest.mark.parametrize("body,kind", [(b"[1, 2]", "list"), (b'"text"', "str"), (b"7", "int"), (b"null", "NoneType")])
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/score", "/invocations"])
def test_a_json_body_that_is_not_an_object_gets_400(path, body, kind):
    status, answer, seen = call(body, path=path)
    assert (status, seen) == (400, None)
    assert answer == {"error": {"message": f"request body must be a JSON object, got {kind}", "type": "BadRequestError",
                                "param": None, "code": 400}}


def test_a_body_without_content_type_is_checked_as_json_as_fastapi_reads_it():
    assert call(b"[1]", content_type=None)[0] == 400
    assert call({"prompt": ["a"] * 4}, content_type=None)[0] == 400


@pytest.mark.parametrize("body", [b"[1]", json.dumps({"prompt": ["a"] * 9}).encode()])
def test_a_body_that_is_not_json_passes(body):
    assert call(body, content_type=b"multipart/form-data; boundary=x")[0] == 200


@pytest.mark.parametrize("body", [b"{not json", b"", b'{"prompt": "\xff"}'])
def test_malformed_json_is_left_to_vllm(body):
    assert call(body)[0] == 200


def test_other_methods_and_scopes_pass_untouched():
    assert call(b"[1]", method="GET")[0] == 200
    sent = []

    async def app(scope, receive, send):
        sent.append(scope["type"])

    asyncio.run(RequestGuard(app)({"type": "lifespan"}, None, None))
    assert sent == ["lifespan"]


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
# (field, a value of exactly 3 prompts, the endpoints that take it)
PROMPT_LISTS = [
    ("prompt", ["a", "b", "c"], "completions"),
    ("prompt", [[1, 2], [3], [4, 5]], "completions, token ids"),
    ("messages", [CONVERSATION] * 3, "chat/completions/batch"),
    ("input", ["a", "b", "c"], "embeddings, pooling, classify"),
    ("input", [[1], [2], [3]], "embeddings, token ids"),
    ("input", [CONVERSATION] * 3, "embeddings, batch of conversations"),
    ("documents", ["a", "b", "c"], "rerank, score"),
    ("queries", ["a", "b", "c"], "score"),
    ("text_2", ["a", "b", "c"], "score"),
    ("data_1", ["a", "b", "c"], "score"),
    ("items", [[1], [2], [3]], "generative_scoring"),
]


@pytest.mark.parametrize("field,value,what", PROMPT_LISTS, ids=[f"{p[0]}: {p[2]}" for p in PROMPT_LISTS])
def test_prompts_per_request_are_bounded(field, value, what):
    status, _, seen = call({"model": "m", field: value})
    assert status == 200 and json.loads(seen["body"]) == {"model": "m", field: value}
    status, answer, seen = call({"model": "m", field: value + value[:1]})
    assert (status, seen) == (400, None)
    assert answer["error"]["param"] == field
    assert answer["error"]["message"] == (f"4 prompts in `{field}`: at most 3 in one request; set "
                                          "HYBRID_MAX_PROMPTS_PER_REQUEST in the first stage's env "
                                          "(spec.stages[0].env of the HybridInference) to raise it")


@pytest.mark.parametrize("field,value", [
    ("prompt", list(range(50))),  # one prompt of token ids
    ("prompt", "a long text"),
    ("messages", CONVERSATION * 5),  # one conversation: chat/completions, v1/messages
    ("input", CONVERSATION * 5),  # one conversation: embeddings' chat form
    ("input", [{"type": "message", "role": "user", "content": "x"}] * 5),  # v1/responses' items
    ("documents", [{"title": "t", "text": "x"}] * 5),  # chat/completions' documents for a RAG template: one prompt
    ("stop", ["a", "b", "c", "d", "e"]),
])
def test_what_is_one_prompt_is_not_counted_as_many(field, value):
    assert call({field: value})[0] == 200


@pytest.mark.parametrize("body,at_limit", [({"n": 3}, {"n": 2}), ({"n": 3.0}, {"n": 2.0}),
                                           ({"sampling_params": {"n": 3}}, {"sampling_params": {"n": 2}})])
def test_n_is_bounded(body, at_limit):
    status, answer, seen = call({"model": "m", **body})
    assert (status, seen) == (400, None)
    assert answer["error"]["param"] == "n"
    assert answer["error"]["message"] == (f"n = {body.get('n', 3)}: at most 2; set VLLM_MAX_N_SEQUENCES in the first "
                                          "stage's env (spec.stages[0].env of the HybridInference) to raise it")
    assert call({"model": "m", **at_limit})[0] == 200


@pytest.mark.parametrize("n", ["9", None, True, [9], {"n": "9"}])
def test_an_n_that_is_no_number_is_left_to_vllm(n):
    assert call({"n": n, "sampling_params": n})[0] == 200


@pytest.mark.parametrize("field,value,bad", [("prompt", [1, 439], 439), ("prompt", [[1, 2], [3, 500]], 500),
                                             ("token_ids", [439], 439), ("prompt", [-1, 2], -1)])
def test_a_token_id_past_the_vocabulary_gets_400(monkeypatch, field, value, bad):
    """vLLM 0.26 lets the id equal to the tokenizer's vocab_size through its own check; with prompt_logprobs it kills
    the engine (test_pipeline_cpu.py shows the pipeline answering 400 and serving on)."""
    monkeypatch.setenv("HYBRID_VOCAB_SIZE", "439")
    status, answer, seen = call({"model": "m", field: value})
    assert (status, seen) == (400, None)
    assert answer["error"] == {"message": f"token id {bad} in `{field}` is outside the model's vocabulary (0-438)",
                               "type": "BadRequestError", "param": field, "code": 400}


@pytest.mark.parametrize("value", [[0, 438], [[1, 2], [438]], ["text", "more text"], "text", [True, 2]])
def test_token_ids_in_the_vocabulary_and_text_pass(monkeypatch, value):
    monkeypatch.setenv("HYBRID_VOCAB_SIZE", "439")
    assert call({"model": "m", "prompt": value})[0] == 200


def test_without_the_launchers_vocabulary_token_ids_are_left_to_vllm():
    assert call({"model": "m", "prompt": [439]})[0] == 200
