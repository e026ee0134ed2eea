"""A BENCH STUB of an OpenAI-compatible reasoning server with a latency model (not vLLM; for benchmarks only).

What it models, so that a scheduler's use of a GPU server can be timed in
minutes on a CPU:

- a cap on concurrent sequences (vLLM's ``--max-num-seqs``): at most
  ``max_seqs`` requests decode at once, the others wait in arrival order;
- a per-sequence decode rate: a response of L tokens decodes for
  L / ``tokens_per_s`` seconds once admitted (a batch's sequences decode in
  parallel, as on a GPU below its compute limit);
- response lengths drawn from a long-tailed (log-normal) distribution, capped
  at the request's ``max_tokens`` (``finish_reason`` ``length`` then, as vLLM
  says), fixed per sample id (:func:`completion_tokens`), so that a benchmark
  can compute the ideal schedule of the very same lengths.

Each response carries what vLLM returns with a reasoning parser and
``return_token_ids``: ``message.reasoning``, ``message.content`` (null when
cut), ``usage``, ``prompt_token_ids`` and ``choices[0].token_ids`` (L ids).
It serves ``/health``, ``/v1/models`` (with ``max_model_len``) and
``/v1/chat/completions``; it counts what it served at ``/stub/stats``: the
sample requests' admission and end times, for the benchmark's figures.

Run: ``python bench/latency_stub.py --port 8011 --max-seqs 128 --tokens-per-s 205``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import statistics
import time
import urllib.parse

CANARY_ID = "eagle3-canary"  # eagle3_assets.core.generation.completions.CANARY_ID: the pre-flight's request
SAMPLE_ID_HEADER = "X-Eagle3-Sample-Id"
_NORMAL = statistics.NormalDist()


def completion_tokens(sample_id: str, max_tokens: int, median: float, sigma: float) -> int:
    """The response length of ``sample_id``: log-normal (``median``, ``sigma``) from a hash of the id, capped at ``max_tokens``."""
    digest = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big")
    quantile = (digest + 0.5) / 2**64
    return max(1, min(max_tokens, int(round(median * math.exp(sigma * _NORMAL.inv_cdf(quantile))))))


def serve(port: int, max_seqs: int, tokens_per_s: float, median: float, sigma: float, max_model_len: int, model: str) -> None:
    from aiohttp import web

    slots = asyncio.Semaphore(max_seqs)
    served: list[tuple[str, float, float]] = []  # (sample id, admitted, ended), sample requests only
    models = json.dumps({"object": "list", "data": [{"id": model, "object": "model", "max_model_len": max_model_len}]}).encode()

    async def chat(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        sample_id = urllib.parse.unquote(request.headers.get(SAMPLE_ID_HEADER, ""))
        max_tokens = int(body.get("max_tokens") or max_model_len)
        length = min(32, max_tokens) if sample_id in ("", CANARY_ID) else completion_tokens(sample_id, max_tokens, median, sigma)
        async with slots:
            admitted = time.time()
            await asyncio.sleep(length / tokens_per_s)
            ended = time.time()
        if sample_id not in ("", CANARY_ID):
            served.append((sample_id, admitted, ended))
        cut = length >= max_tokens
        prompt_ids = list(range(100, 100 + 8 + len(json.dumps(body.get("messages", []))) // 16))
        reply = {
            "id": f"chatcmpl-stub-{len(served)}", "object": "chat.completion", "model": model,
            "prompt_token_ids": prompt_ids,
            "choices": [{
                "index": 0, "finish_reason": "length" if cut else "stop", "token_ids": [1000 + (i % 5000) for i in range(length)],
                "message": {"role": "assistant", "reasoning": f"Working through it ({length} tokens of thought).",
                            "content": None if cut else "The answer is 42."},
            }],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": length, "total_tokens": len(prompt_ids) + length},
        }  # fmt: skip
        return web.Response(body=json.dumps(reply).encode(), content_type="application/json")

    async def stats(_: web.Request) -> web.Response:
        return web.Response(body=json.dumps({"served": served}).encode(), content_type="application/json")

    app = web.Application(client_max_size=64 * 1024**2)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda _: web.Response(text=""))
    app.router.add_get("/v1/models", lambda _: web.Response(body=models, content_type="application/json"))
    app.router.add_get("/stub/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-seqs", type=int, default=128)
    parser.add_argument("--tokens-per-s", type=float, default=205.0, help="decode rate of one sequence")
    parser.add_argument("--median", type=float, default=300.0, help="median response length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the response lengths")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--model", default="latency-stub")
    args = parser.parse_args()
    serve(args.port, args.max_seqs, args.tokens_per_s, args.median, args.sigma, args.max_model_len, args.model)


if __name__ == "__main__":
    main()
