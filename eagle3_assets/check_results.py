"""The one adapter from a gate's :class:`~eagle3_assets.core.checks.CheckOutcome` to Dagster's ``AssetCheckResult``."""

from __future__ import annotations

from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue

from eagle3_assets.core.checks import CheckOutcome


def check_result(outcome: CheckOutcome, severity: AssetCheckSeverity = AssetCheckSeverity.ERROR) -> AssetCheckResult:
    """The outcome as Dagster shows it: its verdict and description, its evidence as metadata (lists and dicts as JSON)."""
    return AssetCheckResult(
        check_name=outcome.name,
        passed=outcome.passed,
        severity=severity,
        description=outcome.description,
        metadata={k: MetadataValue.json(v) if isinstance(v, (list, dict)) else v for k, v in outcome.metadata.items()},
    )
