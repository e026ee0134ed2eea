"""Keep or reject each raw response, render the kept ones, and compute the quality gates.

A row of ``raw_responses`` is kept when the request succeeded, the generation
stopped on its own (``finish_reason == "stop"``; truncated rows only when
allowed), reasoning and answer are non-empty (these four rules are
:func:`eagle3_assets.core.response_rules.content_failure`, which generation
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

The gate computations are pure functions returning a :class:`CheckOutcome`
(figure, threshold, up to 10 offending ids), so they are tested without Dagster
and the asset only converts them.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.chat_rendering import ChatRenderer, RenderedTrace
from eagle3_assets.core.checks import CheckOutcome
from eagle3_assets.core.markdown import markdown_histogram
from eagle3_assets.core.prompt_loading import MESSAGES_DTYPE
from eagle3_assets.core.response_rules import (
    NO_REASONING_DIAGNOSIS,
    PROMPT_TOO_LONG,
    RETRYABLE_CONTENT_REASONS,
    blank,
    content_failure,
    is_prompt_too_long,
)
from eagle3_assets.core.storage import PARTIAL_SUFFIX, atomic_path, write_parquet_atomic

MAX_OFFENDING_IDS = 10

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


class ValidationInputError(ValueError):
    """An input shard file is missing or does not follow its contract."""


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


# -- reading ---------------------------------------------------------------------


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


# -- row rules ---------------------------------------------------------------------


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


@dataclass(frozen=True)
class MaskAlignment:
    """What the alignment gate found in the written traces."""

    rows_checked: int
    rows_checked_against_server_ids: int  # of which compared token by token with the raw row's output_token_ids
    problems: dict[str, str]  # id -> why its mask or ids are wrong


def mask_alignment_problems(kept_path: Path, raw_path: Path, renderer: ChatRenderer, batch_rows: int = 128) -> MaskAlignment:
    """Re-read the written traces and the raw file in batches; return what is misaligned.

    Reads what is on disk, not what the pass meant to write. Each trace is
    checked against its own raw row: its finish reason says whether an
    end-of-turn token belongs to the completion (a trace with no finished raw
    row must not end with one); the supervised tokens must decode to the
    completion rebuilt from the text fields; and where the raw row carries the
    server's ids, the supervised ids must equal ``output_token_ids`` and the
    ids before them ``prompt_token_ids``, token by token.

    Both files are streamed side by side: the traces were written in the raw
    file's order (kept rows are a subsequence of it), so each trace's raw row
    is found by reading on, and no more than a batch of either file's token
    ids is held at once. A trace with no raw row further on is a problem.
    """
    raw_rows = _rows_in_batches(
        scan_raw_responses(raw_path).select("id", "finish_reason", "prompt_token_ids", "output_token_ids"), batch_rows
    )
    traces = pl.scan_parquet(kept_path).select("id", "messages", "reasoning", "content", "input_ids", "loss_mask")
    checked, against_server, problems = 0, 0, {}
    for row in _rows_in_batches(traces, batch_rows):
        checked += 1
        raw = next((r for r in raw_rows if r["id"] == row["id"]), None)
        if raw is None:
            problems[row["id"]] = (
                "no raw row with this id after the previous trace's (the traces are not in the raw file's order, "
                "or the id is not in it)"
            )
            continue
        ids, mask = row["input_ids"] or [], row["loss_mask"] or []
        found = [
            renderer.supervised_text_problem(
                ids, mask, row["messages"] or [], row["reasoning"] or "", row["content"] or "", finished=raw["finish_reason"] == "stop"
            )
        ]
        if raw["output_token_ids"] is not None and len(ids) == len(mask):
            against_server += 1
            supervised = [i for i, m in zip(ids, mask) if m]
            unsupervised_head = ids[: mask.index(1)] if 1 in mask else ids
            if difference := renderer.token_difference(supervised, raw["output_token_ids"], "supervised"):
                found.append(f"supervised ids differ from the server's output_token_ids at {difference}")
            if raw["prompt_token_ids"] is not None and (
                difference := renderer.token_difference(unsupervised_head, raw["prompt_token_ids"], "prompt")
            ):
                found.append(f"ids before supervision differ from the server's prompt_token_ids at {difference}")
        if problem := "; ".join(f for f in found if f):
            problems[row["id"]] = problem
    return MaskAlignment(checked, against_server, problems)


def _rows_in_batches(frame: pl.LazyFrame, batch_rows: int) -> Iterator[dict[str, Any]]:
    """The rows of a lazy frame, in order, read ``batch_rows`` at a time."""
    for batch in frame.collect_batches(chunk_size=batch_rows, engine="streaming"):
        yield from batch.iter_rows(named=True)


def written_ids(path: Path) -> list[str]:
    return pl.scan_parquet(path).select("id").collect()["id"].to_list()


def written_token_lengths(kept_path: Path) -> list[int]:
    return pl.scan_parquet(kept_path).select("num_tokens").collect()["num_tokens"].to_list()


# -- the gates (pure) -------------------------------------------------------------


def _first(ids: Iterable[str]) -> list[str]:
    out = []
    for sample_id in ids:
        out.append(str(sample_id))
        if len(out) == MAX_OFFENDING_IDS:
            break
    return out


def _none_allowed(name: str, figure_name: str, offending: Collection[str], description: str, counts: dict[str, Any] | None = None) -> CheckOutcome:
    """A gate that allows no offending row: it passes only when ``offending`` is empty, and its figure is how many there are."""
    return CheckOutcome.measured(
        name,
        passed=not offending,
        figure_name=figure_name,
        figure=len(offending),
        threshold=0,
        offending_ids=_first(offending),
        description=description,
        counts=counts,
    )


def check_traces_present(kept: int, rejected_by_reason: dict[str, int], rejected_examples: Sequence[str] = ()) -> CheckOutcome:
    rejected = sum(rejected_by_reason.values())
    description = (
        f"{kept} of {kept + rejected} rows kept"
        if kept
        else f"every row of the shard was rejected ({rejected} rows: {rejected_by_reason or 'no raw rows at all'}); "
        f"see the rejected table, e.g. {list(rejected_examples)[:3]}"
    )
    return CheckOutcome.measured(
        "traces_present",
        passed=kept > 0,
        figure_name="kept_rows",
        figure=kept,
        threshold=1,
        offending_ids=[],
        description=description,
        counts={"rejected": rejected},
    )


def check_reasoning_present(answered_rows: int, ids_without_reasoning: Sequence[str], min_share: float, reasoning_fields: dict[str, int] | None = None) -> CheckOutcome:
    """The share of answered rows (rows that got a response) with non-empty reasoning must reach ``min_share``.

    The story's failure: a client that read the wrong response field wrote
    hundreds of rows with empty reasoning. ``reasoning_fields`` (which field
    the server answered in) points straight at that cause. Rows without a
    response (request errors, prompts too long to send) are not counted here:
    they have their own gates and their own diagnosis. Both raw_responses and
    validated_traces run this gate.
    """
    with_reasoning = answered_rows - len(ids_without_reasoning)
    share = with_reasoning / answered_rows if answered_rows else 0.0
    passed = answered_rows > 0 and share >= min_share
    if not answered_rows:
        description = "no row of the shard got a response"
    else:
        description = f"{with_reasoning} of {answered_rows} answered rows have reasoning ({share:.1%}; at least {min_share:.0%} required)"
        if not passed:
            description += (
                f"; response fields seen: {reasoning_fields or {}}. {NO_REASONING_DIAGNOSIS} "
                "Once the server is fixed, materialise the shard again: rows without reasoning are sent again."
            )
    return CheckOutcome.measured(
        "reasoning_present",
        passed=passed,
        figure_name="reasoning_share",
        figure=share,
        threshold=min_share,
        offending_ids=_first(ids_without_reasoning),
        description=description,
        counts={"answered_rows": answered_rows, "rows_without_reasoning": len(ids_without_reasoning)},
    )


def check_request_errors_rare(raw_rows: int, error_ids: Sequence[str], errors_by_kind: dict[str, int], prompts_too_long: int, max_share: float) -> CheckOutcome:
    """Rows whose request failed (no response at all) must stay at most ``max_share`` of the rows that were sent.

    A request error is the server's or the network's failure, not the
    model's: the text says so, and that a rerun sends those rows again.
    Prompts too long to send are not requests: they are not counted.
    """
    sent = raw_rows - prompts_too_long
    share = len(error_ids) / sent if sent else 0.0
    passed = share <= max_share
    description = f"{len(error_ids)} of {sent} requests ended in an error ({share:.1%}; at most {max_share:.0%} allowed)"
    if error_ids:
        description += f": {errors_by_kind}"
    if not passed:
        description += (
            ". The server or the network failed them, not the model: check the server's health and logs, then "
            "materialise the shard again (error rows are sent again, finished rows are kept)."
        )
    return CheckOutcome.measured(
        "request_errors_rare",
        passed=passed,
        figure_name="request_error_share",
        figure=share,
        threshold=max_share,
        offending_ids=_first(error_ids),
        description=description,
        counts={"requests": sent, "request_errors": len(error_ids), "prompts_too_long": prompts_too_long},
    )


def check_prompts_fit_context(raw_rows: int, too_long_ids: Sequence[str]) -> CheckOutcome:
    """Prompts longer than the server's context can never be generated: counted and named, never blocking by themselves."""
    return _none_allowed(
        "prompts_fit_context",
        "prompts_too_long",
        too_long_ids,
        (
            f"{len(too_long_ids)} of {raw_rows} prompts are longer than the server's context (max_model_len) and were "
            f"never sent; they are rejected as {PROMPT_TOO_LONG}. No rerun can generate them: serve the model with a "
            "longer --max-model-len, or leave them out of the prompt set"
            if too_long_ids
            else f"all {raw_rows} prompts fit the server's context"
        ),
    )


