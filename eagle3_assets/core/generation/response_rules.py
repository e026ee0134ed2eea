"""What makes a generated response unusable, in one place for generation and validation.

Generation re-sends a sample on the next run of its shard when its response
failed for a reason a new generation can fix; validation rejects the same rows
with the same reason. Both read :func:`content_failure`, so they cannot
disagree: a row validation would reject as ``empty_reasoning`` is exactly a row
a rerun sends again (until the sample has used ``max_attempts_per_sample``).

The reasons, tested in this order (the first that applies is the row's):

- ``truncated``: the generation hit ``max_tokens`` (``finish_reason == "length"``),
  unless truncated generations are allowed;
- ``not_stopped``: any other end than ``stop`` (``abort``, ``error``,
  ``repetition``, none);
- ``empty_reasoning``: no reasoning after stripping whitespace (a server
  without its reasoning parser, or a client reading the wrong field);
- ``empty_content``: no answer after stripping whitespace.

Rows that ended in a request error are not content failures: they have no
response at all, and a rerun always sends them again. A prompt longer than
the server's context (``prompt_too_long``) is never sent: no rerun can fix it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import polars as pl

# The error kind of a row settled without a request: the prompt alone does not fit the server's context.
PROMPT_TOO_LONG = "prompt_too_long"

# Requests over a sample's whole life (every run, transport retries included) after which a content failure
# is kept as it is instead of being sent again: a prompt that always truncates must not be re-sent for ever.
DEFAULT_MAX_ATTEMPTS_PER_SAMPLE = 3

# The least share of answered rows with reasoning before a shard is blocked (raw_responses and validated_traces).
DEFAULT_MIN_REASONING_SHARE = 0.98

# What to do when responses come back without reasoning: said by the canary, and by every gate that counts it.
NO_REASONING_DIAGNOSIS = (
    "Serve the model with a --reasoning-parser for it, and check that its chat template lets it think "
    "(extra_body.chat_template_kwargs)."
)

# Reason code -> what it means, in the order the reasons are tested.
RETRYABLE_CONTENT_REASONS: dict[str, str] = {
    "truncated": "generation hit max_tokens (finish_reason 'length')",
    "not_stopped": "generation ended for another reason than 'stop' (abort, error, repetition, none)",
    "empty_reasoning": "no reasoning after stripping whitespace",
    "empty_content": "no answer after stripping whitespace",
}

_COLUMNS = ("reasoning", "content", "finish_reason")


def blank(column: str) -> pl.Expr:
    return pl.col(column).is_null() | (pl.col(column).str.strip_chars() == "")


def content_failure(allow_truncated: bool) -> pl.Expr:
    """The reason (a key of RETRYABLE_CONTENT_REASONS) a response cannot pass validation, or null.

    Meant for rows that got a response (``error`` is null); it reads
    ``finish_reason``, ``reasoning`` and ``content``.
    """
    finish = pl.col("finish_reason")
    return (
        pl.when((finish == "length").fill_null(False) & (not allow_truncated))
        .then(pl.lit("truncated"))
        .when(~finish.is_in(["stop", "length"]).fill_null(False))
        .then(pl.lit("not_stopped"))
        .when(blank("reasoning"))
        .then(pl.lit("empty_reasoning"))
        .when(blank("content"))
        .then(pl.lit("empty_content"))
        .otherwise(pl.lit(None, dtype=pl.String))
    )


def is_prompt_too_long() -> pl.Expr:
    return pl.col("error").str.starts_with(f"{PROMPT_TOO_LONG}:").fill_null(False)


def content_failures(rows: Iterable[Mapping[str, Any]], allow_truncated: bool) -> dict[str, str]:
    """{id: reason} for the rows (dicts of the raw_responses contract) that got a response validation would reject."""
    answered = [{"id": r["id"], **{c: r.get(c) for c in _COLUMNS}} for r in rows if r.get("error") is None]
    if not answered:
        return {}
    frame = pl.DataFrame(answered, schema={"id": pl.String, **{c: pl.String for c in _COLUMNS}})
    failed = frame.select("id", content_failure(allow_truncated).alias("reason")).filter(pl.col("reason").is_not_null())
    return dict(failed.iter_rows())
