"""Issue #43's figures on a real local Ray cluster: extraction over 1 and 2 nodes, a lost node's cost, two-node DDP.

The cluster is the tests' (tests/ray_cluster.py): a head and a worker started
by ``ray start`` as separate nodes on this machine, one CPU each. Every run is
the product's own: ``hidden_states`` materialised through ``GPUHost(mode="ray")``
(pre-flight job, stage job, one engine actor per node), the training loop over
Ray's rendezvous. Prints, each measured here:

- extraction of the same shards with 1 engine (``ray_engines=1``) and with 2
  (one per node): wall time of the run and shards per engine. Both nodes share
  this machine's 2 cores, so the ratio is not a speed-up a cluster would see;
  the shards per engine say how the work was spread;
- the worker killed while it holds a shard: shards the first run finished,
  shards the rerun redid, the rerun's wall time;
- DDP over the two nodes (one rank each) against one process with the same
  batches: the largest weight difference, and both wall times.

    .venv/bin/python bench/ray_cluster.py [--shards 8] [--per-shard 4]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))


def fresh_data_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    os.environ["EAGLE3_DATA_DIR"] = str(path)
    return path


def wait_for_quiet(stage: str, timeout_s: float = 1800) -> None:
    """Until no other process of ``stage`` runs on this machine: its pre-flight refuses the stage while one does
    (another engineer's tests on a shared machine)."""
    from eagle3_assets.core.gpu_host.preflight import stray_stage_processes

    deadline = time.monotonic() + timeout_s
    while stray_stage_processes(stage) and time.monotonic() < deadline:
        time.sleep(2)


def refused_for_another_run(result) -> bool:
    failures = [e.step_failure_data.error.message for e in result.all_events if e.is_step_failure]
    return any("still running outside the lock" in message for message in failures)


def extraction(cluster, target: Path, root: Path, name: str, shards: int, per_shard: int, engines: int, lose_worker: bool = False) -> dict:
    from dagster import DagsterInstance

    from eagle3_assets.glue.partitions import register_shards
    from tests.hold_point import HoldPoint
    from tests.test_extraction_runs import latest_materialization, shard_keys, write_shards
    from tests.test_ray_cluster import extract, ray_host

    data = fresh_data_dir(root, name)
    keys = shard_keys(shards)
    write_shards(data, target, keys, per_shard=per_shard)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, keys)
    wait_for_quiet("extract_hidden_states")
    started = time.monotonic()
    if not lose_worker:
        for _attempt in range(10):  # refused before any work when another engineer's stage started meanwhile: again
            result = extract(instance, target, keys, ray_host(cluster, ray_engines=engines))
            if result.success or not refused_for_another_run(result):
                break
            wait_for_quiet("extract_hidden_states")
            started = time.monotonic()
        first = {"success": result.success}
    else:
        # The worker lost while its engine holds the second shard (held there, then its node killed).
        with HoldPoint("eagle3_assets.core.extraction.shard_extraction:extract_shard", when="before", matching=keys[1]) as hold:
            outcome: dict = {}
            host = ray_host(cluster, hold.settings, ray_engines=engines)
            run = threading.Thread(target=lambda: outcome.update(result=extract(instance, target, keys, host)))
            run.start()
            hold.wait(still_going=run.is_alive, what="the worker's engine")
            cluster.kill_worker()
            run.join()
        first = {"success": outcome["result"].success}
    wall = time.monotonic() - started
    done = [k for k in keys if latest_materialization(instance, k) is not None]
    per_engine: dict[str, int] = {}
    for key in done:
        build = latest_materialization(instance, key).metadata["engine_build"].value["id"]
        per_engine[build] = per_engine.get(build, 0) + 1
    row = {**first, "wall_s": wall, "done": len(done), "shards": len(keys), "per_engine": sorted(per_engine.values(), reverse=True)}
    if lose_worker:
        wait_for_quiet("extract_hidden_states")
        started = time.monotonic()
        rerun = extract(instance, target, keys, ray_host(cluster))
        redone = [m.partition for m in rerun.asset_materializations_for_node("hidden_states") if not m.metadata["reused"].value]
        row.update(rerun_success=rerun.success, rerun_wall_s=time.monotonic() - started, redone=redone)
        cluster.ensure_worker()
    return row


