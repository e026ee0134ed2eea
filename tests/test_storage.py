"""Files and directories the platform writes get the mode the process's umask gives, not 0600/0700."""

from __future__ import annotations

import json
import os
import stat

import pytest
from dagster import DagsterInstance, materialize

from eagle3_assets.core.storage.files import PARTIAL_SUFFIX, staging_dir, write_json_atomic
from eagle3_assets.glue.partitions import register_shards
from eagle3_assets.defs.prompts import prompts
from resources.prompt_dataset import PromptDataset


@pytest.fixture
def umask():
    """Set the process's umask for one test and restore it after."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask, file_mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_materialised_shard_files_follow_the_umask(tmp_path, data_dir, umask, mask, file_mode):
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "question": f"q {i}?"}) + "\n" for i in range(3)) + "{bad\n")
    umask(mask)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, ["shard-00000"])
    dataset = PromptDataset(source=str(source), shard_size=8)
    assert materialize([prompts], partition_key="shard-00000", resources={"prompt_dataset": dataset}, instance=instance).success
    for name in ("shard-00000.parquet", "shard-00000.rejected.parquet"):
        assert mode(data_dir / "prompts" / name) == file_mode, name
    assert not list((data_dir / "prompts").glob(f"*{PARTIAL_SUFFIX}"))


def test_staging_directories_and_json_files_follow_the_umask(tmp_path, umask):
    umask(0o022)
    final = tmp_path / "out" / "draft"
    staged = staging_dir(final)
    assert staged.parent == final.parent and staged.name.endswith(PARTIAL_SUFFIX)
    write_json_atomic(staged / "config.json", {"a": 1})
    os.replace(staged, final)
    assert mode(final) == 0o755  # a vLLM server running as another user can enter and read it
    assert mode(final / "config.json") == 0o644
    assert json.loads((final / "config.json").read_text()) == {"a": 1}


def test_a_shards_files_are_named_in_one_place(tmp_path):
    from pathlib import Path

    from eagle3_assets.core.storage.shard_paths import ShardPaths, superseded_path

    paths = ShardPaths("raw_responses", "shard-00003", tmp_path)
    where = tmp_path / "raw_responses"
    assert (paths.parquet, paths.rejected, paths.heldout) == (
        where / "shard-00003.parquet", where / "shard-00003.rejected.parquet", where / "shard-00003.heldout.parquet",
    )  # fmt: skip
    assert (paths.lease, paths.journal) == (where / "shard-00003.lease", where / "shard-00003.journal.jsonl")
    assert (paths.directory, paths.sidecar) == (where / "shard-00003", where / "shard-00003" / "metadata.json")
    kept = superseded_path(paths.parquet, "abc123")
    assert kept == where / "superseded" / "shard-00003.abc123.parquet" and paths.superseded() == []
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"")
    assert paths.superseded() == [kept]
    (where / ".shard-00003.parquet.x1.partial").write_bytes(b"")
    assert [p.name for p in paths.partials()] == [".shard-00003.parquet.x1.partial"]
    # What a GPU stage is sent: the same layout, relative to its host's data directory.
    assert ShardPaths.relative("hidden_states", "shard-00003").directory == Path("hidden_states/shard-00003")
    assert ShardPaths("prompts", "shard-00000").root == Path(os.environ["EAGLE3_DATA_DIR"]).resolve()
