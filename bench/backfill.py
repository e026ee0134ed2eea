"""Benchmark of orchestration: what a shard run costs beyond its work, and launching a 1,000-shard backfill.

P6: orchestration overhead of one shard run with no work to speak of: ``prompts``
    for an existing demo shard (read 64 rows, write two small Parquet files).
    The asset body's own time is measured by calling the asset directly (no
    run); the overhead is a run's wall time minus that. Two kinds of run:
    (a) in process, ``materialize`` against an instance on disk (what
        ``make demo`` does per shard);
    (b) launched as the UI launches it: GraphQL ``launchRun`` to a real
        ``dagster dev`` (on deploy/dagster-dev.yaml), queued, dequeued by the
        daemon, executed by a run worker process; from the launch until the instance records
        RUN_SUCCESS, with the time split into queue, worker start, step and
        teardown.
    Target: overhead <= 3 s.
P7: launching a backfill of 1,000 shards: 1,000 dynamic partitions registered,
    then ``python -m eagle3_assets.backfill --all`` against a real webserver
    (no daemon, so nothing runs): from the command's start until the backfill
    is recorded in the instance. Target <= 60 s.

Prints every figure and its ratio to the target. Usage:
``.venv/bin/python bench/backfill.py [--runs 3] [--shards 1000]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))

P6_TARGET_S = 3.0
P7_TARGET_S = 60.0
SHARD_SIZE = 64
SHARD = "shard-00000"
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}  # the run's own log lines are not the figures

_REPOSITORIES = "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }"
_LAUNCH_RUN = """
mutation LaunchRun($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}"""


def body_time_s(instance, dataset, runs: int) -> float:
    """The asset body alone: ``prompts`` invoked directly, no run, median of ``runs``."""
    from dagster import build_asset_context

    from eagle3_assets.defs.prompts import prompts

    times = []
    logging.disable(logging.INFO)  # the asset's own log lines are not the figures
    for _ in range(runs + 1):  # the first call warms the imports and caches
        started = time.perf_counter()
        list(prompts(build_asset_context(partition_key=SHARD, instance=instance), prompt_dataset=dataset))  # a generator: run it through
        times.append(time.perf_counter() - started)
    logging.disable(logging.NOTSET)
    return statistics.median(times[1:])


def in_process_run_s(instance, dataset, runs: int) -> float:
    from dagster import materialize

    from eagle3_assets.defs.prompts import prompts

    times = []
    for _ in range(runs + 1):
        started = time.perf_counter()
        result = materialize([prompts], partition_key=SHARD, resources={"prompt_dataset": dataset}, instance=instance, run_config=QUIET)
        times.append(time.perf_counter() - started)
        assert result.success
    return statistics.median(times[1:])


def launched_run(dev, instance, run_config: dict) -> dict[str, float]:
    """One ``prompts`` run for the shard through the webserver, as the UI's "Launch 1 run" sends it."""
    repo = dev.graphql(_REPOSITORIES)["repositoriesOrError"]["nodes"][0]
    params = {
        "selector": {
            "repositoryLocationName": repo["location"]["name"], "repositoryName": repo["name"],
            "jobName": "__ASSET_JOB", "assetSelection": [{"path": ["prompts"]}],
        },
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": SHARD}]},
        "runConfigData": run_config,
    }  # fmt: skip
    started = time.time()
    result = dev.graphql(_LAUNCH_RUN, {"params": params})["launchRun"]
    assert result["__typename"] == "LaunchRunSuccess", result
    run_id = result["run"]["runId"]
    while True:
        record = instance.get_run_record_by_id(run_id)
        if record and record.dagster_run.is_finished:
            break
        time.sleep(0.1)
    assert record.dagster_run.is_success, f"run {run_id}: {record.dagster_run.status}\n{dev.log_tail()}"
    first: dict[str, float] = {}
    for event in instance.all_logs(run_id):
        if event.is_dagster_event:
            first.setdefault(event.dagster_event.event_type.name, event.timestamp)
    return {
        "end_to_end": first["RUN_SUCCESS"] - started,
        "queued": first["RUN_STARTING"] - started,  # until the daemon's queue loop launches it
        "worker_start": first["RUN_START"] - first["RUN_STARTING"],  # a run worker process loads the code
        "step_start": first["STEP_START"] - first["RUN_START"],  # a multiprocess executor's step process would load it again
        "step": first["STEP_SUCCESS"] - first["STEP_START"],
        "teardown": first["RUN_SUCCESS"] - first["STEP_SUCCESS"],
    }


