"""Sample-shard partitions shared by every per-sample asset.

Dynamic partitions, because a dataset can grow: the ``new_prompt_shards``
sensor and :func:`register_shards` add the keys of new shards;
existing keys never change meaning (see :mod:`eagle3_assets.core.prompts.sharding`).
"""

from __future__ import annotations

from dagster import DagsterInstance, DynamicPartitionsDefinition

from eagle3_assets.core.prompts.sharding import SAMPLE_SHARDS

sample_shards = DynamicPartitionsDefinition(name=SAMPLE_SHARDS)


def register_shards(instance: DagsterInstance, keys: list[str]) -> list[str]:
    """Add the keys the instance does not know yet; return the ones added."""
    known = set(instance.get_dynamic_partitions(SAMPLE_SHARDS))
    new = [k for k in keys if k not in known]
    if new:
        instance.add_dynamic_partitions(SAMPLE_SHARDS, new)
    return new
