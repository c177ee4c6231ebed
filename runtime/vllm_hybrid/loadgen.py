"""A small OpenAI-API load client: one wave of C concurrent streaming requests (stdlib only)."""
from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request


def stream_completion(url: str, model: str, prompt, max_tokens: int, timeout: float = 600) -> dict:
    """One streaming completion; returns time to first token, end-to-end time and tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": tokens}


def wave(url: str, model: str, prompts: list, max_tokens: int) -> dict:
    """All prompts at once; output tokens/s = all tokens / wall time of the wave."""
    results: list[dict | Exception] = [None] * len(prompts)  # type: ignore[list-item]

    def one(i):
        try:
            results[i] = stream_completion(url, model, prompts[i], max_tokens)
        except Exception as e:  # noqa: BLE001 - reported, not raised, so the wave finishes
            results[i] = e

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, dict)]
    tokens = sum(r["tokens"] for r in ok)
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    return {"concurrency": len(prompts), "ok": len(ok), "failed": len(prompts) - len(ok), "wall_s": round(wall, 3),
            "output_tokens": tokens, "tok_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "ms_per_token_per_seq": round(1000 * statistics.mean(r["e2e"] / max(1, r["tokens"]) for r in ok), 2) if ok else None,
            # time per output token after the first: the decode step as one request sees it
            "tpot_ms": round(1000 * statistics.mean((r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in decoded), 2)
            if (decoded := [r for r in ok if r["ttft"] is not None and r["tokens"] > 1]) else None,
            "errors": [repr(r) for r in results if not isinstance(r, dict)][:3]}


def token_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of `length` token ids (no prefix-cache hits between them)."""
    return [[(seed + 7919 * i + 104729 * j) % (vocab - 10) + 5 for j in range(length)] for i in range(n)]
