"""One refinement round, Dagster-free: which draft it starts from, its files, its gate, and where its rejections fell.

A round (the ``refinement_round`` asset, stage ``refine_draft``) serves the
target with the *current* draft on held-in prompts, keeps the completions that
pass validation, extracts their states, replays the draft on them, trains from
it and judges the refined draft against it on the held-out set. The current
draft is the latest one a round kept, or ``draft_checkpoint``'s when no round
has run on it yet (:func:`next_round`); a round whose refined draft is worse
keeps the draft it started from (:func:`kept_draft`), so the next round starts
from that one again.

Every file of round ``n`` is under ``<data>/refinement_round/round-<n>/``
(:class:`RoundPaths`), written atomically; each phase records the fingerprint
of its inputs beside its output, so a rerun after a failure redoes only what
is missing or stale (:func:`phase_done`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.evaluation.output_position import OUTPUT_POSITION_BUCKETS, RequestSteps, bucket_name
from eagle3_assets.core.evaluation.spread import PromptAcceptance
from eagle3_assets.core.generation.completions import ROW_SCHEMA, describe_error, parse_completion
from eagle3_assets.core.generation.openai_client import async_openai_client
from eagle3_assets.core.prompts.heldout import question_text
from eagle3_assets.core.reporting.checks import CheckOutcome, Gate, GateTable
from eagle3_assets.core.storage.files import write_json_atomic

ASSET = "refinement_round"
CHECKPOINT = "draft_checkpoint"  # what the first round on a draft_checkpoint starts from

REFINEMENT_GATES = GateTable(
    ASSET,
    [
        Gate(
            "refined_not_worse",
            True,
            "ERROR when the refined draft's held-out mean acceptance length, measured through vLLM, is below the draft "
            "the round started from (less gate_margin): the round then keeps the earlier draft as current",
            threshold=0.0,  # gate_margin's default
            severity="ERROR",
        )
    ],
)

# The served rows: raw_responses' contract (validation reads them as it reads a raw shard) and the server's step counts.
SERVED_SCHEMA: dict[str, pl.DataType] = {**ROW_SCHEMA, "per_step_accepted": pl.List(pl.Int64()), "per_step_drafted": pl.List(pl.Int64())}


def check_refined_not_worse(before: float | None, after: float | None, margin: float) -> CheckOutcome:
    """The verdict on the refined draft: its held-out mean acceptance length at least the starting draft's less ``margin``."""
    name = "refined_not_worse"
    figures = {"acceptance_before": before, "acceptance_after": after, "gate_margin": margin}
    if before is None or after is None:
        return CheckOutcome(name, False, f"no acceptance figure to judge by (before {before}, after {after}): the draft was not kept", figures)
    passed = after >= before - margin
    verdict = "kept" if passed else "blocked: the round keeps the draft it started from"
    return CheckOutcome(
        name, passed, f"held-out mean acceptance length {after:.3f} refined vs {before:.3f} starting (margin {margin}): {verdict}", figures
    )


@dataclass(frozen=True)
class RoundPaths:
    """The files of one round, under ``<data>/refinement_round/round-<n>``."""

    root: Path

    @classmethod
    def of(cls, asset_root: Path, number: int) -> RoundPaths:
        return cls(Path(asset_root) / f"round-{number}")

    prompts = property(lambda self: self.root / "prompts.parquet")  # the held-in prompts served
    eval_prompts = property(lambda self: self.root / "eval_prompts.jsonl")  # the held-out prompts the gate serves
    served = property(lambda self: self.root / "served.parquet")  # SERVED_SCHEMA
    served_record = property(lambda self: self.root / "served.json")  # its fingerprint, the starting draft's held-out pass
    traces = property(lambda self: self.root / "traces.parquet")  # the kept completions, validated_traces' contract
    rejected = property(lambda self: self.root / "traces.rejected.parquet")
    states = property(lambda self: self.root / "states")  # one hidden_states shard, the anchors beside it
    replay = property(lambda self: self.root / "replay.json")
    training = property(lambda self: self.root / "training")
    model = property(lambda self: self.root / "model")  # the refined draft, vLLM's form
    gate_record = property(lambda self: self.root / "gate.json")  # its fingerprint, the refined draft's held-out pass
    report = property(lambda self: self.root / "report.json")


