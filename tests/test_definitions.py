"""The one Definitions object loads, and every asset, partition and check is there."""

from __future__ import annotations

from dagster import AssetCheckKey, AssetKey, DynamicPartitionsDefinition

from eagle3_assets.definitions import defs
from eagle3_assets.partitions import SAMPLE_SHARDS

PER_SHARD = {"prompts"}
CHECKS = {
    ("prompts", "prompts_present"),
    ("prompts", "rejected_rows_rare"),
}


def test_definitions_load_with_assets_partitions_and_checks():
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert PER_SHARD <= keys
    for name in PER_SHARD:
        partitions = graph.get(AssetKey(name)).partitions_def
        assert isinstance(partitions, DynamicPartitionsDefinition) and partitions.name == SAMPLE_SHARDS
    checks = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert CHECKS <= checks
    assert AssetCheckKey(AssetKey("prompts"), "prompts_present") in graph.asset_check_keys


def test_every_asset_has_a_stage_group_and_description():
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.group_name in {"generation", "validation", "extraction", "training", "evaluation"}, key
        assert node.description, f"{key} has no description"
