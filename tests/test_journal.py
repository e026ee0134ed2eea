"""The shard journal: durable rows survive a torn write, other inputs are never mixed in, finalising is exact."""

from __future__ import annotations

import json

import polars as pl
import pytest

from eagle3_assets.core.generation import ROW_SCHEMA
from eagle3_assets.core.journal import JournalCorruptError, ShardJournal, parquet_fingerprint


def row(sample_id: str, error: str | None = None) -> dict:
    return {
        "id": sample_id, "reasoning": None if error else f"think {sample_id}", "content": None if error else "answer",
        "reasoning_field": "none" if error else "reasoning", "finish_reason": None if error else "stop",
        "prompt_tokens": 5, "completion_tokens": 7, "latency_s": 0.1, "server": "http://s", "model": "m",
        "attempts": 1, "error": error,
    }  # fmt: skip


def test_torn_last_line_is_dropped_and_later_appends_start_on_a_clean_line(tmp_path):
    path = tmp_path / "shard-00000.journal.jsonl"
    with ShardJournal(path, "fp").open() as journal:
        journal.append(row("a"))
        journal.append(row("b", error="http 503: busy"))
    with open(path, "ab") as fh:  # what SIGKILL in the middle of a write leaves behind
        fh.write(json.dumps(row("c")).encode()[:25])

    journal = ShardJournal(path, "fp")
    rows = journal.load()
    assert set(rows) == {"a", "b"} and rows["b"]["error"] == "http 503: busy"
    with journal.open():
        journal.append(row("b"))  # the retried error row replaces the earlier one
        journal.append(row("c"))
    lines = path.read_bytes().splitlines()
    assert all(json.loads(line) for line in lines)  # no line glued onto the torn one
    rows = ShardJournal(path, "fp").load()
    assert rows["b"]["error"] is None and set(rows) == {"a", "b", "c"}

    frame = journal.finalize(tmp_path / "shard-00000.parquet", ["c", "a", "b"], rows, ROW_SCHEMA)
    assert not path.exists()
    written = pl.read_parquet(tmp_path / "shard-00000.parquet")
    assert written["id"].to_list() == ["c", "a", "b"] and written.schema == pl.Schema(ROW_SCHEMA)
    assert frame.equals(written)
    assert parquet_fingerprint(tmp_path / "shard-00000.parquet") == "fp"


def test_journal_of_other_inputs_is_set_aside_not_resumed(tmp_path):
    path = tmp_path / "s.journal.jsonl"
    with ShardJournal(path, "old-sampling").open() as journal:
        journal.append(row("a"))
    journal = ShardJournal(path, "new-sampling")
    assert journal.load() == {}
    assert not path.exists() and journal.set_aside is not None and journal.set_aside.exists()


def test_finalising_with_a_missing_id_refuses_and_a_damaged_line_is_named(tmp_path):
    path = tmp_path / "s.journal.jsonl"
    with ShardJournal(path, "fp").open() as journal:
        journal.append(row("a"))
    journal = ShardJournal(path, "fp")
    with pytest.raises(ValueError, match="1 ids have no row"):
        journal.finalize(tmp_path / "s.parquet", ["a", "b"], journal.load(), ROW_SCHEMA)
    assert path.exists() and not (tmp_path / "s.parquet").exists()

    path.write_bytes(path.read_bytes() + b"garbage\n" + json.dumps(row("b")).encode() + b"\n")
    with pytest.raises(JournalCorruptError, match="line 3"):
        ShardJournal(path, "fp").load()