def phase_done(record: Path, fingerprint: str) -> dict | None:
    """The phase's record when it was written for these inputs (``fingerprint``), else None: redo it."""
    if not record.is_file():
        return None
    recorded = json.loads(record.read_text())
    return recorded if recorded.get("fingerprint") == fingerprint else None


def record_phase(record: Path, fingerprint: str, **figures: Any) -> dict:
    payload = {"fingerprint": fingerprint, **figures}
    write_json_atomic(record, payload)
    return payload


@dataclass(frozen=True)
class RoundStart:
    """Where round ``number`` starts: the draft it fine-tunes and is judged against, and which asset made it."""

    number: int
    draft: Path
    started_from: str  # "draft_checkpoint", or "round-<m>": the round that kept it
    base_weights_hash: str  # draft_checkpoint's draft the rounds build on; a new one restarts the chain


def next_round(previous: Mapping[str, Any] | None, checkpoint_draft: Path, checkpoint_hash: str) -> RoundStart:
    """Round ``n + 1`` after the last materialised round ``previous`` (its metadata, None before the first): from the
    draft that round kept, unless ``draft_checkpoint`` has since exported another draft (``checkpoint_hash``), which
    the rounds then start over from. A failed materialisation records nothing, so its rerun is the same round."""
    number = int((previous or {}).get("round", 0)) + 1
    if not previous or previous.get("base_weights_hash") != checkpoint_hash:
        return RoundStart(number, Path(checkpoint_draft), CHECKPOINT, checkpoint_hash)
    return RoundStart(number, Path(str(previous["kept_draft"])), str(previous["kept_from"]), checkpoint_hash)


def kept_draft(start: RoundStart, refined: Path, passed: bool) -> tuple[Path, str]:
    """The current draft after the round (and which round made it): the refined one when the gate passed, else the start's."""
    return (Path(refined), f"round-{start.number}") if passed else (start.draft, start.started_from)


def held_in_rows(prompt_files: Sequence[Path], count: int, number: int) -> pl.DataFrame:
    """``count`` held-in rows (``id``, ``messages``) for round ``number``: the prompts' training rows in shard order, each
    round taking the next ones (wrapping round), so successive rounds mine other prompts."""
    if not prompt_files:
        raise ValueError(f"{ASSET}: no materialised prompts shard holds training rows: materialise prompts first")
    rows = pl.concat([pl.read_parquet(p, columns=["id", "messages"]) for p in prompt_files])
    if rows.is_empty():
        raise ValueError(f"{ASSET}: the prompts shards {[str(p) for p in prompt_files]} hold no training rows")
    start = ((number - 1) * count) % rows.height
    order = list(range(start, rows.height)) + list(range(start))
    return rows[order[: min(count, rows.height)]]


def held_out_overlap(held_in: pl.DataFrame, held_out: Iterable[list[dict]]) -> list[str]:
    """Ids of held-in rows whose question is a held-out one: serving them would train on the gate's prompts."""
    questions = {question_text(m) for m in held_out if m}
    return [i for i, m in zip(held_in["id"].to_list(), held_in["messages"].to_list()) if question_text(m) in questions]


# -- serving ------------------------------------------------------------------------------------------------------------


