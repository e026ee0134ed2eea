"""The gate of ``draft_evaluation``, declared once beside its check: ``acceptance_above_floor``.

It fails two ways, each with its own declared severity: ERROR when the trained
draft's mean acceptance length is below the floor (a draft not worth serving),
WARN when it is above the floor but no better than the baseline (training did
not pay, the draft still works). Non-blocking: nothing is downstream of it; the
UI and the alerts show it. Computed by the ``evaluate_draft`` stage on the GPU
host, which reports it over Pipes with the severity declared here. Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.reporting.checks import CheckOutcome, Gate, GateTable

BELOW_FLOOR = "below_floor"
NOT_ABOVE_BASELINE = "not_above_baseline"

ACCEPTANCE_GATES = GateTable(
    "draft_evaluation",
    [
        Gate(
            "acceptance_above_floor",
            False,
            "ERROR below the floor; WARN when the trained draft does not beat the baseline",
            threshold=2.0,  # the floor's default: a mean acceptance length a served draft must reach
            severity="ERROR",
            failure_severities={BELOW_FLOOR: "ERROR", NOT_ABOVE_BASELINE: "WARN"},
        )
    ],
)


def check_acceptance_above_floor(trained: float, baseline: float | None, floor: float) -> CheckOutcome:
    """The verdict on the trained draft's mean acceptance length: at or above ``floor``, and above ``baseline`` if one was served."""
    name = "acceptance_above_floor"
    if trained < floor:
        return CheckOutcome(name, False, f"mean acceptance length {trained:.2f} is below the floor {floor:.2f}", failure=BELOW_FLOOR)
    if baseline is None:
        return CheckOutcome(name, True, f"mean acceptance length {trained:.2f} >= floor {floor:.2f} (no baseline served: baseline none)")
    if trained <= baseline:
        return CheckOutcome(
            name, False, f"the trained draft ({trained:.2f}) does not beat the baseline ({baseline:.2f})", failure=NOT_ABOVE_BASELINE
        )
    return CheckOutcome(name, True, f"mean acceptance length {trained:.2f} >= floor {floor:.2f}, baseline {baseline:.2f}")
