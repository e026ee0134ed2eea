"""Retired shards: taken out of the run on purpose, their files kept, the reason recorded.

A shard whose prompts are bad (a broken batch, a source that repeats another)
is retired rather than deleted: ``<data>/retired_shards.json`` records the
key, the reason, when and by whom; registration never adds a retired key again
(the new-shards sensor, the sample cap), training lists it among the shards
left out with its reason, and every file of the shard stays where it was.
Restoring it removes the record, and the shard is registered again.

The record is one small JSON file written atomically; the orchestrator is its
only writer. Dagster-free: :mod:`eagle3_assets.retire` is the command and the
UI's job.
"""

from __future__ import annotations

import getpass
import json
import time
from pathlib import Path

from eagle3_assets.core.prompts.sharding import shard_index
from eagle3_assets.core.storage.files import write_json_atomic
from eagle3_assets.core.storage.shard_paths import data_dir

RECORD = "retired_shards.json"


def record_path(root: Path | None = None) -> Path:
    return (root or data_dir()) / RECORD


def retired_shards(root: Path | None = None) -> dict[str, dict]:
    """Each retired key with its record (``reason``, ``retired_at``, ``retired_by``); {} when none is."""
    path = record_path(root)
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not the retired-shards record ({exc}); fix or remove it") from None
    if not isinstance(record, dict) or not isinstance(record.get("shards"), dict):
        raise ValueError(f"{path}: not the retired-shards record (expected {{'shards': {{key: {{...}}}}}})")
    return record["shards"]


def retire(keys: list[str], reason: str, root: Path | None = None, by: str | None = None) -> dict[str, dict]:
    """Record ``keys`` as retired for ``reason``; the records written (a key retired before keeps its first record)."""
    if not keys:
        raise ValueError("no shard named to retire")
    for key in keys:
        shard_index(key)  # refuses a malformed key, naming it
    if not reason.strip():
        raise ValueError("retiring a shard needs a reason (it is shown wherever the shard is left out)")
    shards = retired_shards(root)
    added = {}
    for key in keys:
        if key not in shards:
            added[key] = {"reason": reason.strip(), "retired_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "retired_by": by or _user()}
    if added:
        write_json_atomic(record_path(root), {"shards": {**shards, **added}})
    return added


def restore(keys: list[str], root: Path | None = None) -> list[str]:
    """Remove ``keys`` from the record; the keys that were retired."""
    shards = retired_shards(root)
    restored = [key for key in keys if key in shards]
    if restored:
        write_json_atomic(record_path(root), {"shards": {k: v for k, v in shards.items() if k not in restored}})
    return restored


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
