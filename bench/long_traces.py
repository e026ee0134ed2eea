"""The long-trace target's generated traces: their lengths and how often they break the format.

    .venv/bin/python bench/long_traces.py [--data-dir data]
    .venv/bin/python bench/long_traces.py --generate --temperatures 1.0 0.6 0.3 [--save responses.jsonl]

Without ``--generate`` it reads ``<data>/prompts/*.parquet`` (each row's last
user question) and ``<data>/raw_responses/*.parquet`` (what the target wrote, as
vLLM returned it) of a ``make demo DEMO_TARGET=long`` run: it measures what the
run wrote and generates nothing. With ``--generate`` it serves the built long
target (``EAGLE3_LONG_TARGET_DIR``, built and checked if missing) with the
demo's serving profile, one vLLM start, and sends the long demo's 64 prompts
at each temperature in turn (the demo's 8,192 completion tokens and 128 in
flight, the generation's default top_p 0.95). Either way every response is checked with
:func:`eagle3_assets.demo.long_prompts.format_break`, and it prints the
breaks by kind, how many started from the question's own step count, and the
completion tokens (p50, p95, max) of all responses and of those in format.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import polars as pl

from eagle3_assets.demo.long_prompts import format_break, steps_as_asked
from eagle3_assets.demo.prompt_set import write_jsonl


def last_question(messages: list[dict]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


def percentile(values: list[int], share: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0


def read_rows(data_dir: Path) -> list[dict]:
    prompt_files = [f for f in sorted((data_dir / "prompts").glob("*.parquet")) if f.name.count(".") == 1]
    if not prompt_files:
        raise SystemExit(f"{data_dir}/prompts: no prompt shard (run `make demo DEMO_TARGET=long` first)")
    questions = {}
    for path in prompt_files:
        for row in pl.read_parquet(path, columns=["id", "messages"]).iter_rows(named=True):
            questions[row["id"]] = last_question(row["messages"])
    rows = []
    for path in sorted((data_dir / "raw_responses").glob("*.parquet")):
        frame = pl.read_parquet(path, columns=["id", "reasoning", "content", "finish_reason", "completion_tokens", "error"])
        rows += [r | {"question": questions[r["id"]]} for r in frame.iter_rows(named=True) if r["id"] in questions and not r["error"]]
    if not rows:
        raise SystemExit(f"{data_dir}/raw_responses: no response of the prompt set's ids")
    return rows


def break_kind(why: str) -> str:
    """A break's reason without its particulars (line numbers, the line's text), to count by kind."""
    return re.sub(r"line \d+ '.*' is not", "a line is not", re.sub(r"line \d+ counts \d+ after \d+", "a line skips the count", why))


def generated_rows(temperatures: list[float]) -> dict[float, list[dict]]:
    """The long demo's prompts, each sampled once at each temperature from one start of the served long target."""
    import asyncio

    from eagle3_assets.core.generation.completions import parse_completion
    from eagle3_assets.core.generation.config import Sampling
    from eagle3_assets.core.generation.openai_client import async_openai_client
    from eagle3_assets.demo.long_prompts import make_conversations
    from eagle3_assets.demo.plugin import LONG_SAMPLING
    from eagle3_assets.demo.serve import demo_server

    conversations = [messages for messages, _, _ in make_conversations(64, 1)]  # long_prompts(): the demo's set

    async def one(client, model: str, messages: list[dict], temperature: float, slots: asyncio.Semaphore) -> dict:
        async with slots:
            reply = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=LONG_SAMPLING["max_tokens"], temperature=temperature, top_p=Sampling().top_p
            )
        row = parse_completion(reply.model_dump())  # the platform's reader: either name of the reasoning field
        return {"question": last_question(messages), **{key: row[key] for key in ("reasoning", "content", "finish_reason", "completion_tokens")}}

    async def run(server) -> dict[float, list[dict]]:
        slots = asyncio.Semaphore(LONG_SAMPLING["concurrency"])
        async with async_openai_client(server.base_url) as client:
            return {
                t: await asyncio.gather(*(one(client, server.served_model_name, m, t, slots) for m in conversations)) for t in temperatures
            }  # fmt: skip

    with demo_server("long", port=0) as server:
        return asyncio.run(run(server))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--generate", action="store_true", help="serve the long target and generate here, instead of reading a run")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0], help="with --generate: one pass of the prompts at each")
    parser.add_argument("--save", type=Path, help="with --generate: write every response here (JSON lines), to read the breaks")
    args = parser.parse_args()
    if args.generate:
        generated = generated_rows(args.temperatures)
        if args.save:
            write_jsonl(args.save, [{"temperature": t, **row} for t, rows in generated.items() for row in rows])
        for temperature, rows in generated.items():
            print(f"\ntemperature {temperature}:")
            report(rows)
    else:
        report(read_rows(args.data_dir))


def report(rows: list[dict]) -> None:
    kinds: Counter = Counter()
    kept, as_asked = [], 0
    for row in rows:
        why = format_break(row["question"], row["reasoning"], row["content"], row["finish_reason"])
        if why is None:
            kept.append(row["completion_tokens"])
            as_asked += bool(steps_as_asked(row["question"], row["reasoning"]))
        else:
            kinds[break_kind(why)] += 1
    every = [r["completion_tokens"] for r in rows]
    print(f"responses: {len(rows)}; in format: {len(kept)} ({len(kept) / len(rows):.0%}), of which {as_asked} start from the question's step count")
    for kind, count in kinds.most_common():
        print(f"  break: {count:3d}  {kind}")
    for label, values in (("all", every), ("in format", kept)):
        if values:
            print(f"completion tokens, {label}: p50 {percentile(values, 0.5):,} p95 {percentile(values, 0.95):,} max {max(values):,}")


if __name__ == "__main__":
    main()
