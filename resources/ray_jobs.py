"""The GPU host's stages as Ray jobs: the pre-flight job, and the stage job under Dagster Pipes (dagster-ray).

Used by :class:`resources.gpu_host.GPUHost` in mode ``ray``. Every stage is
two jobs submitted to the cluster's dashboard address (Ray's Job Submission
API, plain HTTP: the orchestrator needs the ``ray`` package, not a place in
the cluster):

1. the pre-flight, ``python -m eagle3_assets.core.gpu_host.ray_cluster <spec>``,
   whose last log line is the report;
2. the stage runner, ``python -m eagle3_assets.stages <stage> --ray-job``,
   run by dagster-ray's ``PipesRayJobClient``: the Pipes bootstrap and the
   stage's environment go in the job's ``runtime_env`` (so the job's actors
   and tasks on other nodes inherit them), and its messages come back by
   tailing the job's log. A terminated Dagster run stops the job; Ray then
   signals the runner, which stops the stage's process group as over SSH.

Why dagster-ray and not Ray's API alone: its client is Dagster's own Pipes
integration for Ray jobs (terminations, tags, log tailing), and 0.4.8 pins
``dagster>=1.12``, so it installs beside Dagster 1.13.27 (pyproject's ``ray``
extra). The message reader below only taps the messages on their way, for
the stage's part-way reports.

Nothing secret goes into a job: Ray's dashboard shows every job's
``runtime_env``. A gated target's token is the cluster's own environment
(docs/production.md, "Ray cluster").
"""

from __future__ import annotations

import json
import shlex
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

from dagster import PipesClientCompletedInvocation
from dagster._core.errors import DagsterPipesExecutionError

from eagle3_assets.core.cluster.placement import first_line

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
PREFLIGHT_MODULE = "eagle3_assets.core.gpu_host.ray_cluster"
LOG_TAIL_LINES = 40


class RayClusterError(RuntimeError):
    """The cluster did not answer, or a job could not be submitted or read; the message names the address."""


def _tapped_reader(on_message: Callable[[dict], None]):
    """dagster-ray's job-log reader, calling ``on_message`` with each Pipes message once Dagster has handled it."""
    from dagster_ray.core.pipes import PipesRayJobMessageReader

    class _Tap:
        def __init__(self, handler):
            self._handler = handler

        def handle_message(self, message) -> None:
            self._handler.handle_message(message)
            on_message(message)

        def __getattr__(self, name):
            return getattr(self._handler, name)

    class TappedRayJobMessageReader(PipesRayJobMessageReader):
        @contextmanager
        def read_messages(self, handler):
            with super().read_messages(_Tap(handler)) as params:
                yield params

    return TappedRayJobMessageReader()


