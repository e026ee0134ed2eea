"""Recovery of a shard's files, through Dagster: one writer per shard, dead writers' leftovers, damaged files.

What a user sees is asserted: one plain rerun recovers the shard, nothing is
lost or duplicated, a damaged file is kept aside, and every error names the
file, the shard and what to do. Faults are real: processes are SIGKILLed,
bytes on disk are truncated or overwritten.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterEventType, DagsterInstance, RunConfig, materialize

from eagle3_assets.core.extraction.part_files import HiddenStateFileError
from eagle3_assets.core.extraction.shard_reading import read_sidecar
from eagle3_assets.core.storage.shard_paths import PART_GLOB, SIDECAR
from eagle3_assets.core.storage.shard_lease import ShardBusyError, ShardLease, lease_path
from eagle3_assets.core.training.data import index_hidden_states, load_batch
from eagle3_assets.demo.plugin import DemoTargetModel
from eagle3_assets.glue.partitions import register_shards
from tests.extraction_helpers import write_validated_traces
from tests.hold_point import HoldPoint

REPO = Path(__file__).resolve().parents[1]
SHARD = "shard-00000"


def hidden_states_resources(tiny_target):
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    return {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()}


def hidden_states_config(**fields):
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig

    return RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1, **fields)})


def materialise_hidden_states(instance, tiny_target, **fields):
    from eagle3_assets.defs.hidden_states import hidden_states

    return materialize(
        [hidden_states], partition_key=SHARD, resources=hidden_states_resources(tiny_target), instance=instance,
        run_config=hidden_states_config(**fields), raise_on_error=False,
    )  # fmt: skip


def run_logs(instance, run_id) -> list[str]:
    return [entry.user_message for entry in instance.all_logs(run_id) if entry.user_message]


# -- the lease itself ------------------------------------------------------------------------


def test_a_live_holder_is_named_and_a_dead_ones_lease_and_leftovers_are_taken_over(tmp_path):
    out = tmp_path / "raw_responses"
    logs: list[str] = []
    with ShardLease(out, SHARD, asset="raw_responses", run_id="run-a"):
        with pytest.raises(ShardBusyError, match=rf"{SHARD} of raw_responses is being written by run run-a on host \S+ \(pid {os.getpid()}\)"):
            ShardLease(out, SHARD, asset="raw_responses", run_id="run-b").acquire()
        ShardLease(out, "shard-00001", asset="raw_responses", run_id="run-b").acquire().release()  # other shards are free
    assert not lease_path(out, SHARD).exists(), "released on exit"

    # A writer SIGKILLed inside an atomic write leaves its lease and a 0-byte .partial.
    code = (
        "import os, signal, sys; from pathlib import Path\n"
        "from eagle3_assets.core.storage.shard_lease import ShardLease; from eagle3_assets.core.storage.files import atomic_path\n"
        "ShardLease(Path(sys.argv[1]), 'shard-00000', asset='raw_responses', run_id='run-killed').acquire()\n"
        "with atomic_path(Path(sys.argv[1]) / 'shard-00000.parquet'):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert killed.returncode == -signal.SIGKILL
    (leftover,) = out.glob(".shard-00000.parquet.*.partial")
    assert leftover.stat().st_size == 0
    (out / ".shard-000001.parquet.x.partial").write_bytes(b"")  # another shard's file: not ours to touch

    with ShardLease(out, SHARD, asset="raw_responses", run_id="run-c", log=logs.append):
        assert json.loads(lease_path(out, SHARD).read_text())["run_id"] == "run-c"
    assert any("took over the lease of run run-killed" in line and "gone (dead)" in line for line in logs), logs
    assert any(f"removed {leftover} (0 bytes)" in line for line in logs), logs
    assert not leftover.exists() and (out / ".shard-000001.parquet.x.partial").exists()


def test_a_holder_on_another_host_is_refused_until_stale_or_taken_over_by_the_operator(tmp_path, monkeypatch):
    out = tmp_path / "prompts"
    out.mkdir()
    record = {"run_id": "run-far", "host": "gpu-node-7", "pid": 4242, "started_at": "then", "heartbeat_at": time.time() - 60}
    lease_path(out, SHARD).write_text(json.dumps(record))
    with pytest.raises(ShardBusyError, match=r"run run-far on host gpu-node-7 .* set EAGLE3_LEASE_TAKEOVER=gpu-node-7"):
        ShardLease(out, SHARD, asset="prompts").acquire()
    logs: list[str] = []
    ShardLease(out, SHARD, asset="prompts", stale_after_s=30, log=logs.append).acquire().release()  # heartbeat 60 s old
    assert any("took over the lease of run run-far on host gpu-node-7" in line and "(stale)" in line for line in logs)

    lease_path(out, SHARD).write_text(json.dumps({**record, "heartbeat_at": time.time()}))
    monkeypatch.setenv("EAGLE3_LEASE_TAKEOVER", "gpu-node-7")
    ShardLease(out, SHARD, asset="prompts").acquire().release()


# -- hidden_states: SIGKILL mid-shard, then one plain rerun --------------------------------------

WORKER = """
import sys
from dagster import DagsterEventType, DagsterInstance, RunConfig, materialize
from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
from eagle3_assets.glue.partitions import register_shards
from resources.gpu_host import GPUHost
from resources.target_model import TargetModel
instance = DagsterInstance.ephemeral()
register_shards(instance, [sys.argv[1]])
materialize([hidden_states], partition_key=sys.argv[1], instance=instance,
            resources={"target_model": TargetModel(path=sys.argv[2]), "gpu_host": GPUHost()},
            run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1, max_batch_size=1)}))
