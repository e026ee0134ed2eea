"""Which shards the whole-dataset assets train on: the green ones (or a named list), never waiting for a blocked one.

A shard is green for an asset when its latest output exists and every
blocking gate evaluated on it passed. ``vocab_mapping`` needs the shard green
for ``validated_traces``; ``draft_checkpoint`` for ``validated_traces`` and
``hidden_states`` (offline mode). Every registered shard that is not used is
listed with why: retired (with the recorded reason), a gate that failed (with
its words), no output yet, or not in the named list. More shards turning green
later makes the trained assets stale, which the UI shows: retraining is a
click, not a wait for the slowest shard. Dagster-free: the Dagster records
are read in :mod:`eagle3_assets.glue.shard_status`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

GREEN, BLOCKED, MISSING = "green", "blocked", "missing"


@dataclass(frozen=True)
class ShardVerdict:
    """One asset's state for one shard: ``green``, ``blocked`` (a blocking gate failed) or ``missing`` (no output yet)."""

    state: str
    detail: str = ""


class ShardSelectionError(ValueError):
    """The shards asked for cannot be trained on: none is green, or a named one is not."""


@dataclass(frozen=True)
class ShardSelection:
    used: list[str]
    left_out: dict[str, str] = field(default_factory=dict)  # shard -> why

    def summary(self) -> str:
        return f"{len(self.used)} shard(s) used, {len(self.left_out)} left out" + (
            ": " + "; ".join(f"{k}: {why}" for k, why in list(self.left_out.items())[:5]) + (" ..." if len(self.left_out) > 5 else "")
            if self.left_out
            else ""
        )

    def as_metadata(self) -> dict:
        """What the asset's metadata lists: the shards used, those left out and why."""
        return {"shards_used": list(self.used), "shards_left_out": dict(self.left_out), "shards_left_out_count": len(self.left_out)}


def select_shards(
    registered: Sequence[str],
    verdicts: Mapping[str, Sequence[tuple[str, ShardVerdict]]],
    retired: Mapping[str, Mapping] | None = None,
    named: Sequence[str] | None = None,
) -> ShardSelection:
    """The shards to use: every registered one green for all its assets, or exactly the ``named`` ones.

    ``verdicts``: per shard, ``(asset, verdict)`` for each asset the training
    reads. A named shard that is unknown, retired or not green is refused (it
    was asked for by name); an unnamed one is left out with its reason.
    """
    retired = retired or {}
    registered = sorted(registered)

    def why_not(key: str) -> str | None:
        for asset, verdict in verdicts.get(key, []):
            if verdict.state != GREEN:
                return f"{asset} {verdict.state}: {verdict.detail}" if verdict.detail else f"{asset} {verdict.state}"
        return None

    left_out: dict[str, str] = {key: f"retired: {record.get('reason', '')}" for key, record in sorted(retired.items())}
    if named:
        problems = []
        for key in named:
            if key in retired:
                problems.append(f"{key} is retired ({retired[key].get('reason', '')})")
            elif key not in registered:
                problems.append(f"{key} is not a registered shard")
            elif why_not(key):
                problems.append(f"{key}: {why_not(key)}")
        if problems:
            raise ShardSelectionError("the named shards cannot all be trained on: " + "; ".join(problems))
        left_out.update({key: "not in the named list" for key in registered if key not in named})
        return ShardSelection(sorted(set(named)), left_out)
    used = []
    for key in registered:
        reason = why_not(key)
        if reason:
            left_out[key] = reason
        else:
            used.append(key)
    if not used:
        detail = "; ".join(f"{k}: {why}" for k, why in list(left_out.items())[:10]) or "no shard is registered"
        raise ShardSelectionError(f"no shard is green to train on ({detail}): materialise the per-shard assets first")
    return ShardSelection(used, left_out)