class RayStageJobs:
    """Submit the pre-flight and the stages of one GPU host to the Ray cluster at ``address`` (its dashboard)."""

    def __init__(self, address: str, runtime_env: Mapping[str, Any] | None = None, python: str = "python", poll_interval_s: float = 0.5):
        self.address = address or DEFAULT_DASHBOARD
        self.runtime_env = dict(runtime_env or {})
        self.python = python
        self.poll_interval_s = poll_interval_s

    @property
    def label(self) -> str:
        return f"Ray cluster {self.address}"

    def client(self):
        from ray.job_submission import JobSubmissionClient

        try:
            return JobSubmissionClient(self.address)
        except Exception as exc:  # noqa: BLE001 - ConnectionError, a refused or timed-out HTTP call, a wrong scheme
            raise RayClusterError(
                f"{self.label} did not answer ({type(exc).__name__}: {first_line(exc)}): start the cluster, or set "
                "EAGLE3_RAY_ADDRESS (gpu_host.ray_address) to its dashboard address, e.g. http://<head>:8265"
            ) from None

    def job_runtime_env(self, env: Mapping[str, str]) -> dict[str, Any]:
        """The deployment's runtime_env with ``env`` added to its ``env_vars`` (the stage's own win)."""
        runtime_env = json.loads(json.dumps(self.runtime_env))  # a deep copy: dagster-ray adds to it
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **{k: str(v) for k, v in env.items()}}
        return runtime_env

    def preflight(self, spec: Mapping[str, Any], env: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
        """Run :mod:`eagle3_assets.core.gpu_host.ray_cluster` as a job; its report (raises :class:`RayClusterError`)."""
        client = self.client()
        entrypoint = shlex.join([self.python, "-m", PREFLIGHT_MODULE, json.dumps(spec)])
        try:
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=self.job_runtime_env(env), entrypoint_num_cpus=0)
        except Exception as exc:  # noqa: BLE001 - the dashboard refused the job (bad runtime_env, ...)
            raise RayClusterError(f"{self.label}: the pre-flight job was refused: {first_line(exc)}") from None
        deadline = time.monotonic() + timeout_s
        while not (status := client.get_job_status(job_id)).is_terminal():
            if time.monotonic() > deadline:
                client.stop_job(job_id)
                raise RayClusterError(f"{self.label}: the pre-flight job {job_id} did not finish within {timeout_s:.0f}s (stopped)")
            time.sleep(self.poll_interval_s)
        logs = client.get_job_logs(job_id)
        report = _last_report(logs)
        if report is None:
            raise RayClusterError(
                f"{self.label}: the pre-flight job {job_id} ended {status.value} without a report: {_tail(logs, 5) or 'no output'}"
            )
        report["ray_job_id"] = job_id
        return report

    def run_stage(
        self,
        context,
        stage: str,
        runner_args: list[str],
        env: Mapping[str, str],
        extras: Mapping[str, Any],
        on_message: Callable[[dict], None],
        metadata: dict[str, Any],
        stop_grace_s: float = 20.0,
    ) -> PipesClientCompletedInvocation:
        """Run the stage runner as a job under Pipes; its messages pass through ``on_message`` as they arrive.

        A terminated run stops the job: Ray signals the runner and everything under it, and SIGKILLs what is left
        after ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by default, read by the job's supervisor from the job's environment):
        set here to the runner's own grace and some, so that its ordered stop of the stage has the time it asks for.
        """
        from dagster_ray import PipesRayJobClient

        self.client()  # refuses an address that does not answer, before anything is submitted
        pipes = PipesRayJobClient(
            address=self.address, message_reader=_tapped_reader(on_message), poll_interval=self.poll_interval_s, forward_termination=True
        )
        job_id = f"eagle3-{stage.replace('_', '-')}-{uuid.uuid4().hex[:12]}"
        # On every result the stage reports, with the pre-flight's: which job to look up in Ray's dashboard.
        metadata["gpu_host/ray_job_id"] = job_id
        submission = {
            "submission_id": job_id,
            "entrypoint": shlex.join([self.python, "-m", *runner_args, "--ray-job"]),
            "runtime_env": self.job_runtime_env({**env, "RAY_JOB_STOP_WAIT_TIME_S": str(int(stop_grace_s) + 10)}),
            "entrypoint_num_cpus": 0,  # the runner waits; the engines and trainers it starts take the cluster's resources
        }
        try:
            completed = pipes.run(context=context, submit_job_params=submission, extras=dict(extras))
        except RuntimeError as exc:  # dagster-ray's "Ray job ... failed with status ..."
            tail = _tail(self.client().get_job_logs(job_id), LOG_TAIL_LINES)
            raise DagsterPipesExecutionError(f"stage {stage} on {self.label} failed: {first_line(exc)}\nlast output lines:\n{tail}") from None
        # The same invocation with the pre-flight's metadata on its results, as the local and SSH hosts give them
        # (Dagster has no public accessor for an invocation's session).
        return PipesClientCompletedInvocation(completed._session, metadata=metadata)


def _last_report(logs: str) -> dict[str, Any] | None:
    """The pre-flight's report: the last log line that is a JSON object with ``failures`` (Ray may log after it)."""
    for line in reversed((logs or "").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and "failures" in value:
                return value
    return None


def _tail(logs: str, lines: int) -> str:
    return "\n".join([line for line in (logs or "").splitlines() if line.strip()][-lines:])