def p6(root: Path, runs: int) -> None:
    from dagster import DagsterInstance

    from eagle3_assets.glue.partitions import register_shards
    from resources.prompt_dataset import PromptDataset
    from tests.dagster_dev import DagsterDev

    dataset = PromptDataset(source="demo", shard_size=SHARD_SIZE)
    env = {"EAGLE3_DATA_DIR": os.environ["EAGLE3_DATA_DIR"], "EAGLE3_PROMPTS": "demo", "EAGLE3_SHARD_SIZE": str(SHARD_SIZE)}
    with DagsterDev(root / "p6_home", env, root / "p6-dagster-dev.log", daemon_tick_s=None) as dev:  # Dagster as it runs
        instance = DagsterInstance.from_config(str(dev.home))
        register_shards(instance, dataset.shard_keys())
        body = body_time_s(instance, dataset, runs=5)
        in_process = in_process_run_s(instance, dataset, runs)
        # The project's executor is in-process (definitions.py): the step runs in the run worker.
        launched = {"in-process executor (the project's)": [launched_run(dev, instance, {}) for _ in range(runs)]}

    print(f"P6: `prompts` for {SHARD} ({SHARD_SIZE} rows), medians of {runs} runs; asset body alone: {body:.3f} s")
    overhead = in_process - body
    print(f"  (a) in-process run (materialize, instance on disk): {in_process:.2f} s; overhead {overhead:.2f} s = {overhead / P6_TARGET_S:.2f} x the {P6_TARGET_S:.0f} s target")
    for label, timings in launched.items():

        def med(key: str) -> float:
            return statistics.median(t[key] for t in timings)

        overhead = med("end_to_end") - body
        print(
            f"  (b) launched run, {label}: {med('end_to_end'):.2f} s from GraphQL launchRun to RUN_SUCCESS "
            f"= queued {med('queued'):.2f} + run worker start {med('worker_start'):.2f} + step start {med('step_start'):.2f} "
            f"+ step {med('step'):.2f} + teardown {med('teardown'):.2f}; "
            f"overhead {overhead:.2f} s = {overhead / P6_TARGET_S:.2f} x the {P6_TARGET_S:.0f} s target"
        )
        print(f"      each run: {', '.join(format(t['end_to_end'], '.1f') for t in timings)} s")


def p7(root: Path, shards: int) -> None:
    from dagster import DagsterInstance

    from eagle3_assets.core.orchestration.backfill_client import PER_SHARD_ASSETS
    from eagle3_assets.definitions import defs
    from eagle3_assets.glue.partitions import register_shards
    from tests.dagster_dev import DagsterDev

    env = {"EAGLE3_DATA_DIR": os.environ["EAGLE3_DATA_DIR"], "EAGLE3_PROMPTS": "demo"}
    # The webserver alone: the backfill is recorded, and no daemon starts 1,000 runs of shards the demo does not have.
    with DagsterDev(root / "p7_home", env, root / "p7-webserver.log", daemon=False) as dev:
        instance = DagsterInstance.from_config(str(dev.home))
        keys = [f"shard-{i:05d}" for i in range(shards)]
        started = time.perf_counter()
        register_shards(instance, keys)
        registered_s = time.perf_counter() - started

        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "eagle3_assets.backfill", "--url", dev.url, "--all"], cwd=REPO, capture_output=True, text=True, timeout=600
        )
        command_s = time.perf_counter() - started
        assert done.returncode == 0, done.stdout + done.stderr
        backfill_id = done.stdout.split("launched backfill ", 1)[1].split(":", 1)[0]
        backfill = instance.get_backfill(backfill_id)
        target = backfill.get_asset_backfill_data(defs.resolve_asset_graph()).target_subset
        sizes = {k.to_user_string(): len(s) for k, s in target.partitions_subsets_by_asset_key.items()}
        assert sizes == {a: shards for a in PER_SHARD_ASSETS}, sizes

        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import eagle3_assets.backfill"], cwd=REPO, check=True)
        startup_s = time.perf_counter() - started

    print(f"P7: backfill of {shards:,} shards x {len(PER_SHARD_ASSETS)} assets, launched with `python -m eagle3_assets.backfill --all`")
    print(f"  registering {shards:,} dynamic partitions: {registered_s:.2f} s (not counted)")
    print(
        f"  command until the backfill is recorded: {command_s:.2f} s (of which Python start + imports {startup_s:.2f} s) "
        f"= {command_s / P7_TARGET_S:.3f} x the {P7_TARGET_S:.0f} s target; recorded {sum(sizes.values()):,} asset partitions"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per P6 measurement (medians)")
    parser.add_argument("--shards", type=int, default=1000, help="shards in the P7 backfill")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-backfill-") as tmp:
        root = Path(tmp)
        os.environ["EAGLE3_DATA_DIR"] = str(root / "data")
        print(f"machine: {os.cpu_count()} CPU cores; dagster dev logs under {root} (removed at exit)", flush=True)
        p6(root, args.runs)
        p7(root, args.shards)
    return 0


if __name__ == "__main__":
    sys.exit(main())