"""


def test_sigkill_mid_hidden_states_then_one_plain_rerun_completes_the_shard(data_dir, tiny_target):
    traces = write_validated_traces(data_dir, SHARD, tiny_target, count=12)
    shard = data_dir / "hidden_states" / SHARD
    # The stage is held mid-part (the states of 3 of the part's 12 samples written into its file) and dies there,
    # as in an OOM kill, however fast or loaded the machine.
    with HoldPoint("eagle3_assets.core.extraction.part_files:PartFileWriter.write_rows", call=3, matching="final_hidden_states") as hold:
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, SHARD, str(tiny_target)], cwd=REPO, env=hold.env({**os.environ, "PYTHONPATH": str(REPO)}),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            stage = hold.wait(lambda: worker.poll() is None, "the stage writing the shard")
            assert json.loads(lease_path(shard.parent, SHARD).read_text())["pid"] == stage, "the held stage holds the shard's lease"
            hold.kill()
        finally:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(60)
    (partial,) = shard.glob("*.partial")
    assert not (shard / SIDECAR).exists() and not list(shard.glob(PART_GLOB)), "no part of the shard was finished"

    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    rerun = materialise_hidden_states(instance, tiny_target, max_batch_size=1)
    logs = run_logs(instance, rerun.run_id)
    assert rerun.success, "\n".join(logs[-30:])
    assert any("took over the lease" in line and "gone (dead)" in line for line in logs)
    assert any(f"removed {partial}" in line for line in logs)
    assert not list(shard.glob("*.partial")) and not lease_path(shard.parent, SHARD).exists()
    checks = {e.check_name: e.passed for e in rerun.get_asset_check_evaluations()}
    assert checks["states_match_traces"] and all(checks.values()), checks
    ids = read_sidecar(shard)["sample_ids"]
    assert sorted(ids) == sorted(pl.read_parquet(traces, columns=["id"])["id"].to_list()) and len(set(ids)) == len(ids)


# -- hidden_states: a damaged part -------------------------------------------------------------


def test_a_damaged_part_is_named_by_the_training_reader_and_a_rerun_rebuilds_only_it(data_dir, tiny_target):
    write_validated_traces(data_dir, SHARD, tiny_target, count=10)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    first = materialise_hidden_states(instance, tiny_target, part_size_bytes=200_000)
    assert first.success
    shard = data_dir / "hidden_states" / SHARD
    parts = sorted(shard.glob("part-*.safetensors"))
    assert len(parts) >= 3
    original = {p.name: p.read_bytes() for p in parts}
    index_hidden_states([shard])  # verifies

    # Finite garbage in one part (no NaN, nothing a gate is sure to sample), the tail of another cut off.
    garbage, truncated = parts[1], parts[2]
    with open(garbage, "r+b") as fh:
        fh.seek(-4096, os.SEEK_END)
        fh.write(bytes(range(256)) * 16)
    truncated.write_bytes(original[truncated.name][: len(original[truncated.name]) // 2])

    with pytest.raises(HiddenStateFileError) as error:
        index_hidden_states([shard])
    assert str(garbage) in str(error.value) and f"rerun hidden_states for {SHARD}" in str(error.value)
    assert "sha256" in str(error.value)
    garbage.write_bytes(original[garbage.name])  # one at a time: the truncated part alone also names its file
    with pytest.raises(HiddenStateFileError, match=rf"{truncated}.*rerun hidden_states for {SHARD}"):
        index_hidden_states([shard])
    with open(garbage, "r+b") as fh:  # damage it again for the rerun
        fh.seek(-4096, os.SEEK_END)
        fh.write(bytes(range(256)) * 16)

    rerun = materialise_hidden_states(instance, tiny_target, part_size_bytes=200_000)
    logs = run_logs(instance, rerun.run_id)
    assert rerun.success, "\n".join(logs[-30:])
    (mat,) = rerun.asset_materializations_for_node("hidden_states")
    assert (mat.metadata["parts_quarantined"].value, mat.metadata["parts_written"].value) == (2, 2)
    assert mat.metadata["parts_reused"].value == len(parts) - 2
    for damaged in (garbage, truncated):
        (aside,) = shard.glob(f"{damaged.name}.corrupt-*")  # the damaged file is kept for inspection
        assert any(f"quarantined {damaged} as {aside.name}" in line for line in logs), logs
        assert damaged.read_bytes() == original[damaged.name], "rebuilt exactly"
    index = index_hidden_states([shard])
    assert load_batch(index.samples[:2], 64).num_tokens > 0


# -- generation: two runs of one shard, damaged Parquet files, a killed run in the local instance -------------

GENERATION_WORKER = """
import json, sys
from dagster import DagsterInstance, materialize
from eagle3_assets.glue.partitions import register_shards
from eagle3_assets.defs.raw_responses import raw_responses
from eagle3_assets.demo.plugin import DemoTargetModel
from resources.vllm_server import VLLMServerResource
instance = DagsterInstance.get() if sys.argv[3] == "home" else DagsterInstance.ephemeral()
register_shards(instance, [sys.argv[1]])
server = VLLMServerResource(**json.loads(sys.argv[2]))
resources = {"vllm_server": server, "target_model": DemoTargetModel()}
result = materialize([raw_responses], partition_key=sys.argv[1], resources=resources, instance=instance)
print("RUN_ID", result.run_id, flush=True)
"""


def generation_fields(vllm_server, proxy, **overrides) -> dict:
    from tests.test_generation import FAST

    return {"base_urls": [proxy.base_url], "served_model_name": vllm_server.served_model_name, **FAST, "concurrency": 4, **overrides}


def start_generation_worker(fields: dict, instance_kind: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", GENERATION_WORKER, SHARD, json.dumps(fields), instance_kind], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def wait_for(condition, worker: subprocess.Popen, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if worker.poll() is not None or time.monotonic() > deadline:
            worker.kill()
            raise AssertionError(f"{what}: not reached; worker output:\n{worker.stdout.read().decode()[-3000:]}")
        time.sleep(0.05)


def failure_messages(result) -> list[str]:
    return [event.step_failure_data.error.to_string() for event in result.all_events if event.is_step_failure]


def journal_rows(data_dir: Path) -> int:
    journal = data_dir / "raw_responses" / f"{SHARD}.journal.jsonl"
    return max(journal.read_bytes().count(b"\n") - 1, 0) if journal.exists() else 0


@pytest.mark.vllm
def test_a_second_run_of_a_shard_fails_at_once_naming_the_first_and_nothing_is_generated_twice(vllm_server, data_dir):
    from eagle3_assets.core.generation.completions import CANARY_ID
    from tests.fault_proxy import FaultProxy
    from tests.test_generation import demo_prompts, materialise, server_at
    from eagle3_assets.defs.prompts import prompts
    from eagle3_assets.defs.raw_responses import raw_responses

    materialise({"prompt_dataset": demo_prompts(24)}, assets=[prompts])
    expected = pl.read_parquet(data_dir / "prompts" / f"{SHARD}.parquet")["id"].to_list()
    # The proxy answers the first run's first 2 samples and holds the rest until released: the second run starts
    # while the first is generating, however fast or loaded the machine.
    with FaultProxy(vllm_server.base_url, hold_after=2) as proxy:
        first = start_generation_worker(generation_fields(vllm_server, proxy), "ephemeral")
        wait_for(lambda: journal_rows(data_dir) >= 2 and proxy.injected()["held"] >= 1, first, "the first run generating")
        second = materialise({"vllm_server": server_at(proxy.base_url, vllm_server.served_model_name)}, assets=[raw_responses], raise_on_error=False)
        first_still_running, durable_at_second = first.poll() is None, journal_rows(data_dir)
        canaries_before_release = proxy.counts()[CANARY_ID]
        proxy.release()
        output, _ = first.communicate(timeout=300)
        counts = proxy.counts()

    assert first.returncode == 0, output.decode()[-3000:]
    first_run_id = output.decode().split("RUN_ID ")[1].split()[0]
    assert not second.success
    (message,) = failure_messages(second)
    assert f"{SHARD} of raw_responses is being written by run {first_run_id} on host" in message and "wait for it or cancel" in message
    assert first_still_running and durable_at_second == 2, "the second run ran while the first was held mid-shard"
    assert canaries_before_release == 1, "the second run sent nothing, not even its canary: it stopped at the shard's lease"
    assert {i: counts[i] for i in expected} == {i: 1 for i in expected}, "each prompt was sent once, by the first run"
    rows = pl.read_parquet(data_dir / "raw_responses" / f"{SHARD}.parquet")
    assert sorted(rows["id"].to_list()) == sorted(expected)


@pytest.mark.vllm
def test_truncated_shard_files_are_named_downstream_and_their_writer_quarantines_and_rebuilds_them(vllm_server, tiny_target, data_dir):
    from eagle3_assets.defs.prompts import prompts
    from eagle3_assets.defs.raw_responses import raw_responses
    from eagle3_assets.defs.validated_traces import validated_traces
    from resources.target_model import TargetModel
    from tests.fault_proxy import FaultProxy
    from tests.test_generation import demo_prompts, server_at

    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])

    def run(assets, resources):
        resources = {"target_model": TargetModel(path=str(tiny_target)), **resources}
        result = materialize(assets, partition_key=SHARD, resources=resources, instance=instance, raise_on_error=False)
        return result, run_logs(instance, result.run_id)

    prompts_file = data_dir / "prompts" / f"{SHARD}.parquet"
    raw_file = data_dir / "raw_responses" / f"{SHARD}.parquet"
    with FaultProxy(vllm_server.base_url) as proxy:
        generation = {"vllm_server": server_at(proxy.base_url, vllm_server.served_model_name), "prompt_dataset": demo_prompts(16)}
        assert run([prompts, raw_responses], generation)[0].success
        expected = pl.read_parquet(prompts_file)["id"].to_list()
        good_raw = raw_file.read_bytes()

        # A finished raw_responses file cut short: validation names it, the shard and the fix.
        raw_file.write_bytes(good_raw[: len(good_raw) // 2])
        validation, _ = run([validated_traces], {"target_model": TargetModel(path=str(tiny_target))})
        (message,) = failure_messages(validation)
        assert f"raw_responses {SHARD}: {raw_file} is truncated or corrupt" in message
        assert f"rerun raw_responses for {SHARD}: the file will be quarantined and rebuilt" in message

        # Its writer, rerun, moves it aside and rebuilds it; only what the damaged file alone held is sent again.
        before = proxy.counts()
        rebuilt, logs = run([raw_responses], generation)
        assert rebuilt.success
        (aside,) = raw_file.parent.glob(f"{raw_file.name}.corrupt-*")
        assert aside.read_bytes() == good_raw[: len(good_raw) // 2], "the damaged file is kept as it was"
        assert any(f"quarantined {raw_file} as {aside.name}" in line for line in logs)
        rows = pl.read_parquet(raw_file)
        assert sorted(rows["id"].to_list()) == sorted(expected) and rows["id"].n_unique() == len(expected)
        after = proxy.counts()
        assert {i: after[i] - before[i] for i in expected} == {i: 1 for i in expected}  # the journal was gone: all re-sent once

        # A damaged prompts file: generation names it; rerunning prompts rebuilds it; generation then sends nothing.
        good_prompts = prompts_file.read_bytes()
        prompts_file.write_bytes(good_prompts[:-200])
        failed, _ = run([raw_responses], generation)
        (message,) = failure_messages(failed)
        assert f"prompts {SHARD}: {prompts_file} is truncated or corrupt" in message and f"rerun prompts for {SHARD}" in message
        rebuilt_prompts, logs = run([prompts], generation)
        assert rebuilt_prompts.success and any("quarantined" in line and prompts_file.name in line for line in logs)
        assert len(list(prompts_file.parent.glob(f"{prompts_file.name}.corrupt-*"))) == 1
        before = proxy.counts()
        resumed, _ = run([raw_responses], generation)
        assert resumed.success and {i: proxy.counts()[i] for i in expected} == {i: before[i] for i in expected}
    assert run([validated_traces], {"target_model": TargetModel(path=str(tiny_target))})[0].success


@pytest.mark.vllm
def test_a_killed_run_in_the_local_instance_is_marked_failed_and_frees_its_pool_slot(vllm_server, data_dir, tmp_path):
    from eagle3_assets.glue.local_runs import fail_dead_runs
    from eagle3_assets.defs.prompts import prompts
    from eagle3_assets.defs.raw_responses import raw_responses
    from resources.vllm_server import GENERATION_POOL, ensure_generation_pool_limit
    from tests.dagster_dev import write_instance_yaml
    from tests.fault_proxy import FaultProxy
    from tests.test_generation import demo_prompts, server_at

    home = tmp_path / "dagster_home"
    write_instance_yaml(home)  # deploy/dagster-dev.yaml, what `make demo` and `make dev` run on
    instance = DagsterInstance.from_config(str(home))
    assert ensure_generation_pool_limit(instance) == 1
    register_shards(instance, [SHARD])
    assert materialize([prompts], partition_key=SHARD, resources={"prompt_dataset": demo_prompts(24)}, instance=instance).success

    def killed_run() -> str:
        """A run killed mid-shard: the proxy answers 4 samples and holds the next ones until the test has killed it."""
        already = journal_rows(data_dir)
        with FaultProxy(vllm_server.base_url, hold_after=4) as proxy:
            fields = generation_fields(vllm_server, proxy)
            worker = start_generation_worker(fields, "home", env={"DAGSTER_HOME": str(home)})
            # A worker journals its row before it sends its next request: all of them held, the 4 answered rows are written.
            wait_for(lambda: proxy.injected()["held"] == fields["concurrency"], worker, "the run generating, its next requests held")
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
            worker.stdout.close()
        assert journal_rows(data_dir) == already + 4, "the killed run journaled exactly the 4 rows answered before the hold"
        (run,) = [r for r in instance.get_runs() if r.status.value == "STARTED"]
        # Pools are per run (deploy/dagster-dev.yaml): the dead run holds the pool's place by being STARTED
        # (the queue counts it), not by a claimed op slot; marking it failed is what gives the place back.
        assert GENERATION_POOL in run.run_op_concurrency.all_pools
        assert not instance.event_log_storage.get_concurrency_info(GENERATION_POOL).active_slot_count
        return run.run_id

    with FaultProxy(vllm_server.base_url) as proxy:
        # The daemon of `make dev`: run monitoring with the local launcher marks it failed and frees the slot.
        run_id = killed_run()
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"], cwd=REPO,
            env={**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO)},
            stdout=open(tmp_path / "daemon.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while instance.get_run_by_id(run_id).status.value != "FAILURE":
                assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()[-3000:]
                time.sleep(1)
        finally:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(30)
        failures = instance.get_records_for_run(run_id, of_type=DagsterEventType.RUN_FAILURE).records
        assert any("is gone" in record.event_log_entry.dagster_event.message for record in failures)

        # `make demo` has no daemon: it makes the same check before it starts.
        run_id = killed_run()
        lines: list[str] = []
        assert fail_dead_runs(instance, log=lines.append) == [run_id]
        assert instance.get_run_by_id(run_id).status.value == "FAILURE"
        assert any(run_id in line and "marked failed" in line for line in lines)

        # The next run gets the slot at once and resumes the shard.
        durable = journal_rows(data_dir)
        result = materialize(
            [raw_responses], partition_key=SHARD, instance=instance,
            resources={"vllm_server": server_at(proxy.base_url, vllm_server.served_model_name, concurrency=4), "target_model": DemoTargetModel()},
        )  # fmt: skip
    assert result.success
    (mat,) = result.asset_materializations_for_node("raw_responses")
    assert durable == 8 and mat.metadata["reused_rows"].value == durable, "every row the two killed runs journaled is reused"
