"""The figures of a finished ``raw_responses`` shard, Dagster-free: the asset turns them into metadata."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import polars as pl

from eagle3_assets.core.reporting.markdown import markdown_histogram
from eagle3_assets.core.generation.response_rules import PROMPT_TOO_LONG


def shard_summary(frame: pl.DataFrame) -> dict[str, Any]:
    """The figures of a finished shard (Dagster-free; the asset turns them into metadata)."""
    errors = frame.filter(pl.col("error").is_not_null())
    too_long = errors.filter(pl.col("error").str.starts_with(f"{PROMPT_TOO_LONG}:"))
    ok = frame.filter(pl.col("error").is_null())
    no_reasoning = ok.filter(pl.col("reasoning").fill_null("").str.strip_chars() == "")
    latency = ok["latency_s"].drop_nulls()  # adopted rows have no latency: no request was timed
    return {
        "rows": frame.height,
        "errors": errors.height,
        "request_errors": errors.height - too_long.height,  # requests that failed (prompts too long were never sent)
        "prompts_too_long": too_long.height,
        "prompts_too_long_ids": too_long["id"].head(10).to_list(),
        "answered_rows": ok.height,
        "errors_by_kind": dict(Counter(e.split(":", 1)[0] for e in errors["error"].to_list())),
        "error_examples": [f"{r['id']}: {r['error'][:160]}" for r in errors.head(10).iter_rows(named=True)],
        "rows_without_reasoning": no_reasoning.height,
        "rows_without_reasoning_ids": no_reasoning["id"].to_list(),
        "finish_reasons": dict(Counter(str(r) for r in ok["finish_reason"].to_list())),
        "reasoning_fields": dict(Counter(ok["reasoning_field"].to_list())),
        # Answered rows that carry the server's generated ids (validation checks the supervised tokens against them).
        "rows_with_token_ids": ok.filter(pl.col("output_token_ids").is_not_null()).height if "output_token_ids" in ok.columns else 0,
        "completion_tokens": int(ok["completion_tokens"].fill_null(0).sum()),
        "latency_p50_s": float(latency.quantile(0.5, "nearest")) if latency.len() else None,
        "latency_p95_s": float(latency.quantile(0.95, "nearest")) if latency.len() else None,
    }


def completion_length_histogram(lengths: Sequence[int], bins: int = 12, width: int = 30) -> str:
    """Completion lengths as a markdown histogram, with the median and maximum under it."""
    values = [v for v in lengths if v is not None]
    table = markdown_histogram(values, label="completion tokens", empty="_no completions_", bins=bins, bar_width=width)
    if not values:
        return table
    return table + f"\n\n{len(values)} completions; median {sorted(values)[len(values) // 2]}, max {max(values)} tokens."

