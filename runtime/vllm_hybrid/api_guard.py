"""ASGI middleware on stage 0's API (added with vLLM's --middleware): every POST, whatever its path, is refused
with the OpenAI-style error a client expects when its body is too large, is JSON but not an object (vLLM 0.26
answers an array or scalar with 500), asks for more prompts or a larger `n` than the limits below (each is a
sequence to schedule: unbounded, one small request can queue a million), or gives a token id past the model's
vocabulary (vLLM 0.26's check, InputProcessor._validate_model_input, lets the id equal to the tokenizer's vocab_size
through: with prompt_logprobs, or where the embedding is not padded past it, that id kills the engine).
Everything else passes through untouched."""
from __future__ import annotations

import json
import os

# the fields whose list items are one prompt each when a text, a token-id list or a conversation (a token id or a
# dict is part of one: a chat message, a responses item; score's rare multimodal dicts go uncounted): completions'
# `prompt`, embeddings'/pooling's `input`, batch chat's `messages`, score's and rerank's `queries`/`documents`/
# `text_1`/`text_2`/`data_1`/`data_2`, generative scoring's `items`
PROMPT_FIELDS = ("prompt", "input", "messages", "queries", "documents", "items", "text_1", "text_2", "data_1", "data_2")
# the fields that may carry token ids: completions' `prompt` (a list of ids, or of such lists), generate's `token_ids`
TOKEN_FIELDS = ("prompt", "token_ids")
RAISE = "; set {} in the first stage's env (spec.stages[0].env of the HybridInference) to raise it"


def _past(value, vocab: int) -> int | None:
    """The first token id (an int in a list of ints, or in a list of such lists) outside 0..vocab-1; None if none."""
    if not isinstance(value, list):
        return None
    for item in value:
        ids = item if isinstance(item, list) else [item]
        bad = next((t for t in ids if isinstance(t, int) and not isinstance(t, bool) and (t >= vocab or t < 0)), None)
        if bad is not None:
            return bad
    return None


def _error(status: int, message: str, param: str | None = None) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


class RequestGuard:
    def __init__(self, app):
        self.app = app
        self.max_body = int(os.environ.get("HYBRID_MAX_BODY_BYTES", 32 << 20))
        # OpenAI's own caps: an embeddings request takes at most 2048 inputs, `n` at most 128. `n` reads vLLM's own
        # setting, so one knob raises both: vLLM's default (16384) is far above that, and beam search's width skips it
        self.max_prompts = int(os.environ.get("HYBRID_MAX_PROMPTS_PER_REQUEST", 2048))
        self.max_n = int(os.environ.get("VLLM_MAX_N_SEQUENCES", 128))
        self.vocab = int(os.environ.get("HYBRID_VOCAB_SIZE") or 0)  # the launcher's, from the model's config (0: unchecked)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await self._reply(send, 413, f"request body larger than {self.max_body} bytes"
                                         + RAISE.format("HYBRID_MAX_BODY_BYTES"))
        body = b"".join(chunks)
        # FastAPI reads a body without a content type as JSON too
        if b"json" in dict(scope.get("headers", [])).get(b"content-type", b"json").lower():
            try:
                parsed = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                parsed = {}  # vLLM answers malformed JSON with a clear 400 itself
            if not isinstance(parsed, dict):
                return await self._reply(send, 400, f"request body must be a JSON object, got {type(parsed).__name__}")
            if refusal := self._over_limits(parsed):
                return await self._reply(send, 400, *refusal)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _over_limits(self, body: dict) -> tuple[str, str] | None:
        for field in PROMPT_FIELDS:
            items = body.get(field)
            prompts = sum(isinstance(p, (str, list)) for p in items) if isinstance(items, list) else 0
            if prompts > self.max_prompts:
                return (f"{prompts} prompts in `{field}`: at most {self.max_prompts} in one request"
                        + RAISE.format("HYBRID_MAX_PROMPTS_PER_REQUEST"), field)
        for field in TOKEN_FIELDS:
            if self.vocab and (bad := _past(body.get(field), self.vocab)) is not None:
                return (f"token id {bad} in `{field}` is outside the model's vocabulary (0-{self.vocab - 1})", field)
        params = body.get("sampling_params")  # /inference/v1/generate carries vLLM's SamplingParams
        for n in (body.get("n"), params.get("n") if isinstance(params, dict) else None):
            if isinstance(n, (int, float)) and n > self.max_n:  # pydantic takes 129.0 as 129
                return f"n = {n}: at most {self.max_n}" + RAISE.format("VLLM_MAX_N_SEQUENCES"), "n"
        return None

    @staticmethod
    async def _reply(send, status: int, message: str, param: str | None = None) -> None:
        start, body = _error(status, message, param)
        await send(start)
        await send({"type": "http.response.body", "body": body})
