"""The long-trace target's generated traces, read back from a data directory: their lengths and how often they break the format.

    .venv/bin/python bench/long_traces.py [--data-dir data]

Reads ``<data>/prompts/*.parquet`` (each row's last user question) and
``<data>/raw_responses/*.parquet`` (what the target wrote, as vLLM returned it)
of a ``make demo DEMO_TARGET=long`` run, checks every response with
:func:`eagle3_assets.demo.long_prompts.format_break`, and prints the count of
breaks by kind, how many started from the question's own step count, and the
completion tokens (p50, p95, max) of all responses and of those in format.
Measures what the run wrote; generates nothing.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import polars as pl

from eagle3_assets.demo.long_prompts import format_break, steps_as_asked


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    args = parser.parse_args()
    rows = read_rows(args.data_dir)
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
