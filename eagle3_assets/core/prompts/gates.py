"""The gates of a ``prompts`` shard, declared once beside their checks: name, blocking, threshold, description.

The evidence each predicate reads is what the asset counted over the shard:
its key, the rows accepted and rejected, the rejected share and a few rejected
examples. The asset adapts the table into its checks
(:class:`eagle3_assets.glue.check_results.AssetChecks`). Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.reporting.checks import CheckOutcome, Gate, GateTable, share_at_most

MAX_REJECTED_SHARE = 0.05  # rejected_rows_rare warns above it


def check_prompts_present(key: str, accepted: int, rejected: int) -> CheckOutcome:
    return CheckOutcome(
        "prompts_present", accepted > 0, "" if accepted else f"shard {key} has no usable prompt ({rejected} rows rejected)",
        {"accepted": accepted, "rejected": rejected},
    )  # fmt: skip


PROMPT_GATES = GateTable(
    "prompts",
    [
        Gate(
            "prompts_present", True, "the shard holds at least one usable prompt",
            lambda e: check_prompts_present(e.key, e.accepted, e.rejected),
        ),
        Gate(
            "rejected_rows_rare", False, f"at most {MAX_REJECTED_SHARE:.0%} of the shard's rows were rejected",
            lambda e: share_at_most(
                "rejected_rows_rare", "rejected_share", e.rejected_share, MAX_REJECTED_SHARE, "the shard's rows were rejected", examples=e.examples
            ),
            threshold=MAX_REJECTED_SHARE,
        ),
    ],
)  # fmt: skip
