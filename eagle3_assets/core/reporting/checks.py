"""A gate's outcome, as every gate computes it (Dagster-free): the one type the assets turn into check results.

The verdict, a one-line description that says what to look at, and the
evidence the UI shows beside it: the figure the gate measured, its threshold,
a few offending ids, further counts. :class:`eagle3_assets.check_results.Gates`
is the one adapter to Dagster's ``AssetCheckResult``; a GPU stage sends the
same outcome through Dagster Pipes (:meth:`CheckOutcome.pipes_metadata`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)  # the evidence, in the order the UI lists it
    figure_name: str | None = None  # the metadata entry that holds the gate's figure

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