def check_responses_accounted(raw_ids: Sequence[str], prompt_ids: Sequence[str], kept_ids: Sequence[str], rejected_ids: Sequence[str]) -> CheckOutcome:
    """Raw rows = kept + rejected, raw ids unique, and every prompt of the shard answered (and nothing else)."""
    raw_set, prompt_set = set(raw_ids), set(prompt_ids)
    seen: set[str] = set()
    duplicated = [i for i in raw_ids if i in seen or seen.add(i)]
    missing = [i for i in prompt_ids if i not in raw_set]
    foreign = [i for i in dict.fromkeys(raw_ids) if i not in prompt_set]
    unaccounted = len(raw_ids) - len(kept_ids) - len(rejected_ids)
    outcome_ids = set(kept_ids) | set(rejected_ids)
    lost = [i for i in dict.fromkeys(raw_ids) if i not in outcome_ids]
    problems = []
    if unaccounted or lost:
        problems.append(f"{len(raw_ids)} raw rows but {len(kept_ids)} kept + {len(rejected_ids)} rejected")
    if duplicated:
        problems.append(f"{len(duplicated)} duplicate raw id(s), e.g. {_first(duplicated)[:3]}")
    if missing:
        problems.append(f"{len(missing)} prompt(s) of the shard have no raw response, e.g. {_first(missing)[:3]}")
    if foreign:
        problems.append(f"{len(foreign)} raw id(s) are not prompts of the shard, e.g. {_first(foreign)[:3]}")
    count = abs(unaccounted) + len(lost) + len(duplicated) + len(missing) + len(foreign)
    return CheckOutcome.measured(
        "responses_accounted",
        passed=not problems,
        figure_name="unaccounted",
        figure=count,
        threshold=0,
        offending_ids=_first([*missing, *duplicated, *foreign, *lost]),
        description="; ".join(problems) if problems else f"all {len(prompt_ids)} prompts answered once; {len(raw_ids)} raw rows = {len(kept_ids)} kept + {len(rejected_ids)} rejected",
        counts={
            "raw_rows": len(raw_ids),
            "prompts": len(prompt_ids),
            "kept": len(kept_ids),
            "rejected": len(rejected_ids),
            "missing_prompts": len(missing),
            "duplicate_ids": len(duplicated),
            "foreign_ids": len(foreign),
        },
    )


