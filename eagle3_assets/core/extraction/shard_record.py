"""A finished shard's record, beside its files: what the stage reported, so that a rerun reuses it without an engine.

An extraction run covers many shards with one engine (the target loaded once:
hours for a 1T target). When a run dies part-way, its rerun must redo only the
shards that were not finished, and must not even build the engine when none
is left. The sidecar says the files are complete, but the gates need the
engine's own logits; so after a shard's gates the stage writes
``<shard>/extraction.json`` (atomically, last): the shard's data version, the
key of everything that decided its files and its gates' verdicts, the
materialisation's metadata, the gates' outcomes and the size of each part.

A stored shard is reused when its record has the same key, every gate passed,
its sidecar is the one the record was made with, and each part is there at
its recorded size and modification time (any write to a part changes them).
The parts' bytes are not hashed again here (at the story's size a shard is
tens of GB, and a rerun of finished shards should take seconds): the sha256 of
each part is in the sidecar and every reader (training) verifies it, naming
the part; damage that no write made (bit rot) is then rebuilt with ``recompute``. A shard whose gate failed is extracted and gated
again (its durable parts are kept), so a fixed cause is seen at once.
Dagster-free.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.extraction.job import ExtractionJob, ExtractionShard
from eagle3_assets.core.reporting.checks import CheckOutcome
from eagle3_assets.core.storage.files import stable_hash, write_json_atomic
from eagle3_assets.core.storage.shard_paths import ENGINE_BUILDS, PART_GLOB, SHARD_RECORD, SIDECAR

RECORD_FORMAT = 1


def reuse_key(job: ExtractionJob, shard: ExtractionShard, traces_digest: str, target_config_hash: str) -> str:
    """What decides a shard's files and its gates' verdicts: the record of another key is never reused."""
    return stable_hash(
        {
            "format": RECORD_FORMAT,
            "data_version": shard.data_version,
            "traces": traces_digest,
            "target_config_hash": target_config_hash,
            "aux_layer_ids": list(job.target.aux_layer_ids),
            "files": {"backend": job.backend, "dtype": job.dtype, "part_size_bytes": job.part_size_bytes},
            "gates": {
                "check_seed": shard.check_seed,
                "logits_check_samples": job.logits_check_samples,
                "logits_check_positions": job.logits_check_positions,
                "min_argmax_agreement": job.min_argmax_agreement,
                "aux_check_samples": job.aux_check_samples,
                "aux_check_reference": job.aux_check_reference,
            },
        }
    )


@dataclass
class ShardRecord:
    shard: str
    data_version: str
    key: str
    metadata: dict[str, Any]  # the materialisation's metadata, as first reported
    outcomes: list[CheckOutcome]
    parts: dict[str, list[int]] = field(default_factory=dict)  # part name -> [bytes, mtime_ns]
    sidecar_key: str = ""  # the sidecar's extraction_key when the record was written

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(outcome.passed for outcome in self.outcomes)

    def write(self, shard_dir: Path) -> None:
        write_json_atomic(Path(shard_dir) / SHARD_RECORD, {"format": RECORD_FORMAT, **asdict(self)})

    @classmethod
    def made(cls, shard: ExtractionShard, key: str, shard_dir: Path, metadata: dict[str, Any], outcomes: list[CheckOutcome]) -> ShardRecord:
        """The record of a shard just extracted and gated (its parts and sidecar as they are on disk now)."""
        shard_dir = Path(shard_dir)
        return cls(shard.shard, shard.data_version, key, metadata, list(outcomes), _parts_on_disk(shard_dir), _sidecar_key(shard_dir))

    @classmethod
    def read(cls, shard_dir: Path) -> ShardRecord | None:
        """The shard's record, or None when there is none (or it is unreadable: the shard is then redone)."""
        try:
            raw = json.loads((Path(shard_dir) / SHARD_RECORD).read_text())
            if raw.pop("format", None) != RECORD_FORMAT:
                return None
            raw["outcomes"] = [CheckOutcome(**outcome) for outcome in raw["outcomes"]]
            return cls(**raw)
        except (OSError, ValueError, TypeError, KeyError):
            return None


def _parts_on_disk(shard_dir: Path) -> dict[str, list[int]]:
    return {path.name: [(stat := path.stat()).st_size, stat.st_mtime_ns] for path in sorted(Path(shard_dir).glob(PART_GLOB))}


def _sidecar_key(shard_dir: Path) -> str:
    try:
        return str(json.loads((Path(shard_dir) / SIDECAR).read_text()).get("extraction_key") or "")
    except (OSError, ValueError):
        return ""


def reusable(shard_dir: Path, key: str) -> tuple[ShardRecord | None, str]:
    """The shard's record when the stored shard can be reported as it is, else None and why it is extracted."""
    shard_dir = Path(shard_dir)
    record = ShardRecord.read(shard_dir)
    if record is None:
        return None, "no finished extraction recorded"
    if record.key != key:
        return None, "recorded with other inputs or settings"
    if not record.passed:
        return None, "a gate failed last time: extracted and gated again"
    if not record.sidecar_key or record.sidecar_key != _sidecar_key(shard_dir):
        return None, f"its {SIDECAR} is not the one the record was made with"
    if _parts_on_disk(shard_dir) != record.parts:
        return None, "its part files are not the recorded ones (missing, extra, resized or written since)"
    return record, "complete, every gate passed, same data version and settings"


def forget(shard_dir: Path) -> None:
    """The shard is about to be rewritten: its record no longer describes it."""
    (Path(shard_dir) / SHARD_RECORD).unlink(missing_ok=True)


def record_engine_build(asset_dir: Path, build: dict[str, Any]) -> None:
    """One line per engine built (``engine_builds.jsonl``): how often a run loaded the target, from the stage's own record.

    Appended in one ``write`` of an ``O_APPEND`` descriptor, so concurrent writers never interleave a line.
    """
    asset_dir = Path(asset_dir)
    asset_dir.mkdir(parents=True, exist_ok=True)
    line = (json.dumps({"at": time.time(), **build}, sort_keys=True) + "\n").encode()
    fd = os.open(asset_dir / ENGINE_BUILDS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def engine_builds(asset_dir: Path) -> list[dict[str, Any]]:
    """Every engine build recorded under ``asset_dir``, oldest first."""
    path = Path(asset_dir) / ENGINE_BUILDS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
