"""The draft's gates, declared once beside their checks: name, blocking, threshold, description.

- ``vocab_mapping``'s: the evidence is what the asset counted over the green
  shards' supervised tokens (the share the draft vocabulary covers, the tokens
  it leaves out and the most frequent of them);
- ``draft_checkpoint``'s: the evidence is what the ``train_draft`` stage
  reported: the exported config's problems (:mod:`eagle3_assets.core.draft.export`),
  the layer ids, the vLLM load check's report (:mod:`eagle3_assets.core.draft.load_check`,
  run on the GPU host beside the target), the mean loss by epoch.

Each asset adapts its table into its checks
(:class:`eagle3_assets.glue.check_results.AssetChecks`). Dagster-free.
"""

from __future__ import annotations

from typing import Any

from eagle3_assets.core.reporting.checks import CheckOutcome, Gate, GateTable

MIN_COVERAGE = 0.95  # draft_vocab_covers_targets warns below it


def check_draft_vocab_covers_targets(e: Any) -> CheckOutcome:
    passed = e.covered >= MIN_COVERAGE
    return CheckOutcome(
        "draft_vocab_covers_targets", passed,
        "" if passed else f"only {e.covered:.2%} of supervised tokens are in the draft vocabulary: raise draft_vocab_size",
        {"coverage": e.covered, "threshold": MIN_COVERAGE, "uncovered_tokens": e.uncovered, "most_frequent_uncovered_ids": e.uncovered_ids},
    )  # fmt: skip


VOCAB_MAPPING_GATES = GateTable(
    "vocab_mapping",
    [
        Gate(
            "draft_vocab_covers_targets", False,
            f"at least {MIN_COVERAGE:.0%} of the supervised target tokens are in the draft vocabulary",
            check_draft_vocab_covers_targets,
            threshold=MIN_COVERAGE,
        )
    ],
)  # fmt: skip


# The evidence each predicate reads: the stage's config problems, the layer ids, its vLLM report, the loss by epoch.
def check_config_complete(e: Any) -> CheckOutcome:
    return CheckOutcome(
        "config_complete", not e.problems, "; ".join(e.problems[:5]),
        {"problems": e.problems, "expected_aux_layer_ids": e.layer_ids},
    )  # fmt: skip


def check_loads_in_vllm(e: Any) -> CheckOutcome:
    metadata = {k: v for k, v in e.vllm_report["metadata"].items() if v is not None}
    return CheckOutcome("loads_in_vllm", bool(e.vllm_report["passed"]), e.vllm_report["detail"], metadata)


def check_loss_decreased(e: Any) -> CheckOutcome:
    went_down = len(e.losses) >= 2 and e.losses[-1] < e.losses[0]
    return CheckOutcome(
        "loss_decreased", went_down,
        "" if went_down else f"mean loss by epoch {[round(x, 4) for x in e.losses]} did not go down",
        {"first_epoch_loss": e.losses[0] if e.losses else None, "last_epoch_loss": e.losses[-1] if e.losses else None},
    )  # fmt: skip


# Computed from what the stage reports (config_complete and loads_in_vllm run on the GPU host, beside the target).
DRAFT_CHECKPOINT_GATES = GateTable(
    "draft_checkpoint",
    [
        Gate(
            "config_complete", True,
            "config.json has every field vLLM reads, the weights are complete, and the layer ids equal the hidden states'",
            check_config_complete,
        ),
        Gate(
            "loads_in_vllm", True,
            "vLLM serves the target with this draft as --speculative-config and answers a chat completion",
            check_loads_in_vllm,
        ),
        Gate("loss_decreased", False, "the last epoch's mean loss is below the first's", check_loss_decreased),
    ],
)  # fmt: skip
