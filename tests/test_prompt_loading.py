"""Prompt datasets: accepted forms, bad rows with reasons, unreadable files, stable shards."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import polars as pl
import pytest

from eagle3_assets.core.prompts.loading import count_rows, load_shard
from eagle3_assets.core.prompts.sources import DatasetReadError
from eagle3_assets.core.prompts.sharding import shard_keys_for


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


def test_a_line_that_is_not_utf8_is_rejected_alone(tmp_path):
    path = tmp_path / "broken.jsonl"
    first = json.dumps({"id": "a", "question": "ok?"}).encode() + b"\n"
    content = first + b'{"id": "b", "question": "caf\xe9?"}\n' + json.dumps({"id": "c", "question": "fine?"}).encode() + b"\n"
    path.write_bytes(content)
    for key, size in (("shard-00000", 8), ("shard-00001", 1)):  # read whole, and through the line index
        shard = load_shard(str(path), key, size)
        if key == "shard-00000":
            assert shard.accepted["id"].to_list() == ["a", "c"]
        else:
            assert shard.accepted.height == 0
        (rejection,) = shard.rejected.to_dicts()
        assert rejection["row_index"] == 1 and rejection["reason"] == "not_utf8"
        # the byte a user has to fix: the 0xE9 after "caf" on line 2
        assert f"byte {content.index(0xE9)} of the file" in rejection["detail"] and "line 2" in rejection["detail"]


def test_unreadable_file_names_the_file(tmp_path):
    with pytest.raises(DatasetReadError, match=r"missing\.jsonl: no such file"):
        load_shard(str(tmp_path / "missing.jsonl"), "shard-00000", 8)
    with pytest.raises(DatasetReadError, match=r"missing\.jsonl: no such file"):
        count_rows(str(tmp_path / "missing.jsonl"))
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetReadError, match=r"bad\.parquet: cannot read as Parquet"):
        load_shard(str(bad_parquet), "shard-00000", 8)
    with pytest.raises(DatasetReadError, match=r"bad\.parquet: cannot read as Parquet"):
        count_rows(str(bad_parquet))


def test_invisible_questions_are_empty_and_non_scalar_ids_are_bad(tmp_path):
    invisible = ["\u200b", "\u200c\u200d", "\u2060 \ufeff", "\u00a0\u3000\t", "\u3164", "\u202e\u200e"]
    rows = [{"id": f"blank-{i}", "question": q} for i, q in enumerate(invisible)]
    rows += [{"id": ["a"], "question": "list id?"}, {"id": {"k": 1}, "question": "dict id?"}, {"id": True, "question": "bool id?"}]
    rows += [{"id": 1.5, "question": "float id?"}, {"conversation_id": 7, "question": "int id?"}, {"id": "v", "question": "\u200bvisible"}]
    lines = [json.dumps(r) for r in rows] + ['{"id": NaN, "question": "nan id?"}']
    shard = load_shard(write_lines(tmp_path / "d.jsonl", lines), "shard-00000", 32)
    assert shard.accepted["id"].to_list() == ["7", "v"]
    rejected = {r["row_index"]: (r["reason"], r["detail"]) for r in shard.rejected.to_dicts()}
    assert [rejected[i][0] for i in range(len(invisible))] == ["empty_question"] * len(invisible)
    types = {6: "list", 7: "dict", 8: "bool", 9: "float", 12: "float"}
    for row, type_name in types.items():
        reason, detail = rejected[row]
        assert reason == "bad_id" and f"is a {type_name}" in detail, (row, detail)
    assert sorted(rejected) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12]


def dataset_rows(count):
    """Rows with every kind of trouble spread over the file, and ids reused across shards."""
    lines = []
    for i in range(count):
        if i % 11 == 5:
            lines.append(b"{broken")
        elif i % 13 == 7:
            lines.append(b'{"id": "x\xff", "question": "latin-1?"}')
        elif i % 7 == 3:
            lines.append(json.dumps({"id": f"q{i // 3}", "question": f"again {i}?"}).encode())  # an earlier id
        elif i % 17 == 0:
            lines.append(json.dumps({"id": f"late{i + 40}", "question": "   "}).encode())  # bad row: its id does not count
        else:
            lines.append(json.dumps({"id": f"q{i}", "question": f"question {i}?"}).encode())
    return lines


def reference_shards(lines, shard_size):
    """What every shard must hold: the rule written out directly over the whole file."""
    seen, verdicts = set(), []
    for i, raw in enumerate(lines):
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            verdicts.append((i, "not_utf8"))
            continue
        except ValueError:
            verdicts.append((i, "invalid_json"))
            continue
        if not record["question"].strip():
            verdicts.append((i, "empty_question"))
        elif record["id"] in seen:
            verdicts.append((i, "duplicate_id"))
        else:
            seen.add(record["id"])
            verdicts.append((i, record["id"]))
    return [verdicts[s : s + shard_size] for s in range(0, len(lines), shard_size)]


def shard_verdicts(shard):
    got = [(r["row_index"], r["id"]) for r in shard.accepted.to_dicts()] + [
        (r["row_index"], r["reason"]) for r in shard.rejected.to_dicts()
    ]
    return sorted(got)


@pytest.mark.parametrize("final_newline", [True, False])
def test_every_shard_read_through_the_indexes_matches_the_whole_file_rule(tmp_path, final_newline):
    lines = dataset_rows(100)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))
    expected = reference_shards(lines, 8)
    assert count_rows(str(path)) == 100
    keys = shard_keys_for(count_rows(str(path)), 8)
    for key in reversed(keys):  # last shard first: nothing read before it helps
        assert shard_verdicts(load_shard(str(path), key, 8)) == expected[int(key[-5:])], key


def test_parquet_shards_match_the_whole_file_rule(tmp_path):
    lines = [line for line in dataset_rows(100) if b"\xff" not in line and line != b"{broken"]
    records = [json.loads(line) for line in lines]
    path = tmp_path / "d.parquet"
    pl.DataFrame(records).write_parquet(path, row_group_size=10)
    expected = reference_shards(lines, 8)
    assert count_rows(str(path)) == len(lines)
    for key in reversed(shard_keys_for(len(lines), 8)):
        assert shard_verdicts(load_shard(str(path), key, 8)) == expected[int(key[-5:])], key


def test_the_indexes_are_built_once_extended_on_append_and_rebuilt_on_rewrite(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(20)]
    write_lines(path, rows)
    first = load_shard(str(path), "shard-00003", 5)
    assert first.indexes == {"line_index": "built", "id_index": "built"}
    assert (tmp_path / ".d.jsonl.lines").is_file() and (tmp_path / ".d.jsonl.ids.sqlite").is_file()
    assert load_shard(str(path), "shard-00002", 5).indexes == {"line_index": "reused", "id_index": "reused"}
    assert load_shard(str(path), "shard-00000", 5).indexes == {}  # nothing before it to compare with

    # an append, the way a dataset grows: the indexes continue from where they stopped
    with open(path, "a") as fh:
        fh.write(json.dumps({"id": "q2", "question": "an old id again?"}) + "\n")
        fh.write(json.dumps({"id": "new", "question": "new?"}) + "\n")
    grown = load_shard(str(path), "shard-00004", 5)
    assert grown.indexes == {"line_index": "extended", "id_index": "extended"}
    assert grown.accepted["id"].to_list() == ["new"]
    assert grown.rejected.select("row_index", "reason").rows() == [(20, "duplicate_id")]
    assert count_rows(str(path)) == 22

    # a rewrite in place with other, longer rows (same inode, file grew): nothing of the old offsets or ids may survive
    old_size = path.stat().st_size
    write_lines(path, [json.dumps({"id": f"r{i}", "question": f"{'long ' * (i + 20)}question?"}) for i in range(12)])
    assert path.stat().st_size > old_size
    rewritten = load_shard(str(path), "shard-00002", 5)
    assert rewritten.indexes == {"line_index": "built", "id_index": "built"}
    assert rewritten.accepted["id"].to_list() == ["r10", "r11"]
    assert count_rows(str(path)) == 12


def test_a_line_caught_half_written_is_read_whole_once_the_writer_finishes_it(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(6)]
    path.write_text("\n".join(rows[:5]) + "\n" + rows[5][:15])  # a writer is in the middle of row 5
    assert count_rows(str(path)) == 6
    shard = load_shard(str(path), "shard-00001", 4)
    assert shard.accepted["id"].to_list() == ["q4"]
    assert shard.rejected.select("row_index", "reason").rows() == [(5, "invalid_json")]

    with open(path, "a") as fh:  # the writer finishes row 5 and adds row 6, which repeats an id
        fh.write(rows[5][15:] + "\n" + json.dumps({"id": "q5", "question": "again?"}) + "\n")
    shard = load_shard(str(path), "shard-00001", 4)
    assert shard.indexes == {"line_index": "extended", "id_index": "extended"}
    assert shard.accepted["id"].to_list() == ["q4", "q5"]
    assert shard.rejected.select("row_index", "reason").rows() == [(6, "duplicate_id")]
    assert count_rows(str(path)) == 7


def test_damaged_indexes_are_rebuilt_not_trusted(tmp_path):
    path = tmp_path / "d.jsonl"
    write_lines(path, [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(9)] + [json.dumps({"id": "q0", "question": "dup?"})])
    expected = load_shard(str(path), "shard-00002", 4)
    lines, ids = tmp_path / ".d.jsonl.lines", tmp_path / ".d.jsonl.ids.sqlite"
    lines.write_bytes(lines.read_bytes()[:-5])  # a torn copy
    ids.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)  # not a database any more
    again = load_shard(str(path), "shard-00002", 4)
    assert again.indexes == {"line_index": "built", "id_index": "built"}
    assert again.accepted.equals(expected.accepted) and again.rejected.equals(expected.rejected)
    assert again.rejected["reason"].to_list() == ["duplicate_id"]


def _load_in_another_process(source, key):
    shard = load_shard(source, key, 100)
    return shard.indexes, shard.accepted.height


def test_shard_runs_starting_together_build_each_index_once(tmp_path):
    """A backfill starts many shard runs at once on a fresh file: one builds, the others wait and reuse."""
    path = tmp_path / "d.jsonl"
    write_lines(path, [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(30_000)])
    keys = ["shard-00297", "shard-00298", "shard-00299"]
    with ProcessPoolExecutor(len(keys), mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_load_in_another_process, [str(path)] * len(keys), keys))
    assert [height for _, height in results] == [100, 100, 100]
    for name in ("line_index", "id_index"):
        assert sorted(indexes[name] for indexes, _ in results) == ["built", "reused", "reused"], results


def test_an_index_that_cannot_be_written_beside_the_dataset_goes_to_the_data_dir(tmp_path, data_dir):
    shared = tmp_path / "shared"
    shared.mkdir()
    path = shared / "d.jsonl"
    write_lines(path, [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(6)] + [json.dumps({"id": "q1", "question": "dup?"})])
    with read_only_directory(shared):
        shard = load_shard(str(path), "shard-00001", 4)
        assert shard.accepted["id"].to_list() == ["q4", "q5"]
        assert shard.rejected["reason"].to_list() == ["duplicate_id"]
        assert sorted(p.name for p in shared.iterdir()) == ["d.jsonl"]
        cached = sorted(p.suffix for p in (data_dir / ".cache" / "prompt_index").iterdir() if not p.name.endswith(".lock"))
        assert cached == [".lines", ".sqlite"]
        assert load_shard(str(path), "shard-00001", 4).indexes == {"line_index": "reused", "id_index": "reused"}


@contextmanager
def read_only_directory(path):
    """A directory nobody can write into, root included (root ignores mode bits: use the immutable flag)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root without a working `chattr +i`: cannot make a directory read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


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
