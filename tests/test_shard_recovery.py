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
from dagster import DagsterInstance, RunConfig, materialize

from eagle3_assets.core.extraction import SIDECAR, HiddenStateFileError, read_sidecar
from eagle3_assets.core.shard_lease import ShardBusyError, ShardLease, lease_path
from eagle3_assets.core.training import index_hidden_states, load_batch
from eagle3_assets.partitions import register_shards
from tests.extraction_helpers import write_validated_traces

REPO = Path(__file__).resolve().parents[1]
SHARD = "shard-00000"


def hidden_states_resources(tiny_target):
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    return {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()}


def hidden_states_config(**fields):
    from eagle3_assets.hidden_states import HiddenStatesConfig

    return RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1, **fields)})


def materialise_hidden_states(instance, tiny_target, **fields):
    from eagle3_assets.hidden_states import hidden_states

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
        "from eagle3_assets.core.shard_lease import ShardLease; from eagle3_assets.core.storage import atomic_path\n"
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
from dagster import DagsterInstance, RunConfig, materialize
from eagle3_assets.hidden_states import HiddenStatesConfig, hidden_states
from eagle3_assets.partitions import register_shards
from resources.gpu_host import GPUHost
from resources.target_model import TargetModel
instance = DagsterInstance.ephemeral()
register_shards(instance, [sys.argv[1]])
materialize([hidden_states], partition_key=sys.argv[1], instance=instance,
            resources={"target_model": TargetModel(path=sys.argv[2]), "gpu_host": GPUHost()},
            run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1, max_batch_size=1)}))
"""


def test_sigkill_mid_hidden_states_then_one_plain_rerun_completes_the_shard(data_dir, tiny_target):
    traces = write_validated_traces(data_dir, SHARD, tiny_target, count=48)
    shard = data_dir / "hidden_states" / SHARD
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, SHARD, str(tiny_target)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (list(shard.glob("*.partial")) and lease_path(shard.parent, SHARD).exists()):
            assert worker.poll() is None and time.monotonic() < deadline, "the stage never started writing"
            time.sleep(0.01)
        stage_pid = json.loads(lease_path(shard.parent, SHARD).read_text())["pid"]
        os.kill(stage_pid, signal.SIGKILL)  # the process writing the shard dies mid-part, as in an OOM kill
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(60)
    (partial,) = shard.glob("*.partial")
    assert not (shard / SIDECAR).exists()

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
