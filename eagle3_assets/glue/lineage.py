"""What an asset's data version is made of: the versions of its inputs, as this Dagster instance recorded them.

Shared by the asset modules (an asset module never imports another): a
shard's input is known by the data version its asset recorded, else, for a
file written outside Dagster, by its content hash.
"""

from __future__ import annotations

from pathlib import Path

from dagster import AssetExecutionContext, AssetKey
from dagster._core.definitions.data_version import extract_data_version_from_entry  # no public reader of the tag

from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.storage.files import file_hash
from resources.target_model import TargetModel

TRACES = "validated_traces"


def upstream_version(context: AssetExecutionContext, asset: str, key: str, path: Path) -> str:
    """The data version ``asset`` recorded for shard ``key``, else a hash of its file ``path``, else ``unknown``."""
    record = context.instance.get_latest_data_version_record(AssetKey(asset), is_source=False, partition_key=key)
    version = extract_data_version_from_entry(record.event_log_entry) if record else None
    if version is not None:
        return version.value
    return f"file:{file_hash(path)}" if path.is_file() else "unknown"


def states_lineage(context: AssetExecutionContext, key: str, target_model: TargetModel, backend: str, dtype: str) -> dict:
    """What a shard's hidden states are made of, hashed into their data version (bounded-disk mode records the same version)."""
    return {
        TRACES: upstream_version(context, TRACES, key, ShardPaths(TRACES, key).parquet),
        "target_config_hash": target_model.config_hash(),
        "aux_layer_ids": target_model.layer_ids(),
        "backend": backend,
        "dtype": dtype,
    }
