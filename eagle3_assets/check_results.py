"""An asset's checks declared once: one table of gates that builds both the ``AssetCheckSpec`` and the ``AssetCheckResult``.

Each :class:`Gate` names its check, says whether it blocks (ERROR: nothing
downstream of a failed one is built) or advises (WARN), describes what it
holds, and computes its :class:`~eagle3_assets.core.reporting.checks.CheckOutcome`
(Dagster-free) from the evidence the asset gathered. The severity is stated
there and nowhere else: the spec's ``blocking`` and the result's ``severity``
both come from it. A gate computed on the GPU host (``hidden_states``,
``draft_evaluation``) has no predicate here: its outcome comes back over Pipes
and :meth:`Gates.result` turns it into the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dagster import AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, MetadataValue

from eagle3_assets.core.reporting.checks import CheckOutcome


@dataclass(frozen=True)
class Gate:
    name: str
    blocking: bool  # True: ERROR and blocking; False: WARN, advisory
    description: str
    predicate: Callable[[Any], CheckOutcome] | None = None  # the evidence -> the outcome; None: computed by a GPU stage

    @property
    def severity(self) -> AssetCheckSeverity:
        return AssetCheckSeverity.ERROR if self.blocking else AssetCheckSeverity.WARN


class Gates:
    """The checks of one asset, in the order the UI lists them."""

    def __init__(self, asset: str, gates: Sequence[Gate]):
        names = [g.name for g in gates]
        if len(set(names)) != len(names):
            raise ValueError(f"{asset}: a check is declared twice in {names}")
        self.asset = asset
        self.by_name = {g.name: g for g in gates}

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    @property
    def blocking_names(self) -> list[str]:
        """The gates that block downstream: a shard that failed one is not trained on."""
        return [g.name for g in self.by_name.values() if g.blocking]

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

    def result(self, outcome: CheckOutcome) -> AssetCheckResult:
        """The outcome as Dagster shows it, with its gate's severity: its verdict and description, its evidence as metadata."""
        if outcome.name not in self.by_name:
            raise KeyError(f"{self.asset} declares no check {outcome.name!r}; its checks: {self.names}")
        return AssetCheckResult(
            check_name=outcome.name,
            passed=outcome.passed,
            severity=self.by_name[outcome.name].severity,
            description=outcome.description or None,
            metadata={k: MetadataValue.json(v) if isinstance(v, (list, dict)) else v for k, v in outcome.metadata.items()},
        )

