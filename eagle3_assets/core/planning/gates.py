"""The gate of ``capacity_plan``, declared once beside its check: ``run_fits``.

It fails two ways, each with its own declared severity: ERROR when a volume
cannot hold what the rest of the run writes there, or when its free bytes
cannot be read and ``accept_unknown_capacity`` is not set; WARN when nothing
can be projected yet (no shard validated, no configured mean). Passed with the
accepted risks in its description and metadata. Non-blocking: nothing is
downstream of the plan; ``hidden_states`` refuses a run that does not fit
itself (:func:`eagle3_assets.glue.capacity_facts.refuse_unless_run_fits`). Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.planning.capacity import CapacityPlan
from eagle3_assets.core.reporting.checks import CheckOutcome, Gate, GateTable

DOES_NOT_FIT = "does_not_fit"
UNKNOWN_FREE_BYTES = "unknown_free_bytes"
NOTHING_TO_PROJECT = "nothing_to_project"

CAPACITY_GATES = GateTable(
    "capacity_plan",
    [
        Gate(
            "run_fits",
            False,
            "the data volume and the GPU host's have room for what the rest of the registered shards' run writes "
            "(hidden states, raw responses and traces, checkpoints)",
            severity="ERROR",
            failure_severities={DOES_NOT_FIT: "ERROR", UNKNOWN_FREE_BYTES: "ERROR", NOTHING_TO_PROJECT: "WARN"},
        )
    ],
)


def check_run_fits(plan: CapacityPlan) -> CheckOutcome:
    """Whether the rest of the run fits on its volumes, with the volumes, the 8-bit and bounded-mode figures and the risks taken."""
    risks = plan.accepted_risks()
    evidence = {
        "volumes": plan.as_metadata()["volumes"],
        "hidden_states_bytes_to_write_8bit": plan.states_to_write_8bit,
        "bounded_window_bytes": plan.bounded_window_bytes,
        "accepted_risks": risks,
    }
    short = [need.describe() for need in plan.needs if need.fits is False]
    unjudged = plan.unknown_refusal()
    if short:
        return CheckOutcome("run_fits", False, plan.states_refusal() or "; ".join(short), evidence, failure=DOES_NOT_FIT)
    if unjudged:
        # A volume of unknown free bytes is not taken to fit: failed, naming it, why, and the setting that accepts the risk.
        return CheckOutcome("run_fits", False, unjudged, evidence, failure=UNKNOWN_FREE_BYTES)
    if not plan.projected:
        # Nothing to project from yet: said as a warning, not as a pass.
        description = "cannot project the run: no shard is validated yet; validate one, or configure sample_tokens"
        return CheckOutcome("run_fits", False, description, evidence, failure=NOTHING_TO_PROJECT)
    return CheckOutcome("run_fits", True, "; ".join(risks), evidence)
