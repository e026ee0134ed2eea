"""The local instance notices dead runs, as the production one does: marked failed, pool slots freed.

Dagster's run monitoring (``run_monitoring`` in ``dagster.yaml``, done by the
daemon) asks the run launcher whether a STARTED run's worker still lives. The
``DefaultRunLauncher`` answers "cannot tell", so on the local instance a run
whose process was SIGKILLed (an OOM kill, a closed laptop lid, ``kill -9``)
stayed STARTED for ever and kept its ``vllm_generation`` slot: with the pool
limit of 1, the next run of any shard waited for ever.

:class:`LocalRunLauncher` is the default launcher plus that answer: the
process that executes a run records its pid in the run's ``RUN_START`` event;
the worker is alive while that pid runs and started before the event (a
recycled pid started later). ``deploy/dagster-dev.yaml`` names it and turns
monitoring on, so ``make dev``'s daemon marks a dead run failed and frees its
slots a few seconds later.

A script that runs the graph without a daemon (``materialize`` in its own
process) calls :func:`fail_dead_runs` before it starts, and so does ``make
dev``: the same decision, taken once.

Only runs of this host can be judged: the local instance (SQLite under
``$DAGSTER_HOME``) is one machine's. The production instance runs its workers
where its launcher can see them (deploy/dagster.yaml).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from dagster import DagsterEventType, DagsterInstance, DagsterRun, DagsterRunStatus, DefaultRunLauncher, RunsFilter
# The run launcher's health protocol has no public names (Dagster exports neither type).
from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus

from eagle3_assets.core.storage.shard_lease import process_start_ticks

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    with open("/proc/stat", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime")


def run_worker(instance: DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """(pid, time) of the process that started executing the run, from its RUN_START event; None before it starts."""
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.RUN_START, limit=1).records
    if not records:
        return None
    entry = records[0].event_log_entry
    pid = entry.dagster_event.pid if entry.dagster_event else None
    return (int(pid), float(entry.timestamp)) if pid else None


def run_worker_health(instance: DagsterInstance, run: DagsterRun) -> CheckRunHealthResult:
    worker = run_worker(instance, run.run_id)
    if worker is None:
        return CheckRunHealthResult(WorkerStatus.RUNNING, "not started yet")  # the start timeout covers a launch that never starts
    pid, started = worker
    ticks = process_start_ticks(pid)
    if ticks is None:
        return CheckRunHealthResult(WorkerStatus.FAILED, f"the run's process (pid {pid}) is gone", run_worker_id=str(pid))
    if _boot_time() + ticks / _CLOCK_TICKS > started + 2.0:  # 2 s: btime and ticks are coarse
        return CheckRunHealthResult(WorkerStatus.FAILED, f"the run's process (pid {pid}) is gone; pid {pid} is now another process")
    return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=str(pid))


class LocalRunLauncher(DefaultRunLauncher):
    """The default launcher, able to tell run monitoring whether a run's process still lives (see the module doc)."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        return run_worker_health(self._instance, run)


def fail_dead_runs(instance: DagsterInstance, log: Callable[[str], None] = print) -> list[str]:
    """Mark STARTED runs whose process is gone as failed and free every finished run's pool slots; the runs failed."""
    failed = []
    for run in instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.STARTED])):
        health = run_worker_health(instance, run)
        if health.status == WorkerStatus.FAILED:
            instance.report_run_failed(run, f"Run marked failed: {health.msg} (killed?); a rerun resumes from what is durable.")
            failed.append(run.run_id)
            log(f"run {run.run_id} ({run.job_name}): {health.msg}; marked failed")
    storage = instance.event_log_storage
    if storage.supports_global_concurrency_limits:
        holding = storage.get_concurrency_run_ids()
        if holding:
            for run in instance.get_runs(filters=RunsFilter(run_ids=list(holding))):
                if not run.is_finished:
                    continue
                storage.free_concurrency_slots_for_run(run.run_id)
                log(f"run {run.run_id} ({run.status.value}): freed its pool slots")
    return failed
