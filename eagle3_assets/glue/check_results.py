"""An asset's gates as Dagster's checks: the one adapter from a declared :class:`GateTable` to specs and results.

The gates are declared once, in core beside the functions that compute them
(:class:`~eagle3_assets.core.reporting.checks.Gate`: name, blocking, threshold,
description, severity). :class:`AssetChecks` only turns that table into what
Dagster takes: the ``AssetCheckSpec`` of each gate (its ``blocking`` and
description) and the ``AssetCheckResult`` of each outcome (its severity as the
gate declares it). A gate computed on the GPU host (``hidden_states``,
``draft_evaluation``) has no predicate: its outcome comes back over Pipes and
:meth:`AssetChecks.result` turns it into the result.
"""

from __future__ import annotations

from typing import Any

from dagster import AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, MetadataValue

from eagle3_assets.core.reporting.checks import CheckOutcome, GateTable


class AssetChecks(GateTable):
    """A declared table of gates, as Dagster's check specs and results (the table's names, order and severities)."""

    def __init__(self, table: GateTable):
        super().__init__(table.asset, list(table.by_name.values()))

    def specs(self) -> list[AssetCheckSpec]:
        return [AssetCheckSpec(g.name, asset=self.asset, blocking=g.blocking, description=g.description) for g in self.by_name.values()]

    def results(self, evidence: Any) -> list[AssetCheckResult]:
        """Every gate's predicate over ``evidence``, as Dagster shows it."""
        results = []
        for gate in self.by_name.values():
            if gate.predicate is None:
                continue
            outcome = gate.predicate(evidence)
            if outcome.name != gate.name:
                raise ValueError(f"{self.asset}: the predicate of {gate.name} returned the outcome of {outcome.name}")
            results.append(self.result(outcome))
        return results

    def severity(self, outcome: CheckOutcome) -> AssetCheckSeverity:
        """The severity its gate declares for ``outcome``, as Dagster's enum."""
        return AssetCheckSeverity(self[outcome.name].severity_of(outcome))

    def result(self, outcome: CheckOutcome) -> AssetCheckResult:
        """The outcome as Dagster shows it, with its gate's severity: its verdict and description, its evidence as metadata."""
        return AssetCheckResult(
            check_name=outcome.name,
            passed=outcome.passed,
            severity=self.severity(outcome),
            description=outcome.description or None,
            metadata={k: MetadataValue.json(v) if isinstance(v, (list, dict)) else v for k, v in outcome.metadata.items()},
        )