def check_loss_mask_aligned(alignment: MaskAlignment) -> CheckOutcome:
    """Every kept row supervises exactly the target's output (reasoning, markers, answer, end of turn).

    Where the raw row carries the server's ids, "exactly" is token by token:
    the description says how many rows were checked that way.
    """
    checked, problems = alignment.rows_checked, alignment.problems
    against_server = alignment.rows_checked_against_server_ids
    examples = [f"{i}: {p}" for i, p in list(problems.items())[:3]]
    how = f"{against_server} of them token by token against the server's output_token_ids"
    return _none_allowed(
        "loss_mask_aligned",
        "misaligned_rows",
        problems,
        f"{len(problems)} of {checked} kept rows misaligned ({how}): {examples}" if problems else f"all {checked} kept rows aligned ({how})",
        counts={"rows_checked": checked, "rows_checked_against_server_ids": against_server},
    )


def check_truncation_rate_low(raw_rows: int, truncated_ids: Sequence[str], max_rate: float) -> CheckOutcome:
    rate = len(truncated_ids) / raw_rows if raw_rows else 0.0
    return CheckOutcome.measured(
        "truncation_rate_low",
        passed=rate <= max_rate,
        figure_name="truncation_rate",
        figure=rate,
        threshold=max_rate,
        offending_ids=_first(truncated_ids),
        description=f"{len(truncated_ids)} of {raw_rows} generations hit max_tokens ({rate:.1%}; at most {max_rate:.0%} expected)"
        + ("" if rate <= max_rate else ": raise max_tokens, or allow_truncated to keep them"),
        counts={"truncated_rows": len(truncated_ids)},
    )


def check_think_markers_absent(raw_rows: int, marker_ids: Sequence[str], markers: Sequence[str]) -> CheckOutcome:
    return _none_allowed(
        "think_markers_absent",
        "rows_with_think_markers",
        marker_ids,
        (
            f"{len(marker_ids)} of {raw_rows} raw rows still hold {' / '.join(markers)} in their reasoning or answer: "
            "is the server's reasoning parser the target's?"
            if marker_ids
            else f"no think markers left in {raw_rows} raw rows"
        ),
    )


# -- token-length statistics ---------------------------------------------------------


def token_length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """p50/p95 by nearest rank (an actual trace length: the ceil(q*n)-th smallest), max and mean."""
    if not lengths:
        return {"p50": 0, "p95": 0, "max": 0, "mean": 0.0}
    ordered = sorted(lengths)

    def rank(q: float) -> int:
        return int(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {"p50": rank(0.5), "p95": rank(0.95), "max": int(ordered[-1]), "mean": round(sum(ordered) / len(ordered), 1)}


def token_length_histogram_markdown(lengths: Sequence[int], bins: int = 12, bar_width: int = 40) -> str:
    """Token lengths of the kept traces as a markdown histogram."""
    return markdown_histogram(lengths, label="tokens", empty="_no kept traces_", bins=bins, bar_width=bar_width)