def ddp(cluster, target: Path, root: Path) -> dict:
    import ray
    import torch

    from eagle3_assets.core.training.launch import run_training
    from eagle3_assets.core.training.ray_launch import run_training_on_cluster
    from tests.demo_hidden_states import cached_demo_hidden_states
    from tests.test_ray_cluster import ray_host
    from tests.test_training import final_weights, small_config

    states = cached_demo_hidden_states(target, shards=2, count=24)
    single = small_config(states, target, root / "ddp-one", epochs=2, grad_accumulation=2, torch_threads=1)
    started = time.monotonic()
    expected = final_weights(run_training(single, nproc=1))
    one_s = time.monotonic() - started
    wait_for_quiet("train_draft")
    report = ray_host(cluster).preflight("train_draft")
    assert report["ok"], report["failures"]
    os.environ["EAGLE3_RAY_PLACEMENT"] = json.dumps(report["ray"]["placement"])
    two = small_config(states, target, root / "ddp-two", epochs=2, grad_accumulation=1, torch_threads=1)
    ray.init(address=cluster.gcs_address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}, log_to_driver=False)
    try:
        started = time.monotonic()
        got = final_weights(run_training_on_cluster(two, nproc=1, nnodes=2, on_event=lambda event: None))
        two_s = time.monotonic() - started
    finally:
        ray.shutdown()
        del os.environ["EAGLE3_RAY_PLACEMENT"]
    floats = [n for n in expected if expected[n].is_floating_point()]
    worst = max(float((got[n] - expected[n]).abs().max()) for n in floats)
    scale = max(float(expected[n].abs().max()) for n in floats)
    assert all(torch.equal(got[n], expected[n]) for n in expected if n not in floats), "a non-float tensor differs"
    return {"one_process_s": one_s, "two_nodes_s": two_s, "max_abs_diff": worst, "max_abs_weight": scale, "tensors": len(expected), "equal_shapes": all(got[n].shape == expected[n].shape for n in expected), "dtype": str(expected[floats[0]].dtype), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=4)
    args = parser.parse_args()

    from eagle3_assets.demo.stack import tiny_target_dir
    from tests.ray_cluster import LocalRayCluster

    # A SIGTERM (a timeout, a kill) ends the bench through its finally: the cluster's nodes are not left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    target = tiny_target_dir()
    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    started = time.monotonic()
    cluster = LocalRayCluster().start()
    print(f"local Ray cluster (head + worker, 1 CPU each) started in {time.monotonic() - started:.1f} s")
    try:
        one = extraction(cluster, target, root, "one-engine", args.shards, args.per_shard, engines=1)
        two = extraction(cluster, target, root, "two-engines", args.shards, args.per_shard, engines=2)
        lost = extraction(cluster, target, root, "lost-node", args.shards, args.per_shard, engines=2, lose_worker=True)
        trained = ddp(cluster, target, root)
    finally:
        cluster.stop()
    print(f"\nextraction of {args.shards} shards x {args.per_shard} traces (tiny target, transformers backend):")
    print("| engines | run | wall s | shards per engine |\n| --- | --- | --- | --- |")
    for label, row in (("1 (head)", one), ("2 (head, worker)", two)):
        print(f"| {label} | {'ok' if row['success'] else 'FAILED'} | {row['wall_s']:.1f} | {row['per_engine']} |")
    print(f"wall time, 2 engines over 1: {two['wall_s'] / one['wall_s']:.2f} (both nodes share 2 cores: not a cluster's speed-up)")
    print(
        f"\nworker lost while it held a shard: first run {'ok' if lost['success'] else 'failed'} with {lost['done']}/{lost['shards']} shards "
        f"done ({lost['per_engine']} per engine), {lost['wall_s']:.1f} s; rerun {'ok' if lost['rerun_success'] else 'FAILED'} "
        f"redid {len(lost['redone'])} shard(s) {lost['redone']} in {lost['rerun_wall_s']:.1f} s"
    )
    print(
        f"\nDDP over 2 nodes (1 rank each) against 1 process with the same batches: largest weight difference "
        f"{trained['max_abs_diff']:.2e} (largest weight {trained['max_abs_weight']:.2e}, {trained['tensors']} tensors, the float ones {trained['dtype']}); "
        f"wall {trained['two_nodes_s']:.1f} s against {trained['one_process_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
