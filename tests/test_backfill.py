"""The scripted backfill, ``python -m eagle3_assets.backfill``, against a real ``dagster dev``.

The command goes through the webserver's GraphQL API; the daemon runs the
backfill. What the instance records (the backfill's target partitions, the
runs, the materialisations) is read directly from the same ``DAGSTER_HOME``.
Only ``prompts`` is backfilled here: it needs no vLLM server, so these tests
show the mechanism without generation (the UI test backfills generation too).
A backfill puts all its ``prompts`` shards in one run (a run per contiguous
range of them), so that a whole-graph backfill requests the generation in full
ranges (eagle3_assets/defs/prompts.py says why).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from dagster import AssetCheckKey, AssetKey, RunsFilter
from dagster._core.execution.backfill import BulkActionStatus

from eagle3_assets.core.orchestration.backfill_client import UnknownShardsError, check_shards
from tests.dagster_dev import REPO, DagsterDev

pytestmark = pytest.mark.timeout(1800)

SHARDS = ["shard-00001", "shard-00002", "shard-00003"]  # a range inside the registered shards
DEMO_SHARD_SIZE = "64"  # the demo's 320 prompts: 5 shards


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    root = tmp_path_factory.mktemp("backfill")
    data = root / "data"
    env = {"EAGLE3_DATA_DIR": str(data), "EAGLE3_PROMPTS": "demo", "EAGLE3_SHARD_SIZE": DEMO_SHARD_SIZE}
    with DagsterDev(root / "dagster_home", env, root / "dagster-dev.log") as dev:
        from eagle3_assets.glue.partitions import register_shards
        from eagle3_assets.demo.plugin import DemoPromptDataset

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("EAGLE3_DATA_DIR", str(data))  # where the demo prompt set is written
            keys = DemoPromptDataset(shard_size=int(DEMO_SHARD_SIZE)).shard_keys()
        assert keys == [f"shard-{i:05d}" for i in range(5)]
        register_shards(dev.instance(), keys)
        dev.data = data
        dev.shards = keys
        yield dev


def backfill_command(dev: DagsterDev, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eagle3_assets.backfill", "--url", dev.url, *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )


def target_partitions(instance, backfill) -> dict[str, set[str]]:
    from eagle3_assets.definitions import defs

    target = backfill.get_asset_backfill_data(defs.resolve_asset_graph()).target_subset
    return {key.to_user_string(): set(subset.get_partition_keys()) for key, subset in target.partitions_subsets_by_asset_key.items()}


def test_a_backfill_of_three_shards_materialises_exactly_those_in_one_run(dev):
    """One run for the backfill's prompts (so that the generation behind them is requested in full ranges), each
    shard still recorded as its own partition, and nothing of the shards around them.

    Fails on: ``prompts`` without its backfill policy (``backfill_policy=`` removed from its ``multi_asset`` in
    eagle3_assets/defs/prompts.py): a run per shard, 3 runs.
    """
    done = backfill_command(dev, "--shards", ",".join(SHARDS), "--assets", "prompts", "--wait", "--timeout", "1100")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n--- dagster dev log ---\n{dev.log_tail()}"
    backfill_id = done.stdout.split("launched backfill ", 1)[1].split(":", 1)[0]
    assert f"/runs/b/{backfill_id}" in done.stdout

    instance = dev.instance()
    backfill = instance.get_backfill(backfill_id)
    assert backfill.status == BulkActionStatus.COMPLETED_SUCCESS
    assert target_partitions(instance, backfill) == {"prompts": set(SHARDS)}
    runs = instance.get_runs(RunsFilter(tags={"dagster/backfill": backfill_id}))
    assert [run_range(r) for r in runs] == [(SHARDS[0], SHARDS[-1])], [r.tags for r in runs]
    assert instance.get_materialized_partitions(AssetKey("prompts")) == set(SHARDS)
    # Each shard its own materialisation (in that run), data version and gate results.
    versions = set()
    for shard in SHARDS:
        record = instance.get_latest_data_version_record(AssetKey("prompts"), partition_key=shard)
        assert record.run_id == runs[0].run_id and record.asset_materialization.metadata["dagster/row_count"].value > 0
        versions.add(record.asset_materialization.tags["dagster/data_version"])
    assert len(versions) == len(SHARDS)
    history = instance.event_log_storage.get_asset_check_execution_history(AssetCheckKey(AssetKey("prompts"), "prompts_present"), limit=100)
    # (the run also records one planned entry for its whole range, without a partition)
    assert {r.partition: r.status.value for r in history if r.run_id == runs[0].run_id and r.partition} == dict.fromkeys(SHARDS, "SUCCEEDED")
    written = {p.name for p in (dev.data / "prompts").glob("shard-*.parquet") if p.name.count(".") == 1}  # not .rejected / .heldout
    assert written == {f"{s}.parquet" for s in SHARDS}


def run_range(run) -> tuple[str, str]:
    """The shards of a backfill's run: its range's first and last (a run of one shard may carry its partition tag)."""
    if "dagster/partition" in run.tags:
        return run.tags["dagster/partition"], run.tags["dagster/partition"]
    return run.tags["dagster/asset_partition_range_start"], run.tags["dagster/asset_partition_range_end"]


def test_an_unknown_shard_is_named_and_nothing_is_launched(dev):
    before = len(dev.instance().get_backfills())
    done = backfill_command(dev, "--shards", "shard-00001,shard-99999", "--assets", "prompts")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unknown shard(s): shard-99999 " in done.stderr and "shard-00001 " not in done.stderr.split("(")[0]
    assert "launched" not in done.stdout
    assert len(dev.instance().get_backfills()) == before

    done = backfill_command(dev, "--shards", "shard-00001", "--assets", "prompts,vocab_mapping")
    assert done.returncode == 2 and "not partitioned by sample shard: vocab_mapping" in done.stderr, done.stderr
    done = backfill_command(dev, "--shards", "shard-00001", "--assets", "promts")
    assert done.returncode == 2 and "unknown asset(s): promts" in done.stderr, done.stderr
    assert len(dev.instance().get_backfills()) == before


def test_all_registered_shards_with_a_run_config(dev, tmp_path):
    config = tmp_path / "run_config.yaml"
    config.write_text(f"resources:\n  prompt_dataset:\n    config: {{source: demo, shard_size: {DEMO_SHARD_SIZE}}}\n")
    done = backfill_command(dev, "--all", "--assets", "prompts", "--run-config", str(config), "--title", "every shard")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    backfill_id = done.stdout.split("launched backfill ", 1)[1].split(":", 1)[0]

    instance = dev.instance()
    backfill = instance.get_backfill(backfill_id)
    assert target_partitions(instance, backfill) == {"prompts": set(dev.shards)}
    assert backfill.run_config == {"resources": {"prompt_dataset": {"config": {"source": "demo", "shard_size": int(DEMO_SHARD_SIZE)}}}}
    assert backfill.title == "every shard"


def test_shard_names_are_checked_before_anything_is_sent():
    assert check_shards(["shard-00001", " shard-00000", "shard-00001"], ["shard-00000", "shard-00001"]) == ["shard-00001", "shard-00000"]
    with pytest.raises(UnknownShardsError) as caught:
        check_shards(["shard-00000", "shard-7", "shard-00009"], ["shard-00000", "shard-00001"])
    assert caught.value.unknown == ["shard-7", "shard-00009"]
    assert "unknown shard(s): shard-7, shard-00009 (2 registered: shard-00000 .. shard-00001)" in str(caught.value)
