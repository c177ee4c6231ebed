"""ASGI middleware on stage 0's API (added with vLLM's --middleware): rejects request bodies vLLM
would crash on (a JSON array or scalar answers 500 in vLLM 0.26) or that are too large, with the
OpenAI-style error a client expects. Everything else passes through untouched."""
from __future__ import annotations

import json
import os

MAX_BODY_BYTES = int(os.environ.get("HYBRID_MAX_BODY_BYTES", str(32 << 20)))


def _error(status: int, message: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None,
                                 "code": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


class RequestGuard:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > MAX_BODY_BYTES:
                return await self._reply(send, 413, f"request body larger than {MAX_BODY_BYTES} bytes")
        body = b"".join(chunks)
        content_type = dict(scope.get("headers", [])).get(b"content-type", b"")
        if b"json" in content_type:
            try:
                parsed = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                parsed = {}  # vLLM answers malformed JSON with a clear 400 itself
            if not isinstance(parsed, dict):
                return await self._reply(send, 400, f"request body must be a JSON object, got {type(parsed).__name__}")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    @staticmethod
    async def _reply(send, status: int, message: str) -> None:
        start, body = _error(status, message)
        await send(start)
        await send({"type": "http.response.body", "body": body})
