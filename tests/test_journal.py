"""The shard journal: durable rows survive a torn write, other inputs are never mixed in, finalising is exact."""

from __future__ import annotations

import json

import polars as pl
import pytest

from eagle3_assets.core.generation.completions import ROW_SCHEMA
from eagle3_assets.core.storage.journal import (
    JournalCorruptError,
    ShardJournal,
    keep_superseded,
    parquet_fingerprint,
    parquet_generation,
    superseded_path,
)


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


def test_a_new_journal_comes_into_being_with_exactly_one_header(tmp_path):
    tmp_path = tmp_path / "raw_responses"
    tmp_path.mkdir()
    path = tmp_path / "s.journal.jsonl"
    path.write_bytes(b"")  # an empty file (nothing durable in it) is made afresh, with its header
    with ShardJournal(path, "fp").open([row("seeded")]) as journal:
        journal.append(row("a"))
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert lines[0] == {"journal": 1, "fingerprint": "fp"} and [r["id"] for r in lines[1:]] == ["seeded", "a"]
    assert sum("journal" in line for line in lines) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.journal.jsonl"]  # no temporary file left behind

    # Two writers racing to create one journal: the second cannot write a header into the first one's file.
    with pytest.raises(JournalCorruptError, match="another run created this journal at the same moment"):
        ShardJournal(path, "fp")._create([row("b")])
    assert [json.loads(line)["id"] for line in path.read_bytes().splitlines()[1:]] == ["seeded", "a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.journal.jsonl"]


def test_a_second_header_or_a_row_without_id_is_named_as_corruption_not_a_key_error(tmp_path):
    path = tmp_path / "shard-00003.journal.jsonl"
    header = json.dumps({"journal": 1, "fingerprint": "fp"}).encode() + b"\n"
    path.write_bytes(header + json.dumps(row("a")).encode() + b"\n" + header + json.dumps(row("b")).encode() + b"\n")
    with pytest.raises(JournalCorruptError, match=r"shard-00003\.journal\.jsonl, line 3: a second journal header") as caught:
        ShardJournal(path, "fp").load()
    assert "materialise the shard again" in str(caught.value)
    path.write_bytes(header + b'{"reasoning": "no id"}\n')
    with pytest.raises(JournalCorruptError, match=r"line 2: not a row with an 'id'"):
        ShardJournal(path, "fp").load()


def test_a_finished_shard_of_other_settings_is_kept_with_its_settings_never_overwritten(tmp_path):
    parquet = tmp_path / "shard-00000.parquet"
    first = {"model": "m", "temperature": 0.7, "allow_truncated": False}
    journal = ShardJournal(tmp_path / "j.jsonl", "fp-old")
    original = journal.finalize(parquet, ["a", "b"], {"a": row("a"), "b": row("b")}, ROW_SCHEMA, generation=first)
    assert parquet_generation(parquet) == first

    assert keep_superseded(parquet, "fp-old") is None  # same settings: nothing to keep aside
    kept = keep_superseded(parquet, "fp-new", {"model": "m", "temperature": 0.71})
    assert kept == superseded_path(parquet, "fp-old") == tmp_path / "superseded" / "shard-00000.fp-old.parquet"
    assert not parquet.exists() and pl.read_parquet(kept).equals(original)
    sidecar = json.loads(kept.with_suffix(".json").read_text())
    assert sidecar["generation"] == first and sidecar["rows"] == 2 and sidecar["fingerprint"] == "fp-old"
    assert sidecar["superseded_by"] == {"fingerprint": "fp-new", "generation": {"model": "m", "temperature": 0.71}}

    # The same settings superseded a second time: a numbered name, the first kept file untouched.
    again = ShardJournal(tmp_path / "j.jsonl", "fp-old").finalize(parquet, ["c"], {"c": row("c")}, ROW_SCHEMA, generation=first)
    second = keep_superseded(parquet, "fp-new")
    assert second == tmp_path / "superseded" / "shard-00000.fp-old-2.parquet"
    assert pl.read_parquet(second).equals(again) and pl.read_parquet(kept).equals(original)
