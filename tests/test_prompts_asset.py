"""The prompts asset materialises shards into the data directory, bad rows and all."""

from __future__ import annotations

import json

import polars as pl
from dagster import DagsterInstance, materialize

from eagle3_assets.glue.partitions import register_shards
from eagle3_assets.defs.prompts import prompts
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


def test_missing_dataset_fails_the_run_naming_the_file(tmp_path):
    dataset = PromptDataset(source=str(tmp_path / "gone.jsonl"), shard_size=4)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, ["shard-00000"])
    result = materialize([prompts], partition_key="shard-00000", resources={"prompt_dataset": dataset}, instance=instance, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert "gone.jsonl: no such file" in failure.step_failure_data.error.to_string()


def test_a_line_that_is_not_utf8_costs_that_row_only(tmp_path, data_dir):
    source = tmp_path / "latin1.jsonl"
    good = [json.dumps({"id": f"q{i}", "question": f"q {i}?"}).encode() for i in range(7)]
    source.write_bytes(b"\n".join(good[:5] + ['{"id": "x", "question": "caf\xe9?"}'.encode("latin-1")] + good[5:]) + b"\n")
    dataset = PromptDataset(source=str(source), shard_size=4)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    result = materialize([prompts], partition_key="shard-00001", resources={"prompt_dataset": dataset}, instance=instance)
    assert result.success
    assert pl.read_parquet(data_dir / "prompts" / "shard-00001.parquet")["id"].to_list() == ["q4", "q5", "q6"]
    (rejection,) = pl.read_parquet(data_dir / "prompts" / "shard-00001.rejected.parquet").to_dicts()
    assert rejection["row_index"] == 5 and rejection["reason"] == "not_utf8" and "line 6" in rejection["detail"]
    (mat,) = result.asset_materializations_for_node("prompts")
    assert mat.metadata["rejected_by_reason"].value == {"not_utf8": 1}


def test_a_shard_of_only_undecodable_lines_is_stopped_by_its_gate(tmp_path):
    source = tmp_path / "binary.jsonl"
    source.write_bytes(b"\x80\x81\x82\n\xff\xfe\n")
    dataset = PromptDataset(source=str(source), shard_size=4)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, ["shard-00000"])
    result = materialize([prompts], partition_key="shard-00000", resources={"prompt_dataset": dataset}, instance=instance, raise_on_error=False)
    assert not result.success
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert not checks["prompts_present"].passed
    assert checks["prompts_present"].description == "shard shard-00000 has no usable prompt (2 rows rejected)"


def test_a_late_shard_reads_its_rows_through_indexes_built_once(tmp_path, data_dir):
    source = tmp_path / "big.jsonl"
    rows = [json.dumps({"id": f"q{i}", "question": f"q {i}?"}) for i in range(42)] + [json.dumps({"id": "q3", "question": "again?"})]
    source.write_text("\n".join(rows) + "\n")
    dataset = PromptDataset(source=str(source), shard_size=8)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    indexes = {}
    for key in ("shard-00005", "shard-00004"):
        result = materialize([prompts], partition_key=key, resources={"prompt_dataset": dataset}, instance=instance)
        (mat,) = result.asset_materializations_for_node("prompts")
        indexes[key] = mat.metadata["dataset_indexes"].value
    # shard_keys() built the line index; the first late shard builds the id index, the next reuses both
    assert indexes == {
        "shard-00005": {"line_index": "reused", "id_index": "built"},
        "shard-00004": {"line_index": "reused", "id_index": "reused"},
    }
    rejected = pl.read_parquet(data_dir / "prompts" / "shard-00005.rejected.parquet")
    assert rejected.select("row_index", "id", "reason").rows() == [(42, "q3", "duplicate_id")]


def test_invisible_questions_and_unusable_ids_are_counted_apart(tmp_path, data_dir):
    source = tmp_path / "d.jsonl"
    rows = [{"id": f"q{i}", "question": f"q {i}?"} for i in range(4)]
    rows += [{"id": "zw", "question": "\u200b\u2060\ufeff"}, {"id": ["x", "y"], "question": "list id?"}, {"id": {"n": 1}, "question": "dict id?"}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = PromptDataset(source=str(source), shard_size=8)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    result = materialize([prompts], partition_key="shard-00000", resources={"prompt_dataset": dataset}, instance=instance)
    assert result.success
    (mat,) = result.asset_materializations_for_node("prompts")
    assert mat.metadata["rejected_by_reason"].value == {"empty_question": 1, "bad_id": 2}
    rejected = pl.read_parquet(data_dir / "prompts" / "shard-00000.rejected.parquet").sort("row_index")
    assert rejected["detail"].to_list()[1:] == [
        "id is a list (['x', 'y']); use a string or an integer",
        "id is a dict ({'n': 1}); use a string or an integer",
    ]
    assert pl.read_parquet(data_dir / "prompts" / "shard-00000.parquet")["id"].to_list() == ["q0", "q1", "q2", "q3"]
