"""Which target a file was made by: a path plus a hash of its config and weight files.

A stage records the identity of the model it actually loaded, and the gates
compare identities, never paths alone (a GPU host may mount the same model
elsewhere). The identity of the target that rendered a shard's traces travels
with the file, in its Parquet metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.core.target.description import read_config


def config_hash(path: Path | str) -> str:
    """Identifies a target's config and weights: its config.json and the names and sizes of its weight files.

    Names and sizes, not contents: hashing a 600 GB checkpoint per run is not an
    option, and a changed checkpoint is a new file set or a new config.
    """
    root = Path(path)
    weights = sorted((p.name, p.stat().st_size) for p in root.glob("*.safetensors"))
    return stable_hash({"config": read_config(root), "weights": weights})


@dataclass(frozen=True)
class TargetIdentity:
    path: str
    config_hash: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "config_hash": self.config_hash}

    def mismatch(self, other: TargetIdentity | dict[str, Any] | None) -> str | None:
        """Why ``other`` is another model than this one (None when they are the same model)."""
        if other is None:
            return None
        other = other if isinstance(other, TargetIdentity) else TargetIdentity(str(other.get("path")), str(other.get("config_hash")))
        if other.config_hash == self.config_hash:
            return None
        return f"{self.path} (config hash {self.config_hash}) is not {other.path} (config hash {other.config_hash})"


def target_identity(path: Path | str) -> TargetIdentity:
    return TargetIdentity(str(Path(path)), config_hash(path))

# The identity of the target that rendered a shard's traces travels with the file, in its Parquet metadata,
# so that the GPU host can compare it with the model it loads without asking the orchestrator.
PARQUET_METADATA_KEY = "eagle3.target"


def parquet_metadata(identity: TargetIdentity) -> dict[str, str]:
    return {PARQUET_METADATA_KEY: json.dumps(identity.as_dict(), sort_keys=True)}


def identity_in_parquet(path: Path | str) -> dict[str, str] | None:
    """The target identity a Parquet file was written with, or None (written before identities were recorded)."""
    import polars as pl

    raw = pl.read_parquet_metadata(path).get(PARQUET_METADATA_KEY)
    return json.loads(raw) if raw else None


