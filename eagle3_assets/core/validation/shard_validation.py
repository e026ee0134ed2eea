"""Keep or reject each raw response, render the kept ones, and compute the quality gates.

A row of ``raw_responses`` is kept when the request succeeded, the generation
stopped on its own (``finish_reason == "stop"``; truncated rows only when
allowed), reasoning and answer are non-empty (these four rules are
:func:`eagle3_assets.core.generation.response_rules.content_failure`, which generation
also reads to decide what a rerun sends again), no think marker is left inside
either (the reasoning parser did not split the text), it is not a repeat of an
earlier row of the shard (same prompt, same response), its rendered token
sequence is the one the server saw and generated (where the raw row carries the
server's own ids: ``prompt_token_ids``, ``output_token_ids``), and it fits the
maximum sequence length. Every other row goes to the rejected table with the
first reason that applies, so the shard's rows are always accounted for.

The server's ids are the ground truth of what the target produced; the parser's
``reasoning``/``content`` fields are text rebuilt into tokens. Where the two
disagree (a ``</think>`` the target never wrote, an end-of-turn it did not
stop on, a sampled split that re-tokenisation would not make), the rebuilt
trace would teach the draft tokens the target did not generate: such a row is
rejected (``tokens_differ``), and a prompt the server rendered otherwise than
the target's template (``prompt_differs``: another chat template, other
``chat_template_kwargs``) too. Rows without server ids (SGLang, older files)
keep the text-only path.

Memory: a shard of 10,000 traces of 8k tokens is ~300 MB of text and as much
again as token ids. The shard is therefore streamed: a first pass over a few
small columns (ids and response hashes) finds duplicates, a second pass reads
the rows in batches, renders and tokenises each batch and writes it to a part
file; the parts are then streamed into the shard's file. At no point is more
than one batch of token ids, or more than one copy of the text, in memory.

The files' contracts are :mod:`.trace_files`; the gates, pure functions of
what the pass found, are :mod:`.trace_gates`; the alignment gate's re-reading of
the written traces is :mod:`.mask_alignment`.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from eagle3_assets.core.validation.chat_rendering import ChatRenderer, RenderedTrace
from eagle3_assets.core.generation.response_rules import (
    PROMPT_TOO_LONG,
    RETRYABLE_CONTENT_REASONS,
    blank,
    content_failure,
    is_prompt_too_long,
)
from eagle3_assets.core.storage.files import PARTIAL_SUFFIX, atomic_path, write_parquet_atomic
from eagle3_assets.core.validation.trace_files import KEPT_SCHEMA, REJECTED_SCHEMA, scan_prompts, scan_raw_responses
from eagle3_assets.core.validation.gates import MAX_OFFENDING_IDS

# Reason codes, in the order they are tested: a row gets the first that applies.
REJECTION_REASONS: dict[str, str] = {
    PROMPT_TOO_LONG: "the prompt alone is longer than the server's context (max_model_len); it was never sent",
    "request_error": "the request failed (raw `error` is set)",
    "unknown_prompt": "the id is not a prompt of this shard (stale or foreign raw row)",
    "duplicate_id": "an earlier raw row of the shard has the same id",
    **RETRYABLE_CONTENT_REASONS,  # a rerun of raw_responses sends these rows again
    "think_markers_left": "a think marker is left inside the reasoning or the answer (the reasoning parser did not split the text)",
    "duplicate_response": "an earlier row of the shard has the same prompt and the same response",
    "template_error": "the target's chat template refused the prompt (e.g. roles that do not alternate)",
    "prompt_differs": "the target's chat template renders the prompt into other ids than the server's prompt_token_ids "
    "(the server used another chat template or other chat_template_kwargs)",
    "tokens_differ": "the reasoning and answer fields do not reassemble into the ids the target generated "
    "(output_token_ids): e.g. a think marker or end of turn it never wrote, or a split re-tokenisation would not make",
    "too_long": "the rendered trace is longer than the maximum sequence length",
}

@dataclass(frozen=True)
class ValidationRules:
    max_seq_len: int
    allow_truncated: bool = False

    def __post_init__(self):
        if self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")


@dataclass
class ShardValidation:
    """What one pass over a shard found; the inputs of every gate."""

    raw_rows: int = 0
    raw_ids: list[str] = field(default_factory=list)
    prompt_ids: list[str] = field(default_factory=list)
    answered_rows: int = 0  # rows that got a response (no request error, not settled as prompt_too_long)
    ids_without_reasoning: list[str] = field(default_factory=list)  # among the answered rows
    request_error_ids: list[str] = field(default_factory=list)
    request_errors_by_kind: dict[str, int] = field(default_factory=dict)
    prompt_too_long_ids: list[str] = field(default_factory=list)
    truncated_ids: list[str] = field(default_factory=list)
    think_marker_ids: list[str] = field(default_factory=list)
    reasoning_fields: dict[str, int] = field(default_factory=dict)
    kept: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    rejected_examples: list[str] = field(default_factory=list)
    prompts_opening_think_block: int = 0
    kept_with_server_ids: int = 0  # kept rows whose ids were compared with (and equal) the server's

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by_reason.values())



def _holds_markers(column: str, markers: Sequence[str]) -> pl.Expr:
    expr = pl.lit(False)
    for marker in markers:
        expr = expr | pl.col(column).str.contains(marker, literal=True).fill_null(False)
    return expr


def duplicate_flags(raw: pl.LazyFrame, prompts: pl.LazyFrame) -> pl.DataFrame:
    """Per raw row (by position): whether an earlier row has its id, or its prompt and response.

    Compares two 64-bit hashes of (messages, reasoning, content) with different
    seeds, so only ~16 bytes per row are held, not the text; a false duplicate
    needs a 128-bit collision.
    """
    joined = raw.with_row_index("row_nr").join(prompts, on="id", how="left", maintain_order="left")
    response = pl.struct("messages", "reasoning", "content")
    hashes = joined.select("row_nr", "id", response.hash(1).alias("h1"), response.hash(2).alias("h2")).collect(engine="streaming")
    return hashes.select(
        "row_nr",
        (~pl.col("id").is_first_distinct()).alias("is_duplicate_id"),
        (~pl.struct("h1", "h2").is_first_distinct()).alias("is_duplicate_response"),
    )


def classify(raw: pl.LazyFrame, prompts: pl.LazyFrame, flags: pl.DataFrame, rules: ValidationRules, markers: Sequence[str]) -> pl.LazyFrame:
    """Raw rows joined to their prompts, with ``reason``/``detail`` (null when kept so far) and the gates' per-row flags.

    ``too_long`` is not decided here: it needs the rendered tokens.
    """
    has_markers = _holds_markers("reasoning", markers) | _holds_markers("content", markers)
    finish = pl.col("finish_reason")
    after_content = (
        pl.when(has_markers)
        .then(pl.lit("think_markers_left"))
        .when(pl.col("is_duplicate_response"))
        .then(pl.lit("duplicate_response"))
        .otherwise(pl.lit(None, dtype=pl.String))
    )
    reason = (
        pl.when(is_prompt_too_long())
        .then(pl.lit(PROMPT_TOO_LONG))
        .when(pl.col("error").is_not_null())
        .then(pl.lit("request_error"))
        .when(pl.col("messages").is_null())
        .then(pl.lit("unknown_prompt"))
        .when(pl.col("is_duplicate_id"))
        .then(pl.lit("duplicate_id"))
        .otherwise(pl.coalesce(content_failure(rules.allow_truncated), after_content))
    )
    detail = (
        pl.when(reason.is_in(["request_error", PROMPT_TOO_LONG]))
        .then(pl.col("error").str.slice(0, 300))
        .when(reason.is_in(["truncated", "not_stopped"]))
        .then(pl.lit("finish_reason=") + finish.fill_null("null"))
        .when(reason == "empty_reasoning")
        .then(pl.lit("reasoning_field=") + pl.col("reasoning_field").fill_null("null"))
        .when(reason.is_not_null())
        .then(reason.replace_strict(REJECTION_REASONS, default=None))
        .otherwise(pl.lit(None, dtype=pl.String))
    )
    return (
        raw.with_row_index("row_nr")
        .join(prompts, on="id", how="left", maintain_order="left")
        .join(flags.lazy(), on="row_nr", how="left", maintain_order="left")
        .with_columns(
            reason=reason,
            detail=detail,
            answered=pl.col("error").is_null(),
            has_reasoning=~blank("reasoning"),
            is_truncated=(finish == "length").fill_null(False),
            has_markers=has_markers,
            finished=(finish == "stop").fill_null(False),
        )
    )


# -- the shard pass ----------------------------------------------------------------


def validate_shard(
    raw_path: Path,
    prompts_path: Path,
    renderer: ChatRenderer,
    rules: ValidationRules,
    kept_path: Path,
    rejected_path: Path,
    batch_rows: int = 128,
    file_metadata: dict[str, str] | None = None,
) -> ShardValidation:
    """Write the shard's kept traces (with ``file_metadata`` in the Parquet footer) and rejected rows; return what the gates need."""
    raw, prompts = scan_raw_responses(raw_path), scan_prompts(prompts_path)
    markers = (renderer.think_open, renderer.think_close)
    summary = ShardValidation(prompt_ids=prompts.select("id").collect()["id"].to_list())
    flags = duplicate_flags(raw, prompts)
    rows = classify(raw, prompts, flags, rules, markers).select(
        "id", "messages", "reasoning", "content", "reasoning_field", "error", "reason", "detail",
        "answered", "has_reasoning", "is_truncated", "has_markers", "finished", "prompt_token_ids", "output_token_ids",
    )

    parts_dir = kept_path.parent / f".{kept_path.stem}.parts{PARTIAL_SUFFIX}"
    shutil.rmtree(parts_dir, ignore_errors=True)  # a previous interrupted pass: redo, it is cheap next to generation
    parts_dir.mkdir(parents=True)
    part_paths: list[Path] = []
    rejected_frames: list[pl.DataFrame] = []
    try:
        for batch in rows.collect_batches(chunk_size=batch_rows, engine="streaming"):
            _tally(summary, batch)
            rejected = batch.filter(pl.col("reason").is_not_null()).select(list(REJECTED_SCHEMA))
            candidates = batch.filter(pl.col("reason").is_null())
            kept, unrenderable = _render(candidates, renderer, rules)
            rejected_frames.append(rejected)
            if unrenderable.height:
                rejected_frames.append(unrenderable)
            summary.prompts_opening_think_block += int(kept.height and kept["_opened"].sum())
            summary.kept_with_server_ids += int(kept.height and kept["_server_ids"].sum())
            kept = kept.drop("_opened", "_server_ids")
            if kept.height:
                part = parts_dir / f"part-{len(part_paths):05d}.parquet"
                kept.write_parquet(part, row_group_size=batch_rows)
                part_paths.append(part)
            summary.kept += kept.height
        with atomic_path(kept_path) as tmp:
            if part_paths:
                # small row groups: readers (the alignment gate, extraction) can stream the file
                pl.scan_parquet(part_paths).sink_parquet(tmp, row_group_size=batch_rows, engine="streaming", metadata=file_metadata)
            else:
                pl.DataFrame(schema=KEPT_SCHEMA).write_parquet(tmp, metadata=file_metadata)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)

    rejected_all = pl.concat(rejected_frames, how="vertical") if rejected_frames else pl.DataFrame(schema=REJECTED_SCHEMA)
    write_parquet_atomic(rejected_path, rejected_all.cast(REJECTED_SCHEMA))
    summary.rejected_by_reason = dict(sorted(rejected_all.group_by("reason").len().iter_rows())) if rejected_all.height else {}
    summary.rejected_examples = [f"{r['id']}: {r['reason']} ({r['detail']})" for r in rejected_all.head(MAX_OFFENDING_IDS).iter_rows(named=True)]
    return summary


