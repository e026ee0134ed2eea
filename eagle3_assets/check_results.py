"""The one adapter from a gate's :class:`~eagle3_assets.core.checks.CheckOutcome` to Dagster's ``AssetCheckResult``."""

from __future__ import annotations

from typing import Any

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


def share_at_most(check_name: str, share_name: str, share: float, threshold: float, **evidence: Any) -> AssetCheckResult:
    """A warning gate: ``share`` (of rejected rows, of failed requests) must stay at most ``threshold``; ``evidence`` follows it in the metadata."""
    return AssetCheckResult(
        check_name=check_name,
        passed=share <= threshold,
        severity=AssetCheckSeverity.WARN,
        metadata={share_name: share, "threshold": threshold, **evidence},
    )
