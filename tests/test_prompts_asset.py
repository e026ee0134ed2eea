"""The prompts asset materialises shards into the data directory, bad rows and all."""

from __future__ import annotations

import json

import polars as pl
import pytest
from dagster import DagsterInstance, materialize

from eagle3_assets.partitions import register_shards
from eagle3_assets.prompts import prompts
from resources.prompt_dataset import PromptDataset


def test_prompts_shard_materialises_with_rejections(tmp_path, data_dir):
    source = tmp_path / "d.jsonl"
    rows = [json.dumps({"id": f"q{i}", "question": f"q {i}?"}) for i in range(5)] + ["{broken"]
    source.write_text("\n".join(rows) + "\n")
    dataset = PromptDataset(source=str(source), shard_size=4)
    instance = DagsterInstance.ephemeral()
    assert register_shards(instance, dataset.shard_keys()) == ["shard-00000", "shard-00001"]
    assert register_shards(instance, dataset.shard_keys()) == []

    result = materialize([prompts], partition_key="shard-00001", resources={"prompt_dataset": dataset}, instance=instance)
    assert result.success
    written = pl.read_parquet(data_dir / "prompts" / "shard-00001.parquet")
    assert written["id"].to_list() == ["q4"]
    rejected = pl.read_parquet(data_dir / "prompts" / "shard-00001.rejected.parquet")
    assert rejected["reason"].to_list() == ["invalid_json"]
    (mat,) = result.asset_materializations_for_node("prompts")
    assert mat.metadata["accepted"].value == 1 and mat.metadata["rejected"].value == 1
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["prompts_present"].passed
    assert not checks["rejected_rows_rare"].passed  # 1 of 2 rows rejected is above 5 %


def test_unreadable_dataset_fails_the_run_naming_the_file(tmp_path):
    source = tmp_path / "binary.jsonl"
    source.write_bytes(b"\x80\x81\x82\n")
    dataset = PromptDataset(source=str(source), shard_size=4)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, ["shard-00000"])
    result = materialize([prompts], partition_key="shard-00000", resources={"prompt_dataset": dataset}, instance=instance, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert "binary.jsonl, line 1" in failure.step_failure_data.error.to_string()