def _tally(summary: ShardValidation, batch: pl.DataFrame) -> None:
    summary.raw_rows += batch.height
    summary.raw_ids.extend(batch["id"].to_list())
    answered = batch.filter(pl.col("answered"))
    summary.answered_rows += answered.height
    summary.ids_without_reasoning.extend(answered.filter(~pl.col("has_reasoning"))["id"].to_list())
    errors = batch.filter(pl.col("reason") == "request_error")
    summary.request_error_ids.extend(errors["id"].to_list())
    for kind in errors["error"].to_list():
        kind = kind.split(":", 1)[0]
        summary.request_errors_by_kind[kind] = summary.request_errors_by_kind.get(kind, 0) + 1
    summary.prompt_too_long_ids.extend(batch.filter(pl.col("reason") == PROMPT_TOO_LONG)["id"].to_list())
    summary.truncated_ids.extend(batch.filter(pl.col("is_truncated"))["id"].to_list())
    summary.think_marker_ids.extend(batch.filter(pl.col("has_markers"))["id"].to_list())
    for name, count in batch.group_by("reasoning_field").len().iter_rows():
        summary.reasoning_fields[str(name)] = summary.reasoning_fields.get(str(name), 0) + count


def _render(candidates: pl.DataFrame, renderer: ChatRenderer, rules: ValidationRules) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Render and tokenise a batch; split off the rows the template refuses, those whose ids are not the server's,
    and those over the maximum length.

    Returns (kept, rejected) frames.
    """
    rows = list(zip(candidates["messages"].to_list(), candidates["reasoning"].to_list(), candidates["content"].to_list(), candidates["finished"].to_list()))
    refused: dict[int, str] = {}
    try:
        traces = renderer.render_batch(rows)
    except Exception:  # some templates raise on one prompt's shape: find which rows, reject only those
        traces = []
        for position, row in enumerate(rows):
            try:
                traces.append(renderer.render_batch([row])[0])
            except Exception as exc:
                refused[position] = f"{type(exc).__name__}: {exc}"[:300]
    rejected = [
        pl.DataFrame(
            {"id": candidates["id"].gather(list(refused)), "reason": ["template_error"] * len(refused), "detail": list(refused.values())},
            schema=REJECTED_SCHEMA,
        )
    ]
    if refused:
        candidates = candidates.filter(~pl.int_range(pl.len()).is_in(list(refused)))
    differs = _server_id_differences(traces, candidates["prompt_token_ids"].to_list(), candidates["output_token_ids"].to_list(), renderer)
    lengths = [t.num_tokens for t in traces]
    rendered = pl.DataFrame(
        {
            "id": candidates["id"],
            "messages": candidates["messages"],
            "reasoning": candidates["reasoning"],
            "content": candidates["content"],
            "input_ids": pl.Series([t.input_ids for t in traces], dtype=pl.List(pl.Int32)),
            "loss_mask": pl.Series([t.loss_mask for t in traces], dtype=pl.List(pl.Int8)),
            "num_tokens": pl.Series(lengths, dtype=pl.Int64),
            "_opened": pl.Series([renderer.prompt_opens_think_block(t.prompt_text) for t in traces], dtype=pl.Boolean),
            "_server_ids": candidates["output_token_ids"].is_not_null(),
            "_reason": pl.Series([d[0] if d else None for d in differs], dtype=pl.String),
            "_detail": pl.Series([d[1] if d else None for d in differs], dtype=pl.String),
        },
        schema={**KEPT_SCHEMA, "_opened": pl.Boolean, "_server_ids": pl.Boolean, "_reason": pl.String, "_detail": pl.String},
    )
    # The server's ids are tested before the length: a trace that is not the target's is wrong at any length.
    rejected.append(rendered.filter(pl.col("_reason").is_not_null()).select("id", pl.col("_reason").alias("reason"), pl.col("_detail").alias("detail")))
    rendered = rendered.filter(pl.col("_reason").is_null()).drop("_reason", "_detail")
    fits = pl.col("num_tokens") <= rules.max_seq_len
    rejected.append(
        rendered.filter(~fits).select(
            "id",
            pl.lit("too_long").alias("reason"),
            (pl.format("{} tokens > max_seq_len {}", pl.col("num_tokens"), pl.lit(rules.max_seq_len))).alias("detail"),
        )
    )
    return rendered.filter(fits), pl.concat(rejected)


def _server_id_differences(
    traces: Sequence[RenderedTrace],
    server_prompts: Sequence[Sequence[int] | None],
    server_outputs: Sequence[Sequence[int] | None],
    renderer: ChatRenderer,
) -> list[tuple[str, str] | None]:
    """Per trace, ``(reason, detail)`` when its ids are not the ones the server returned, else None.

    The prompt is compared first: when the server rendered another prompt, the
    target generated after something the trace does not hold, whatever the
    completion's ids. A row without server ids is not compared (None).
    """
    out: list[tuple[str, str] | None] = []
    for trace, prompt_ids, output_ids in zip(traces, server_prompts, server_outputs):
        problem = None
        if prompt_ids is not None and (difference := renderer.token_difference(trace.prompt_ids, prompt_ids, "prompt")):
            problem = ("prompt_differs", f"the template's rendering differs from the server's prompt_token_ids at {difference}")
        elif output_ids is not None and (difference := renderer.token_difference(trace.completion_ids, output_ids, "completion")):
            problem = ("tokens_differ", f"the rebuilt completion differs from the server's output_token_ids at {difference}")
        out.append((problem[0], problem[1][:300]) if problem else None)
    return out


