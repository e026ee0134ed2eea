"""Prompts held out of training, for measuring the draft on the user's own distribution.

A row is held out by a hash of its question (the text of its last turn), not by
its id or its position: the choice never changes when the dataset grows or is
re-sharded, it needs no pass over the dataset, and every copy of a question that
the dataset repeats under other ids falls on the same side. (Hashing the id split
such copies, so a held-out question was also trained on and ``draft_evaluation``
refused the set, on every rerun.) ``prompts`` writes a shard's held-out rows to
``<shard>.heldout.parquet`` beside its training rows, so no held-out prompt can
reach a trace, a hidden state or the draft; ``draft_evaluation`` reads them back.

A share alone can hold out too few prompts for a figure (1 % of 640 prompts
held out 3): the held-out set has a minimum size (:func:`plan_holdout`). Where
the share falls short of it, the share is raised to the least one whose
questions cover the minimum: the questions with the lowest hashes, the same
rule as before, so the split stays a function of the question. The plan says
which way it was reached, and ``prompts`` shows it in its metadata.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from eagle3_assets.core.prompts.records import MESSAGES_DTYPE
from eagle3_assets.core.storage.shard_paths import HELDOUT_SUFFIX


def question_text(messages: list[dict]) -> str:
    """What makes two prompts the same question: the text of the last turn (the one the model answers)."""
    return messages[-1]["content"] if messages else ""


def question_bucket(question: str) -> float:
    """Where ``question`` falls in [0, 1): a hash, so the same text always falls in the same place."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64


def is_held_out(question: str, share: float) -> bool:
    """Whether ``question`` falls in the held-out ``share`` (0 to 1) of all questions."""
    if share <= 0:
        return False
    return question_bucket(question) < share


# The minimum never takes more than this share of a dataset from training: a smaller dataset keeps its share.
MAX_RAISED_SHARE = 0.1


@dataclass(frozen=True)
class HoldoutPlan:
    """The share the split uses, and how it was reached (``prompts`` records both)."""

    share: float  # the share is_held_out is given
    configured_share: float
    min_prompts: int
    dataset_prompts: int
    held_out_prompts: int  # over the whole dataset, copies of a question included
    held_out_questions: int
    how: str

    def as_metadata(self) -> dict:
        return {
            "holdout_share_used": self.share, "holdout_share_configured": self.configured_share,
            "holdout_min_prompts": self.min_prompts, "dataset_held_out_prompts": self.held_out_prompts,
            "dataset_held_out_questions": self.held_out_questions, "holdout_how": self.how,
        }  # fmt: skip


def plan_holdout(questions: Iterable[str], share: float, min_prompts: int) -> HoldoutPlan:
    """The held-out share for a dataset whose rows ask ``questions`` (one per row, repeats included).

    ``share`` when it holds out at least ``min_prompts`` rows (or is 0: nothing
    held out); else the least share that does, by taking the questions in the
    order of their hashes. A dataset where the minimum would be more than
    :data:`MAX_RAISED_SHARE` of its rows keeps ``share`` (and the plan says so).
    """
    copies = Counter(questions)
    rows = sum(copies.values())
    buckets = sorted((question_bucket(q), n) for q, n in copies.items())
    held = sum(n for b, n in buckets if b < share)
    questions_held = sum(1 for b, _ in buckets if b < share)
    if share <= 0:
        return HoldoutPlan(0.0, share, min_prompts, rows, 0, 0, "nothing held out (holdout_share is 0)")
    if held >= min_prompts:
        how = f"holdout_share {share:.2%} holds out {held} of {rows} prompts, at least holdout_min_prompts {min_prompts}"
        return HoldoutPlan(share, share, min_prompts, rows, held, questions_held, how)
    limit = int(rows * MAX_RAISED_SHARE)
    if min_prompts > limit:
        how = (
            f"holdout_share {share:.2%} holds out {held} of {rows} prompts; {min_prompts} (holdout_min_prompts) would take more "
            f"than {MAX_RAISED_SHARE:.0%} of this dataset from training, so the share is kept: name a held-out file in "
            "draft_evaluation's eval_prompts for a firmer figure"
        )
        return HoldoutPlan(share, share, min_prompts, rows, held, questions_held, how)
    taken, used = 0, share
    for index, (bucket, n) in enumerate(buckets):
        if taken + n > limit:
            break
        taken += n
        following = buckets[index + 1][0] if index + 1 < len(buckets) else 1.0
        used = max(share, (bucket + following) / 2)  # between this question and the next: this one is in, the next is out
        if taken >= min_prompts:
            break
    questions_held = sum(1 for b, _ in buckets if b < used)
    how = (
        f"holdout_share {share:.2%} would hold out {held} of {rows} prompts, fewer than holdout_min_prompts {min_prompts}: "
        f"raised to {used:.2%} of the hash range, which holds out {taken} of {rows} prompts ({taken / rows:.1%}; "
        f"{questions_held} questions, every copy of each)"
    )
    return HoldoutPlan(used, share, min_prompts, rows, taken, questions_held, how)


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


def dataset_questions(source: str) -> list[str]:
    """The question of every usable row of a dataset, in order (rows the prompts asset rejects left out)."""
    from eagle3_assets.core.prompts.records import RowRejected, normalise_record
    from eagle3_assets.core.prompts.sources import iter_dataset_rows

    questions = []
    for row in iter_dataset_rows(source):
        if row.parse_error is not None:
            continue
        try:
            questions.append(question_text(normalise_record(row.record)[1]))
        except RowRejected:
            continue
    return questions
