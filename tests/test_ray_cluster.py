"""The GPU host as a Ray cluster (issue #43): stages as Ray jobs, extraction over the nodes, a lost node, the refusals.

Against a real local Ray cluster (tests/ray_cluster.py): a head and a worker
started by ``ray start`` as separate nodes on this machine, each in a session
of its own, so that the worker is lost the way a machine is (SIGKILL to every
process of it). Real Dagster, the real stages on the real tiny target.

Engine builds are counted from outside the product, as for one host
(tests/test_extraction_runs.py): the test's own wrap of the engine constructor
records each call in whichever process makes it, here the engines' actors on
both nodes (the wrap reaches them through the jobs' ``runtime_env``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
from dagster import DagsterInstance, RunConfig, materialize

from eagle3_assets.core.extraction.shard_record import engine_builds
from eagle3_assets.core.storage.shard_lease import lease_path
from eagle3_assets.glue.partitions import register_shards
from tests.hold_point import SITE, CallRecord, HoldPoint
from tests.test_extraction_runs import ENGINE_CONSTRUCTORS, assert_each_shard_is_its_own, latest_materialization, range_tags, shard_keys, write_shards

REPO = Path(__file__).resolve().parents[1]
CONSTRUCTOR = ENGINE_CONSTRUCTORS["transformers"][0]


def ray_host(cluster, env_vars: dict[str, str] | None = None, **fields):
    """The GPU host on ``cluster``; ``env_vars`` reach the stage jobs and every actor and task they start."""
    from resources.gpu_host import GPUHost

    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(SITE), str(REPO)]), **(env_vars or {})}}
    return GPUHost(mode="ray", ray_address=cluster.dashboard, ray_runtime_env=json.dumps(runtime_env), **fields)


def shards_to_extract(data_dir: Path, tiny_target: Path, count: int) -> tuple[list[str], DagsterInstance]:
    """``count`` shards of validated traces (2 each) on disk, registered in a fresh instance."""
    keys = shard_keys(count)
    write_shards(data_dir, tiny_target, keys, per_shard=2)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, keys)
    return keys, instance


def extract(instance, tiny_target: Path, keys: list[str], host):
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
    from resources.target_model import TargetModel

    return materialize(
        [hidden_states], instance=instance, tags=range_tags(keys), raise_on_error=False,
        resources={"target_model": TargetModel(path=str(tiny_target)), "gpu_host": host},
        run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(cpu_threads=1, dtype="float32")}),
    )  # fmt: skip


def test_an_address_that_does_not_answer_is_refused_naming_the_setting(data_dir, tiny_target, monkeypatch):
    """Fails on: the client's ConnectionError let through (the step fails on a traceback, not the pre-flight's line)."""
    from resources.gpu_host import GPUHost, gpu_host_from_env
    from tests.ray_cluster import free_port

    monkeypatch.setenv("EAGLE3_GPU_HOST", "ray")
    monkeypatch.setenv("EAGLE3_RAY_ADDRESS", f"http://127.0.0.1:{free_port()}")
    host = gpu_host_from_env()
    assert (host.mode, host.ray_address) == ("ray", os.environ["EAGLE3_RAY_ADDRESS"])
    keys, instance = shards_to_extract(data_dir, tiny_target, 1)
    result = extract(instance, tiny_target, keys, host)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error.message
    assert f"Ray cluster {host.ray_address} did not answer" in failure and "EAGLE3_RAY_ADDRESS" in failure, failure
    assert not (data_dir / "hidden_states" / keys[0]).exists()
    assert isinstance(host, GPUHost)


@pytest.mark.ray
def test_extraction_spreads_over_both_nodes_and_a_lost_node_costs_one_rerun_of_its_shard(ray_cluster, data_dir, tiny_target, tmp_path):
    """Two engines (one per node), each built once; the worker lost while it holds a shard; one rerun finishes.

    Fails on: shards handed out in fixed halves instead of as engines free up
    (the head's engine then waits on the lost one's share: "the head's engine
    took 3 of 6"); the lost shard handed to another engine in the same run
    (it is then materialised by the first run); the driver not ending the lost
    shard's lease (``lapse`` removed from ray_engines.py: the lease is still
    there after the run); an engine built per shard (more than 2 constructor
    calls).
    """
    ray_cluster.ensure_worker()
    keys, instance = shards_to_extract(data_dir, tiny_target, 6)
    built = CallRecord(tmp_path / "engines.jsonl", CONSTRUCTOR)
    lost_key = keys[1]  # handed to the second engine, the worker's: the head runs the driver and gets the first
    with HoldPoint("eagle3_assets.core.extraction.shard_extraction:extract_shard", when="before", matching=lost_key) as hold:
        host = ray_host(ray_cluster, {**built.settings, **hold.settings})
        outcome: dict = {}
        run = threading.Thread(target=lambda: outcome.update(result=extract(instance, tiny_target, keys, host)))
        run.start()
        pid = hold.wait(still_going=run.is_alive, what=f"the engine extracting {lost_key}")
        assert ray_cluster.session_of(pid) == ray_cluster.worker_sid, "the held engine is the worker node's"
        lease = lease_path(data_dir / "hidden_states", lost_key)
        assert json.loads(lease.read_text())["pid"] == pid, "the lost engine held the shard's lease"
        ray_cluster.kill_worker()  # the node lost: its raylet, its actor, everything of it
        run.join(timeout=600)
    first = outcome["result"]
    assert not first.success, "a shard was lost: the run says so"
    messages = [e.user_message for e in instance.all_logs(first.run_id)]
    assert any("was lost while it extracted this shard" in m and lost_key in m for m in messages), messages[-20:]
    done = [k for k in keys if latest_materialization(instance, k) is not None]
    assert done == [k for k in keys if k != lost_key], "every other shard finished on the head's engine"
    assert not lease.exists(), "the lost shard's lease ended with the node: the rerun need not wait for it to go stale"

    calls = built.calls(CONSTRUCTOR)
    assert len(calls) == 2 and len({c["pid"] for c in calls}) == 2, calls  # one engine per node, built once each
    by_engine: dict[str, int] = {}
    for key in done:
        engine = latest_materialization(instance, key).metadata["engine_build"].value["id"]
        by_engine[engine] = by_engine.get(engine, 0) + 1
    assert sorted(by_engine.values()) == [5], f"the head's engine took {by_engine} of {len(keys)}: shards go to whichever engine is free"

    # One rerun, on what is left of the cluster (the head): only the lost shard is extracted, by one new engine.
    rerun = extract(instance, tiny_target, keys, ray_host(ray_cluster, built.settings))
    assert rerun.success, [e.message for e in rerun.all_events if e.is_failure]
    assert len(built.calls(CONSTRUCTOR)) == 3, "the rerun built one engine"
    reported = {m.partition: m for m in rerun.asset_materializations_for_node("hidden_states")}
    assert [k for k in keys if not reported[k].metadata["reused"].value] == [lost_key]
    assert_each_shard_is_its_own(instance, data_dir, keys)
    builds = engine_builds(data_dir / "hidden_states")
    assert len(builds) == 3 and builds[-1]["shards"] == [lost_key]
    ray_cluster.ensure_worker()


@pytest.mark.ray
def test_training_over_two_nodes_ends_with_the_single_process_weights(ray_cluster, tiny_target, tmp_path, monkeypatch):
    """DDP over the head and the worker (torchrun on each, one rank per node) against one process with the same batches.

    One process accumulating 2 micro-batches per step sees what 2 ranks see together, so the weights agree within
    float tolerance (the all-reduce sums in another order). The placement is the real pre-flight's, and the ranks'
    nodes are told by the test's own record of the node tasks' calls (their sessions).

    Fails on: the ranks' node rank passed as 0 on every node (torchrun then waits for a rank 1 that never comes:
    the run times out), both tasks placed on one node (the recorded sessions are one), the queue not drained
    (no event reaches ``on_event``).
    """
    import ray
    import torch

    from eagle3_assets.core.training.launch import run_training
    from eagle3_assets.core.training.ray_launch import run_training_on_cluster
    from tests.demo_hidden_states import cached_demo_hidden_states
    from tests.test_training import final_weights, small_config

    ray_cluster.ensure_worker()
    states = cached_demo_hidden_states(tiny_target, shards=2, count=24)
    single = small_config(states, tiny_target, tmp_path / "one", epochs=2, grad_accumulation=2, torch_threads=1)
    expected = final_weights(run_training(single, nproc=1))

    report = ray_host(ray_cluster).preflight("train_draft")
    assert report["ok"], report["failures"]
    assert len(report["ray"]["placement"]["nodes"]) == 2
    monkeypatch.setenv("EAGLE3_RAY_PLACEMENT", json.dumps(report["ray"]["placement"]))
    node_task, loop = "eagle3_assets.core.training.ray_launch:_node_rank", "eagle3_assets.core.training.loop:train"
    calls = CallRecord(tmp_path / "calls.jsonl", node_task, loop)
    two = small_config(states, tiny_target, tmp_path / "two", epochs=2, grad_accumulation=1, torch_threads=1)
    events: list[dict] = []
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(SITE), str(REPO)]), **calls.settings}}
    ray.init(address=ray_cluster.gcs_address, runtime_env=runtime_env, log_to_driver=False)
    try:
        result = run_training_on_cluster(two, nproc=1, nnodes=2, on_event=events.append)
    finally:
        ray.shutdown()
    assert result["world_size"] == 2
    # Each node's task ran in that node's session (torchrun puts its ranks in sessions of their own), and 2 ranks trained.
    assert sorted(c["sid"] for c in calls.calls(node_task)) == sorted([ray_cluster.head_sid, ray_cluster.worker_sid]), "one task on each node"
    assert len({c["pid"] for c in calls.calls(loop)}) == 2
    assert {e["rank"] for e in events if e.get("event") == "rank_done"} == {0, 1}, [e.get("event") for e in events]
    got = final_weights(result)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=f"{name}: two nodes against one process")


# -- refused before any work: each names what to change ----------------------------------------------


@pytest.mark.ray
def test_a_cluster_without_the_gpus_the_stage_needs_is_refused_naming_each_node(ray_cluster, data_dir, tiny_target, tmp_path):
    """Fails on: a node without GPUs kept as fit when CPU is not allowed (the run starts engines, and the constructor
    record is not empty)."""
    ray_cluster.ensure_worker()
    keys, instance = shards_to_extract(data_dir, tiny_target, 1)
    built = CallRecord(tmp_path / "engines.jsonl", CONSTRUCTOR)
    result = extract(instance, tiny_target, keys, ray_host(ray_cluster, built.settings, allow_cpu=False))
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error.message
    assert "no node can run stage extract_hidden_states" in failure and "add nodes with the GPUs it needs" in failure, failure
    assert failure.count("does not allow CPU") == 2, "each node named with why it does not fit"
    assert built.calls() == [] and not (data_dir / "hidden_states" / keys[0]).exists()


@pytest.mark.ray
def test_a_node_running_other_code_is_refused_naming_the_node_and_the_files(ray_cluster, tmp_path):
    """A third node whose Python finds another copy of the package (one comment added to a stage's file).

    Fails on: the per-node code check dropped (``code_version_problem`` not called in ``node_checks``): the
    pre-flight passes with the node among the engines.
    """
    other = tmp_path / "other-checkout"
    shutil.copytree(REPO / "eagle3_assets", other / "eagle3_assets", ignore=shutil.ignore_patterns("__pycache__"))
    changed = other / "eagle3_assets" / "stages" / "extract_hidden_states.py"
    changed.write_text(changed.read_text() + "\n# a fix made on that node by hand\n")
    sid = ray_cluster.add_worker(env={**ray_cluster.env, "PYTHONPATH": str(other)}, resource="other_code_node")
    try:
        from resources.gpu_host import GPUHost

        report = GPUHost(mode="ray", ray_address=ray_cluster.dashboard).preflight("host_probe")
    finally:
        ray_cluster.kill_node(sid)
    assert not report["ok"]
    lines = [line for line in report["failures"] if "code:" in line]
    assert len(lines) == 1 and str(other / "eagle3_assets") in lines[0] and "stages/extract_hidden_states.py" in lines[0], report["failures"]
    assert "deploy the orchestrator's checkout" in lines[0]


@pytest.mark.ray
def test_cancelling_the_run_stops_the_ray_job_and_the_stage(ray_cluster, data_dir, tmp_path):
    """A terminated run (SIGINT to the run's process, what Dagster's run launcher sends) stops the Ray job: the runner
    and the stage's process group on the cluster go, the lock is free, the job ends STOPPED.

    Fails on: ``forward_termination=False`` in resources/ray_jobs.py (the job runs on: its stage survives), and on the
    runner's SIGTERM handler removed (Ray's signal then ends the runner, the stage lives on in its own session until
    its PDEATHSIG; with the stop wait raised to the grace, the stage is still alive when the test looks).
    """
    import subprocess
    import sys
    import time

    from ray.job_submission import JobStatus, JobSubmissionClient

    from eagle3_assets.core.gpu_host.preflight import lock_holder
    from tests.test_gpu_host import CANCELLED_RUN_SOURCE, assert_cancelled_stage_gone, wait_until_holding

    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    host = ray_host(ray_cluster, data_dir=str(data_dir), termination_grace_s=6.0)
    run = subprocess.Popen(
        [sys.executable, "-c", CANCELLED_RUN_SOURCE, json.dumps(host.model_dump())],
        cwd=REPO, env={**os.environ, "DAGSTER_HOME": str(dagster_home)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    lock = Path(host.host_lock_dir()) / "host_probe.lock"
    instance = DagsterInstance.from_config(str(dagster_home))
    wait_until_holding(run, instance, time.monotonic() + 120)
    holder = lock_holder(str(lock))
    stage_pid, runner_pid = holder["stage_pid"], holder["pid"]
    run.send_signal(signal.SIGINT)
    output = run.communicate(timeout=120)[0].decode()
    assert_cancelled_stage_gone(stage_pid, runner_pid, lock, data_dir / "host_probe" / "probe.json", output, wait_s=30)
    jobs = [j for j in JobSubmissionClient(ray_cluster.dashboard).list_jobs() if (j.submission_id or "").startswith("eagle3-host-probe-")]
    assert jobs and all(j.status == JobStatus.STOPPED for j in jobs if j.entrypoint and "--ray-job" in j.entrypoint), [(j.submission_id, j.status) for j in jobs]
    instance.dispose()
