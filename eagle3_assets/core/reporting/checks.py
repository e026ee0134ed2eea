"""A gate declared once (:class:`Gate`, :class:`GateTable`) and its outcome (:class:`CheckOutcome`), Dagster-free.

Each domain declares its assets' gates in its ``gates.py``, beside the
functions that compute them (``core/prompts``, ``core/generation``,
``core/validation``, ``core/extraction``, ``core/draft``, ``core/evaluation``,
``core/planning``): name, whether it blocks, its default threshold, its
description and its severity. An outcome is the verdict, a one-line
description that says what to look at, and the evidence the UI shows beside
it: the figure the gate measured, its threshold, a few offending ids, further
counts. :class:`eagle3_assets.glue.check_results.AssetChecks` is the one adapter of
a table to Dagster's ``AssetCheckSpec`` and ``AssetCheckResult``; a GPU stage
sends the same outcome through Dagster Pipes (:meth:`CheckOutcome.pipes_metadata`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

SEVERITIES = ("ERROR", "WARN")


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)  # the evidence, in the order the UI lists it
    figure_name: str | None = None  # the metadata entry that holds the gate's figure
    failure: str | None = None  # which way it failed, for a gate that declares a severity per way (Gate.failure_severities)

    @classmethod
    def measured(
        cls,
        name: str,
        *,
        passed: bool,
        description: str,
        figure_name: str,
        figure: float | int,
        threshold: float | int,
        offending_ids: Sequence[str],
        counts: dict[str, Any] | None = None,
    ) -> CheckOutcome:
        """A gate that compares one figure with a threshold, naming the rows that fail it."""
        metadata = {figure_name: figure, "threshold": threshold, "offending_ids": list(offending_ids), **(counts or {})}
        return cls(name, passed, description, metadata, figure_name)

    @property
    def figure(self) -> Any:
        return self.metadata.get(self.figure_name) if self.figure_name else None

    @property
    def threshold(self) -> Any:
        return self.metadata.get("threshold")

    @property
    def offending_ids(self) -> list[str]:
        return list(self.metadata.get("offending_ids", []))

    @property
    def counts(self) -> dict[str, Any]:
        """The evidence beside the figure, threshold and offending ids."""
        return {k: v for k, v in self.metadata.items() if k not in (self.figure_name, "threshold", "offending_ids")}

    def with_evidence(self, **more: Any) -> CheckOutcome:
        return replace(self, metadata={**self.metadata, **more})

    def pipes_metadata(self) -> dict[str, Any]:
        """The metadata of ``report_asset_check`` over Dagster Pipes: the description as ``summary``, lists and dicts as JSON."""
        metadata: dict[str, Any] = {"summary": self.description}
        for key, value in self.metadata.items():
            metadata[key] = {"raw_value": value, "type": "json"} if isinstance(value, (list, dict)) else value
        return metadata

    @classmethod
    def from_pipes(cls, name: str, passed: bool, metadata: dict[str, Any]) -> CheckOutcome:
        """The outcome a stage reported over Pipes (values as they arrived), its ``summary`` the description again."""
        rest = {k: v for k, v in metadata.items() if k != "summary"}
        summary = metadata.get("summary")
        return cls(name, passed, str(getattr(summary, "value", summary)) if summary is not None else "", rest)


def share_at_most(name: str, share_name: str, share: float, threshold: float, what: str, **evidence: Any) -> CheckOutcome:
    """A gate on a share (of rejected rows, say): at most ``threshold``; ``evidence`` follows it in the metadata."""
    passed = share <= threshold
    description = "" if passed else f"{share:.1%} of {what}, above the threshold {threshold:.0%}"
    return CheckOutcome(name, passed, description, {share_name: share, "threshold": threshold, **evidence})


@dataclass(frozen=True)
class Gate:
    """One check, declared once. ``blocking``: a failure stops everything downstream (Dagster's ``blocking``).

    ``severity`` is what its results say (ERROR or WARN; default ERROR when it
    blocks, WARN when it advises); a gate that fails in more than one way names
    each way's own severity in ``failure_severities`` (by the outcome's
    ``failure``). ``threshold`` is its default threshold, the one the setting
    that changes it reads (``None``: a gate with no threshold). ``predicate``
    computes the outcome from the evidence an asset gathered (``None``: a GPU
    stage computes it and reports it over Pipes).
    """

    name: str
    blocking: bool
    description: str
    predicate: Callable[[Any], CheckOutcome] | None = None
    threshold: float | None = None
    severity: str = ""
    failure_severities: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for value in (self.severity or "ERROR", *self.failure_severities.values()):
            if value not in SEVERITIES:
                raise ValueError(f"gate {self.name}: severity {value!r} is not one of {SEVERITIES}")

    def severity_of(self, outcome: CheckOutcome | None = None) -> str:
        """The severity of ``outcome`` (of any outcome when ``None``): the failure's own, else the gate's."""
        if outcome is not None and not outcome.passed and outcome.failure in self.failure_severities:
            return self.failure_severities[outcome.failure]
        return self.severity or ("ERROR" if self.blocking else "WARN")


class GateTable:
    """The gates of one asset, in the order the UI lists them."""

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

    def __getitem__(self, name: str) -> Gate:
        if name not in self.by_name:
            raise KeyError(f"{self.asset} declares no check {name!r}; its checks: {self.names}")
        return self.by_name[name]