def serve_rows(base_url: str, model: str, rows: pl.DataFrame, max_tokens: int, concurrency: int) -> pl.DataFrame:
    """Each held-in row served once, greedy, with the server's token ids and per-step counts: one SERVED_SCHEMA row
    each (a failed request: its ``error``, as generation writes it; no retries)."""
    import openai

    async def send_all() -> list[dict]:
        gate = asyncio.Semaphore(concurrency)
        async with async_openai_client(base_url, connect_timeout_s=10, read_timeout_s=1800, max_retries=0) as client:

            async def one(sample_id: str, messages: list[dict]) -> dict:
                empty = dict.fromkeys(SERVED_SCHEMA) | {"id": sample_id, "server": base_url, "model": model, "attempts": 1}
                async with gate:
                    try:
                        response = await client.chat.completions.create(
                            model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True}
                        )
                        acceptance = PromptAcceptance.from_response(response)
                        row = empty | parse_completion(response.model_dump())
                    except (openai.APIError, ValueError) as exc:
                        return empty | {"error": describe_error(exc), "reasoning_field": "none"}
                steps = (acceptance.per_step_accepted, acceptance.per_step_drafted) if acceptance else (None, None)
                return row | {"per_step_accepted": steps[0], "per_step_drafted": steps[1]}

            return await asyncio.gather(*(one(i, m) for i, m in zip(rows["id"].to_list(), rows["messages"].to_list())))

    return pl.DataFrame(asyncio.run(send_all()), schema=SERVED_SCHEMA)


def request_steps(row: Mapping[str, Any]) -> RequestSteps | None:
    """A served row's verify steps beside its completion (None: failed, or the server returned no per-step counts)."""
    if row.get("per_step_accepted") is None or row.get("output_token_ids") is None:
        return None
    return RequestSteps(len(row["output_token_ids"]), tuple(row["per_step_accepted"]), tuple(row["per_step_drafted"]))


# -- where the rejections fell ------------------------------------------------------------------------------------------


def rejections(requests: Iterable[RequestSteps | None], k: int, buckets: Sequence[tuple[int, int]] = OUTPUT_POSITION_BUCKETS) -> dict:
    """Where the server stopped accepting, over the requests whose steps add up: per position within the speculation
    (a step that accepted ``a`` of its drafts was rejected at proposal ``a + 1`` of ``k``) and per output-position
    bucket (by the step's start, as :func:`~eagle3_assets.core.evaluation.output_position.by_output_position` places it)."""
    by_position = [0] * k
    rows = [{"bucket": bucket_name(low, high), "steps": 0, "rejections": 0} for low, high in buckets]
    steps = rejected = 0
    for request in requests:
        if request is None or not request.adds_up():
            continue
        for start, accepted, drafted in zip(request.starts(), request.accepted, request.drafted):
            steps += 1
            index = next((i for i, (low, high) in enumerate(buckets) if low <= start < high), None)
            if index is not None:
                rows[index]["steps"] += 1
            if accepted < drafted:
                rejected += 1
                by_position[accepted] += 1
                if index is not None:
                    rows[index]["rejections"] += 1
    for row in rows:
        row["rejected_share"] = round(row["rejections"] / row["steps"], 4) if row["steps"] else None
    return {"steps": steps, "rejections": rejected, "by_position": by_position, "by_output_position": rows}


def render_rejections(figures: Mapping[str, Any]) -> str:
    """Markdown the UI shows: the round's rejections by position within the speculation and by output position."""
    total = figures["rejections"] or 1
    k = len(figures["by_position"])
    lines = ["| rejected at proposal | rejections | share of rejections |", "| --- | --- | --- |"]
    lines += [f"| {j + 1} of {k} | {n} | {n / total:.1%} |" for j, n in enumerate(figures["by_position"])]
    lines += ["", "| output position (tokens) | verify steps | rejections | rejected share of steps |", "| --- | --- | --- | --- |"]
    for row in figures["by_output_position"]:
        share = f"{row['rejected_share']:.1%}" if row["rejected_share"] is not None else "empty"
        lines.append(f"| {row['bucket']} | {row['steps']} | {row['rejections']} | {share} |")
    lines.append(f"\n{figures['rejections']} of {figures['steps']} verify steps stopped before their last proposal.")
    return "\n".join(lines)
