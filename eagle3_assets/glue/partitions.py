"""Sample-shard partitions shared by every per-sample asset.

Dynamic partitions, because a dataset can grow: the ``new_prompt_shards``
sensor and :func:`register_shards` add the keys of new shards;
existing keys never change meaning (see :mod:`eagle3_assets.core.prompts.sharding`).
A retired shard (:mod:`eagle3_assets.core.prompts.retired`) is deleted from
the partitions, its files kept, and never registered again until restored.
"""

from __future__ import annotations

from dagster import DagsterInstance, DynamicPartitionsDefinition
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG  # what a backfill's ranged run carries

from eagle3_assets.core.prompts.retired import restore, retire, retired_shards
from eagle3_assets.core.prompts.sharding import SAMPLE_SHARDS

sample_shards = DynamicPartitionsDefinition(name=SAMPLE_SHARDS)


def shard_range_tags(first: str, last: str) -> dict[str, str]:
    """The tags of a run over the shards ``first`` to ``last``, as a backfill's ranged run carries them."""
    return {ASSET_PARTITION_RANGE_START_TAG: first, ASSET_PARTITION_RANGE_END_TAG: last}


def unregistered(instance: DagsterInstance, keys: list[str]) -> list[str]:
    """The keys to add: those the instance does not know yet, less the retired ones."""
    known = set(instance.get_dynamic_partitions(SAMPLE_SHARDS)) | set(retired_shards())
    return [k for k in keys if k not in known]


def register_shards(instance: DagsterInstance, keys: list[str]) -> list[str]:
    """Add the keys the instance does not know yet (never a retired one); return the ones added."""
    new = unregistered(instance, keys)
    if new:
        instance.add_dynamic_partitions(SAMPLE_SHARDS, new)
    return new


def retire_shards(instance: DagsterInstance, keys: list[str], reason: str) -> dict[str, dict]:
    """Record ``keys`` as retired (files kept) and delete their partitions; the records of the keys retired now."""
    added = retire(keys, reason)
    for key in keys:
        if instance.has_dynamic_partition(SAMPLE_SHARDS, key):
            instance.delete_dynamic_partition(SAMPLE_SHARDS, key)
    return added


def restore_shards(instance: DagsterInstance, keys: list[str]) -> list[str]:
    """Take ``keys`` off the retired record and register them again; the keys that were retired."""
    restored = restore(keys)
    register_shards(instance, restored)
    return restored
