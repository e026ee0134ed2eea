"""Read a prompt dataset and normalise it to ``id`` + chat ``messages``.

Rows come from :mod:`.prompt_sources`; each is normalised (or rejected) by
:mod:`.prompt_records`.

A bad row (including a JSONL line that is not UTF-8) is rejected with a reason code
and keeps its place in the row count, so shard boundaries never depend on how many
rows were bad. A file that cannot be read at all (missing, not Parquet) raises
:class:`DatasetReadError` naming the file.

Loading a shard reads that shard's rows only: a JSONL file through its line index,
a Parquet file by row slice; the duplicate-id check asks the dataset's id index
(see :mod:`eagle3_assets.core.prompts.dataset_index`). A hub dataset is streamed from its
first row, as it offers no random access.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from eagle3_assets.core.prompts.sharding import row_range
from eagle3_assets.core.prompts.records import MESSAGES_DTYPE, RowRejected, judge_row
from eagle3_assets.core.prompts.sources import open_dataset

PROMPTS_SCHEMA = {"row_index": pl.Int64, "id": pl.String, "messages": MESSAGES_DTYPE}
REJECTED_SCHEMA = {"row_index": pl.Int64, "id": pl.String, "reason": pl.String, "detail": pl.String}


@dataclass(frozen=True)
class ShardPrompts:
    accepted: pl.DataFrame  # PROMPTS_SCHEMA
    rejected: pl.DataFrame  # REJECTED_SCHEMA
    indexes: dict[str, str] = field(default_factory=dict)  # index name -> "reused" / "extended" / "built"



def load_shard(source: str, key: str, shard_size: int) -> ShardPrompts:
    """Normalise the rows of one shard; duplicates are judged against every earlier row.

    Reads the shard's own rows; the earlier rows are consulted through the dataset's
    id index (built once per version of the file), not re-read.
    """
    rows = row_range(key, shard_size)
    dataset = open_dataset(source)
    judged = [(row, judge_row(row)) for row in dataset.rows(rows.start, rows.stop)]
    candidates = {outcome[0] for _, outcome in judged if isinstance(outcome, tuple)}
    seen, indexes = dataset.ids_before(candidates, rows.start)
    accepted: list[dict] = []
    rejected: list[dict] = []
    for row, outcome in judged:
        if isinstance(outcome, RowRejected):
            rejected.append(_rejection(row.row_index, None, outcome.reason, outcome.detail))
            continue
        sample_id, messages = outcome
        if sample_id in seen:
            rejected.append(_rejection(row.row_index, sample_id, "duplicate_id", f"id {sample_id} appeared earlier"))
            continue
        seen.add(sample_id)
        accepted.append({"row_index": row.row_index, "id": sample_id, "messages": messages})
    return ShardPrompts(
        accepted=pl.DataFrame(accepted, schema=PROMPTS_SCHEMA),
        rejected=pl.DataFrame(rejected, schema=REJECTED_SCHEMA),
        indexes=indexes,
    )



def _rejection(row_index: int, sample_id: str | None, reason: str, detail: str) -> dict:
    return {"row_index": row_index, "id": sample_id, "reason": reason, "detail": detail}


def count_rows(source: str) -> int:
    """Rows in the dataset, bad ones included: what the shard keys are computed from."""
    return open_dataset(source).count()
