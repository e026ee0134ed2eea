"""The gates of a ``raw_responses`` shard, declared once beside their checks: name, blocking, threshold, description.

The evidence each predicate reads is what the asset found in the shard it
wrote: the prompt ids expected and the row ids written (polars Series), those
missing, twice or of no prompt, and ``reasoning_present``'s outcome, computed
by :func:`eagle3_assets.core.validation.gates.check_reasoning_present` (the
rule ``validated_traces`` applies again). The asset adapts the table into its
checks (:class:`eagle3_assets.glue.check_results.AssetChecks`). Dagster-free.
"""

from __future__ import annotations

from typing import Any

from eagle3_assets.core.generation.response_rules import DEFAULT_MIN_REASONING_SHARE
from eagle3_assets.core.reporting.checks import CheckOutcome, Gate, GateTable


def check_one_row_per_prompt(e: Any) -> CheckOutcome:
    passed = not (e.duplicated or e.missing or e.extra) and e.written_ids.len() == e.expected_ids.len()
    return CheckOutcome(
        "one_row_per_prompt", passed,
        "" if passed else f"{len(e.missing)} prompts without a row, {len(e.duplicated)} with two, {len(e.extra)} rows of no prompt",
        {
            "prompts": e.expected_ids.len(), "rows": e.written_ids.len(), "missing_ids": e.missing[:10],
            "duplicated_ids": e.duplicated[:10], "unexpected_ids": e.extra[:10],
        },
    )  # fmt: skip


RESPONSE_GATES = GateTable(
    "raw_responses",
    [
        Gate(
            "one_row_per_prompt", True,
            "the shard's Parquet holds exactly one row per prompt id of the shard, none missing, none twice",
            check_one_row_per_prompt,
        ),
        Gate(
            "reasoning_present", True,
            f"at least {DEFAULT_MIN_REASONING_SHARE:.0%} of the rows that got a response carry reasoning; "
            "otherwise the server lost its reasoning parser (fix it and materialise the shard again: those rows are re-sent)",
            lambda e: e.reasoning,
            threshold=DEFAULT_MIN_REASONING_SHARE,
        ),
    ],
)  # fmt: skip
