"""Prompt datasets: accepted forms, bad rows with reasons, unreadable files, stable shards."""

from __future__ import annotations

import json

import polars as pl
import pytest

from eagle3_assets.core.prompt_loading import DatasetReadError, count_rows, load_shard
from eagle3_assets.core.sharding import shard_keys_for


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_perfectblend_conversations_drop_the_old_answer(tmp_path):
    row = {
        "id": "pb-1",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi?"},
            {"from": "gpt", "value": "Hello."},
            {"from": "human", "value": "What is 2 plus 2?"},
            {"from": "gpt", "value": "4"},
        ],
    }
    source = write_lines(tmp_path / "d.jsonl", [json.dumps(row)])
    shard = load_shard(source, "shard-00000", 8)
    assert shard.rejected.height == 0
    (record,) = shard.accepted.to_dicts()
    assert record["id"] == "pb-1"
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant", "user"]
    assert record["messages"][-1]["content"] == "What is 2 plus 2?"


def test_plain_question_field_and_content_hash_id(tmp_path):
    source = write_lines(tmp_path / "d.jsonl", [json.dumps({"question": "Why is the sky blue?"})] * 1)
    (record,) = load_shard(source, "shard-00000", 8).accepted.to_dicts()
    assert record["id"].startswith("sha-")
    assert record["messages"] == [{"role": "user", "content": "Why is the sky blue?"}]
    # the hash id is a function of the content: reading again gives the same id
    assert load_shard(source, "shard-00000", 8).accepted["id"][0] == record["id"]


def test_parquet_source(tmp_path):
    path = tmp_path / "d.parquet"
    pl.DataFrame({"id": ["a", "b"], "prompt": ["one?", "two?"]}).write_parquet(path)
    shard = load_shard(str(path), "shard-00000", 8)
    assert shard.accepted["id"].to_list() == ["a", "b"]


def test_bad_rows_are_rejected_with_reasons_and_keep_their_place(tmp_path):
    lines = [
        json.dumps({"id": "ok-1", "question": "fine?"}),
        "{not json",
        json.dumps({"id": "x", "text": "no known field"}),
        json.dumps({"id": "y", "question": "   "}),
        json.dumps({"id": "ok-1", "question": "same id again"}),
        json.dumps(["a", "list"]),
        json.dumps({"id": "z", "conversations": [{"from": "robot", "value": "?"}]}),
        json.dumps({"id": "ok-2", "question": "also fine?"}),
    ]
    source = write_lines(tmp_path / "d.jsonl", lines)
    shard = load_shard(source, "shard-00000", 16)
    assert shard.accepted["id"].to_list() == ["ok-1", "ok-2"]
    assert shard.accepted["row_index"].to_list() == [0, 7]
    reasons = dict(zip(shard.rejected["row_index"].to_list(), shard.rejected["reason"].to_list()))
    assert reasons == {
        1: "invalid_json",
        2: "missing_fields",
        3: "empty_question",
        4: "duplicate_id",
        5: "not_an_object",
        6: "bad_role",
    }
    assert "line" not in shard.rejected["detail"][0] or "column" in shard.rejected["detail"][0]


def test_unreadable_file_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_bytes(json.dumps({"question": "ok?"}).encode() + b"\n\xff\xfe garbage\n")
    with pytest.raises(DatasetReadError, match=r"broken\.jsonl, line 2"):
        load_shard(str(path), "shard-00000", 8)
    with pytest.raises(DatasetReadError, match="no such file"):
        load_shard(str(tmp_path / "missing.jsonl"), "shard-00000", 8)
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetReadError, match=r"bad\.parquet"):
        load_shard(str(bad_parquet), "shard-00000", 8)


def test_appending_rows_never_moves_an_existing_prompt(tmp_path):
    rows = [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(10)]
    source = write_lines(tmp_path / "d.jsonl", rows)
    before = {k: load_shard(source, k, 4).accepted["id"].to_list() for k in shard_keys_for(count_rows(source), 4)}
    assert list(before) == ["shard-00000", "shard-00001", "shard-00002"]

    extra = [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(10, 17)]
    write_lines(tmp_path / "d.jsonl", rows + extra)
    keys = shard_keys_for(count_rows(source), 4)
    after = {k: load_shard(source, k, 4).accepted["id"].to_list() for k in keys}
    assert keys == ["shard-00000", "shard-00001", "shard-00002", "shard-00003", "shard-00004"]
    assert after["shard-00000"] == before["shard-00000"]
    assert after["shard-00001"] == before["shard-00001"]
    # the last shard only grows; nothing that was in it leaves it
    assert after["shard-00002"][: len(before["shard-00002"])] == before["shard-00002"]
    placed = [i for ids in after.values() for i in ids]
    assert sorted(placed) == sorted(f"q{i}" for i in range(17)) and len(set(placed)) == 17
