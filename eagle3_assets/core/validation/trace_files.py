"""The files ``validated_traces`` reads and writes: their column contracts, checked before a shard is trusted.

An input file that is missing, or lacks a contract's column, or holds it in
another type, stops the validation with :class:`ValidationInputError` naming the
file and the column, before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.prompts.records import MESSAGES_DTYPE

RAW_RESPONSES_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,
    "reasoning": pl.String,
    "content": pl.String,
    "reasoning_field": pl.String,
    "finish_reason": pl.String,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "latency_s": pl.Float64,
    "server": pl.String,
    "model": pl.String,
    "attempts": pl.Int64,
    "error": pl.String,
    "prompt_token_ids": pl.List(pl.Int64),
    "output_token_ids": pl.List(pl.Int64),
}
# The columns validation reads; the others are the generation stage's bookkeeping.
_RAW_COLUMNS_READ = ("id", "reasoning", "content", "reasoning_field", "finish_reason", "error")
# Read when present; files written before the server's ids were kept (or by a server that returns none) lack them.
_RAW_OPTIONAL_COLUMNS = ("prompt_token_ids", "output_token_ids")

KEPT_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,
    "messages": MESSAGES_DTYPE,
    "reasoning": pl.String,
    "content": pl.String,
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.Int8),
    "num_tokens": pl.Int64,
}
REJECTED_SCHEMA: dict[str, pl.DataType] = {"id": pl.String, "reason": pl.String, "detail": pl.String}


class ValidationInputError(ValueError):
    """An input shard file is missing or does not follow its contract."""



def scan_checked(path: Path, schema: dict[str, pl.DataType], what: str, columns: Sequence[str], optional: Sequence[str] = ()) -> pl.LazyFrame:
    """A lazy scan of an input shard file, after checking it exists and has the contract's columns and types.

    ``optional`` columns are type-checked when present and read as nulls when the file has none.
    """
    path = Path(path)
    if not path.is_file():
        raise ValidationInputError(f"{what}: {path} does not exist (materialise that shard upstream first)")
    try:
        found = pl.scan_parquet(path).collect_schema()
    except Exception as exc:  # polars raises several kinds for a non-parquet file
        raise ValidationInputError(f"{what}: {path} is not a readable parquet file ({exc})") from exc
    missing = [c for c in columns if c not in found]
    if missing:
        raise ValidationInputError(f"{what}: {path} lacks column(s) {missing} (has {list(found)})")
    present = [*columns, *(c for c in optional if c in found)]
    wrong = {c: f"{found[c]} (expected {schema[c]})" for c in present if found[c] != schema[c] and found[c] != pl.Null}
    if wrong:
        raise ValidationInputError(f"{what}: {path} has column(s) of the wrong type: {wrong}")
    return pl.scan_parquet(path).select(
        [pl.col(c).cast(schema[c]) if c in found else pl.lit(None, dtype=schema[c]).alias(c) for c in [*columns, *optional]]
    )


def scan_prompts(path: Path) -> pl.LazyFrame:
    schema = {"id": pl.String, "messages": MESSAGES_DTYPE}
    return scan_checked(path, schema, "prompts", ["id", "messages"]).unique("id", keep="first", maintain_order=True)


def scan_raw_responses(path: Path) -> pl.LazyFrame:
    return scan_checked(path, RAW_RESPONSES_SCHEMA, "raw_responses", _RAW_COLUMNS_READ, optional=_RAW_OPTIONAL_COLUMNS)



def rows_in_batches(frame: pl.LazyFrame, batch_rows: int) -> Iterator[dict[str, Any]]:
    """The rows of a lazy frame, in order, read ``batch_rows`` at a time."""
    for batch in frame.collect_batches(chunk_size=batch_rows, engine="streaming"):
        yield from batch.iter_rows(named=True)


def written_ids(path: Path) -> list[str]:
    return pl.scan_parquet(path).select("id").collect()["id"].to_list()


def written_token_lengths(kept_path: Path) -> list[int]:
    return pl.scan_parquet(kept_path).select("num_tokens").collect()["num_tokens"].to_list()


# -- the gates (pure) -------------------------------------------------------------
