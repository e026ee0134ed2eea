"""The gates of ``validated_traces``: each a pure function of what a pass over the shard found, and their declaration.

Each returns a :class:`~eagle3_assets.core.reporting.checks.CheckOutcome` (figure,
threshold, up to ``MAX_OFFENDING_IDS`` offending ids), so they are tested
without Dagster. :data:`TRACE_GATES` declares them once (name, blocking,
threshold, description, the evidence each reads): the asset adapts the table
into its checks (:class:`eagle3_assets.glue.check_results.AssetChecks`), and
``vocab_mapping`` and ``draft_checkpoint`` read its blocking gates to pick the
green shards.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from eagle3_assets.core.reporting.checks import CheckOutcome, Gate, GateTable
from eagle3_assets.core.reporting.markdown import markdown_histogram
from eagle3_assets.core.validation.mask_alignment import MaskAlignment
from eagle3_assets.core.generation.response_rules import DEFAULT_MIN_REASONING_SHARE, NO_REASONING_DIAGNOSIS, PROMPT_TOO_LONG

MAX_OFFENDING_IDS = 10
DEFAULT_MAX_TRUNCATION_RATE = 0.05  # truncation_rate_low warns above it
DEFAULT_MAX_REQUEST_ERROR_SHARE = 0.05  # request_errors_rare blocks above it
# think_markers_absent warns above it. A parser that is not the target's leaves markers in nearly every row; a sampled
# model writes a stray one now and then (the tiny target about one row in a few hundred), and that row is rejected
# (think_markers_left) whatever the gate says.
MAX_THINK_MARKER_SHARE = 0.05


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
    share = len(marker_ids) / raw_rows if raw_rows else 0.0
    held = f"{len(marker_ids)} of {raw_rows} raw rows still hold {' / '.join(markers)} in their reasoning or answer ({share:.1%})"
    return CheckOutcome.measured(
        "think_markers_absent",
        passed=share <= MAX_THINK_MARKER_SHARE,
        figure_name="think_marker_share",
        figure=share,
        threshold=MAX_THINK_MARKER_SHARE,
        offending_ids=_first(marker_ids),
        description=(
            f"{held}: is the server's reasoning parser the target's?" if share > MAX_THINK_MARKER_SHARE
            else f"{held}, rejected as think_markers_left; at most {MAX_THINK_MARKER_SHARE:.0%} expected of a matching parser"
            if marker_ids else f"no think markers left in {raw_rows} raw rows"
        ),
        counts={"rows_with_think_markers": len(marker_ids)},
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


# The evidence each predicate reads: the shard's summary, this run's config, the loss-mask audit, the ids written.
TRACE_GATES = GateTable(
    "validated_traces",
    [
        Gate(
            "traces_present", True, "at least one row of the shard was kept",
            lambda e: check_traces_present(e.summary.kept, e.summary.rejected_by_reason, e.summary.rejected_examples),
        ),
        Gate(
            "reasoning_present", True,
            f"enough of the rows that got a response carry non-empty reasoning (default {DEFAULT_MIN_REASONING_SHARE:.0%})",
            lambda e: check_reasoning_present(
                e.summary.answered_rows, e.summary.ids_without_reasoning, e.config.min_reasoning_share, e.summary.reasoning_fields
            ),
            threshold=DEFAULT_MIN_REASONING_SHARE,
        ),
        Gate(
            "responses_accounted", True, "raw rows = kept + rejected, raw ids unique, every prompt of the shard answered",
            lambda e: check_responses_accounted(e.summary.raw_ids, e.summary.prompt_ids, e.kept_ids, e.rejected_ids),
        ),
        Gate(
            "loss_mask_aligned", True,
            "every kept row supervises exactly the target's output: reasoning, think markers, answer, end of turn; "
            "token by token against the server's own ids where raw_responses has them",
            lambda e: check_loss_mask_aligned(e.alignment),
        ),
        # The one measure of failed requests (raw_responses has none): blocking, because past it the server or the
        # network is failing, and a rerun of raw_responses for the shard sends the errored rows again.
        Gate(
            "request_errors_rare", True,
            "few requests ended in an error, the server's or the network's failure "
            f"(default at most {DEFAULT_MAX_REQUEST_ERROR_SHARE:.0%} of the requests sent; prompts too long were never sent)",
            lambda e: check_request_errors_rare(
                e.summary.raw_rows, e.summary.request_error_ids, e.summary.request_errors_by_kind,
                len(e.summary.prompt_too_long_ids), e.config.max_request_error_share,
            ),
            threshold=DEFAULT_MAX_REQUEST_ERROR_SHARE,
        ),
        Gate(
            "truncation_rate_low", False, f"few generations hit max_tokens (default at most {DEFAULT_MAX_TRUNCATION_RATE:.0%})",
            lambda e: check_truncation_rate_low(e.summary.raw_rows, e.summary.truncated_ids, e.config.max_truncation_rate),
            threshold=DEFAULT_MAX_TRUNCATION_RATE,
        ),
        Gate(
            "think_markers_absent", False, f"at most {MAX_THINK_MARKER_SHARE:.0%} of the raw rows hold a think marker inside reasoning or answer",
            lambda e: check_think_markers_absent(e.summary.raw_rows, e.summary.think_marker_ids, e.markers),
            threshold=MAX_THINK_MARKER_SHARE,
        ),
        Gate(
            "prompts_fit_context", False,
            "no prompt is longer than the server's context (such prompts are rejected as prompt_too_long, never sent)",
            lambda e: check_prompts_fit_context(e.summary.raw_rows, e.summary.prompt_too_long_ids),
        ),
    ],
)  # fmt: skip
