"""Prompts held out of training, for measuring the draft on the user's own distribution.

A row is held out by a hash of its question (the text of its last turn), not by
its id or its position: the choice never changes when the dataset grows or is
re-sharded, it needs no pass over the dataset, and every copy of a question that
the dataset repeats under other ids falls on the same side. (Hashing the id split
such copies, so a held-out question was also trained on and ``draft_evaluation``
refused the set, on every rerun.) ``prompts`` writes a shard's held-out rows to
``<shard>.heldout.parquet`` beside its training rows, so no held-out prompt can
reach a trace, a hidden state or the draft; ``draft_evaluation`` reads them back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import polars as pl

from eagle3_assets.core.prompts.loading import MESSAGES_DTYPE
from eagle3_assets.core.storage.shard_paths import HELDOUT_SUFFIX


def question_text(messages: list[dict]) -> str:
    """What makes two prompts the same question: the text of the last turn (the one the model answers)."""
    return messages[-1]["content"] if messages else ""


def is_held_out(question: str, share: float) -> bool:
    """Whether ``question`` falls in the held-out ``share`` (0 to 1) of all questions."""
    if share <= 0:
        return False
    bucket = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    return bucket < share


def split_held_out(prompts: pl.DataFrame, share: float) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(training rows, held-out rows) of a shard's prompts."""
    mask = pl.Series([is_held_out(question_text(m), share) for m in prompts["messages"].to_list()], dtype=pl.Boolean)
    return prompts.filter(~mask), prompts.filter(mask)


def held_out_prompts(prompts_dir: Path, limit: int) -> pl.DataFrame:
    """Up to ``limit`` held-out rows (``id``, ``messages``) of the materialised shards, in shard order."""
    files = sorted(Path(prompts_dir).glob(f"shard-*{HELDOUT_SUFFIX}"))
    frames = [pl.read_parquet(f, columns=["id", "messages"]) for f in files]
    rows = pl.concat(frames) if frames else pl.DataFrame(schema={"id": pl.String, "messages": MESSAGES_DTYPE})
    return rows.head(limit)
