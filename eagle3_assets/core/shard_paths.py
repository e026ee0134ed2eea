"""Where a shard's files live: one place for every asset and GPU stage.

Under the data directory, each asset has its directory, and each shard (a
partition key, ``shard-00003``) its files there::

    <data>/<asset>/<shard>.parquet                    the shard (prompts, raw_responses, validated_traces)
    <data>/<asset>/<shard>.rejected.parquet           its rejected rows, each with a reason
    <data>/<asset>/<shard>.heldout.parquet            prompts kept out of training (prompts)
    <data>/<asset>/<shard>.journal.jsonl              raw_responses' journal of settled rows, while it generates
    <data>/<asset>/<shard>.lease                      the lease of the run that writes the shard
    <data>/<asset>/superseded/<shard>.<fp>.parquet    a finished generation of other settings, kept
    <data>/<asset>/<shard>/                           a shard of many files (hidden_states' parts) ...
    <data>/<asset>/<shard>/metadata.json              ... and its sidecar, written last
    <data>/<asset>/.<shard>.*.partial                 temporary files, renamed into place when whole

A GPU stage is sent the same paths relative to the data directory
(:meth:`ShardPaths.relative`) and resolves them against its host's own.
Standard library only, like :mod:`.shard_lease`, which the GPU host's
pre-flight imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

PARTIAL_SUFFIX = ".partial"  # temporary files and directories (core.storage.atomic_path, staging_dir)
PARQUET_SUFFIX = ".parquet"
REJECTED_SUFFIX = ".rejected.parquet"
HELDOUT_SUFFIX = ".heldout.parquet"
JOURNAL_SUFFIX = ".journal.jsonl"
LEASE_SUFFIX = ".lease"
SUPERSEDED_DIR = "superseded"
SIDECAR = "metadata.json"


def lease_path(asset_dir: Path | str, shard: str) -> Path:
    return Path(asset_dir) / f"{shard}{LEASE_SUFFIX}"


def superseded_path(parquet_path: Path | str, fingerprint: str) -> Path:
    """Where the finished ``<shard>.parquet`` made with ``fingerprint`` is kept once other settings replace it."""
    parquet_path = Path(parquet_path)
    return parquet_path.parent / SUPERSEDED_DIR / f"{parquet_path.stem}.{fingerprint}{PARQUET_SUFFIX}"


def shard_partials(asset_dir: Path | str, shard: str) -> list[Path]:
    """The shard's temporary files and directories: ``.<shard>.*.partial`` beside them, ``*.partial`` under ``<shard>/``."""
    root = Path(asset_dir)
    found = list(root.glob(f".{shard}.*{PARTIAL_SUFFIX}"))
    inside = root / shard
    if inside.is_dir():
        found += list(inside.rglob(f"*{PARTIAL_SUFFIX}"))
    return sorted(found)


def training_shards(asset_dir: Path | str) -> list[Path]:
    """The shards' own Parquet files in an asset's directory (not their rejected rows, not held-out prompts)."""
    return sorted(p for p in Path(asset_dir).glob(f"shard-*{PARQUET_SUFFIX}") if not p.name.endswith((REJECTED_SUFFIX, HELDOUT_SUFFIX)))


def _data_dir() -> Path:
    from eagle3_assets.core.storage import data_dir  # polars beside it: not for the pre-flight

    return data_dir()


@dataclass(frozen=True)
class ShardPaths:
    """The files of one shard of one asset, under ``root`` (the data directory, read when made)."""

    asset: str
    shard: str
    root: Path = field(default_factory=lambda: _data_dir())

    @classmethod
    def relative(cls, asset: str, shard: str) -> ShardPaths:
        """The same paths relative to the data directory: what a GPU stage is sent."""
        return cls(asset, shard, Path())

    @property
    def asset_dir(self) -> Path:
        return self.root / self.asset

    @property
    def parquet(self) -> Path:
        return self.asset_dir / f"{self.shard}{PARQUET_SUFFIX}"

    @property
    def rejected(self) -> Path:
        return self.asset_dir / f"{self.shard}{REJECTED_SUFFIX}"

    @property
    def heldout(self) -> Path:
        return self.asset_dir / f"{self.shard}{HELDOUT_SUFFIX}"

    @property
    def journal(self) -> Path:
        return self.asset_dir / f"{self.shard}{JOURNAL_SUFFIX}"

    @property
    def lease(self) -> Path:
        return lease_path(self.asset_dir, self.shard)

    @property
    def superseded_dir(self) -> Path:
        return self.asset_dir / SUPERSEDED_DIR

    def superseded(self) -> list[Path]:
        """The finished generations of other settings kept for this shard."""
        return sorted(self.superseded_dir.glob(f"{self.shard}.*{PARQUET_SUFFIX}")) if self.superseded_dir.is_dir() else []

    @property
    def directory(self) -> Path:
        """The shard's own directory, for an asset that writes many files per shard (hidden_states)."""
        return self.asset_dir / self.shard

    @property
    def sidecar(self) -> Path:
        return self.directory / SIDECAR

    def partials(self) -> list[Path]:
        return shard_partials(self.asset_dir, self.shard)
