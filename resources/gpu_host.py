"""The GPU host: where GPU stages run, as separate processes speaking Dagster Pipes.

A stage is a module under ``eagle3_assets.stages`` run with the host's Python.
The host is this machine (``mode="local"``), another one reached over SSH
(``mode="ssh"``), or a Ray cluster (``mode="ray"``): there each stage is a Ray
job whose engines or trainers spread over the nodes that fit
(:mod:`resources.ray_jobs`, :mod:`eagle3_assets.core.gpu_host.ray_cluster`). Before every stage the pre-flight
(:mod:`eagle3_assets.core.gpu_host.preflight`) runs on the host; a failure stops the
step with one line per problem, and what was checked becomes metadata of the
materialisation. The stage is started by the stage runner (``python -m
eagle3_assets.stages <stage>``, see its docstring), which holds the stage lock
and forwards the stage's Pipes messages: its log lines, materialisation
metadata and check results arrive in the Dagster run while it runs.
Terminating the run stops the stage's whole process group on the host.

GPU assets share the pool :data:`GPU_POOL` (``@asset(pool=GPU_POOL)``), whose
limit is 1 unless configured otherwise: one GPU stage at a time per host.

Why one file of about 400 lines: it is one resource, and what is not its
methods (the Pipes reader, the exit reasons, the pre-flight report as metadata
and as one line) only says what :meth:`GPUHost.preflight` and
:meth:`GPUHost.run_stage` did.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dagster import (
    AssetExecutionContext,
    ConfigurableResource,
    DagsterInstance,
    EnvVar,
    Failure,
    MetadataValue,
    OpExecutionContext,
    PipesClientCompletedInvocation,
    PipesEnvContextInjector,
    PipesMessageReader,
    open_pipes_session,
)

# The error Dagster's own Pipes clients raise for a failed external process; Dagster does not export it.
from dagster._core.errors import DagsterPipesExecutionError
from pydantic import Field

from eagle3_assets.core.gpu_host import preflight as preflight_module
from eagle3_assets.core.cluster.placement import PLACEMENT_ENV
from eagle3_assets.core.gpu_host.preflight import STAGE_PACKAGE
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements, build_spec, validate_stage_name
from eagle3_assets.core.gpu_host.remote import HostConnection, HostError, SSHTarget, StageProcess
from eagle3_assets.core.settings import environment as env_vars
from eagle3_assets.core.storage.shard_paths import LOCKS_DIR, PARTIAL_SUFFIX, data_dir
from resources.pools import ensure_pool_limit
from resources.ray_jobs import RayClusterError, RayStageJobs

# The pool every GPU stage's asset joins: ``@asset(pool=GPU_POOL)``. One pool per GPU host;
# a deployment with two hosts gives the second one its own pool name (EAGLE3_GPU_POOL).
GPU_POOL = env_vars.GPU_POOL.get()
MODES = ("local", "ssh", "ray")
DATA_DIR_ENV = env_vars.DATA_DIR.name
HF_TOKEN_ENV = env_vars.HF_TOKEN.name  # what huggingface_hub reads; a gated target on the hub needs it on the GPU host

# What each GPU stage needs from the host. A stage's asset module declares its entry with
# ``register_stage(...)``; ``run_stage`` uses it when no requirements are passed, and the
# ``gpu_host_ready`` job checks every entry on its own.
STAGE_REQUIREMENTS: dict[str, StageRequirements] = {
    "host_probe": StageRequirements(modules=["polars"], cpu_allowed=True, min_gpus=0),
}


def register_stage(stage: str, requirements: StageRequirements) -> StageRequirements:
    """Declare what ``stage`` needs from the GPU host (checked before each run and by ``gpu_host_ready``)."""
    STAGE_REQUIREMENTS[validate_stage_name(stage)] = requirements
    return requirements


def ensure_gpu_pool_limit(instance: DagsterInstance, limit: int | None = None) -> int:
    """The GPU pool's limit (``$EAGLE3_GPU_POOL_LIMIT`` or 1: one GPU stage at a time on the host) unless one was
    set by hand; the limit in force. ``make dev`` calls this, and so does anything that runs the graph without it."""
    return ensure_pool_limit(instance, GPU_POOL, env_vars.GPU_POOL_LIMIT, limit)


class _RunnerStdoutMessageReader(PipesMessageReader):
    """Pipes messages come back on the stage runner's stdout, read line by line by :class:`StageProcess`.

    Nothing to set up here: the runner gives the stage its own message
    destination (a pipe it forwards to stdout), so over SSH the messages travel
    in the same connection as the command, while it runs.
    """

    @contextmanager
    def read_messages(self, handler):
        yield {"eagle3_runner": "stdout"}

    def no_messages_debug_text(self) -> str:
        return "Read Pipes messages from the stage runner's stdout (python -m eagle3_assets.stages)."

    @property
    def expected_writer_count(self) -> int:
        # One writer, the stage. (Overridden only to avoid the base property's preview warning.)
        return 1


class GPUHost(ConfigurableResource):
    """Runs GPU stages out of process: on this machine, or on a GPU host over SSH, after a pre-flight."""

    mode: str = Field(default="local", description="'local' (this machine), 'ssh' or 'ray' (a Ray cluster)")
    ssh_host: str = Field(default="", description="GPU host name or address (mode 'ssh')")
    ssh_port: int = Field(default=22, description="SSH port")
    ssh_user: str = Field(default="", description="SSH user; empty: ssh's default")
    ssh_identity_file: str = Field(default="", description="private key file on this machine; empty: ssh's default keys/agent")
    ssh_known_hosts: str = Field(
        default="strict", description="host key policy: 'strict' (must be known), 'accept-new' (trust on first use), 'insecure' (test rigs only)"
    )
    ssh_known_hosts_file: str = Field(default="", description="known_hosts file; empty: ssh's default")
    ssh_connect_timeout_s: int = Field(default=15, description="SSH connection timeout")
    ray_address: str = Field(default="", description="mode 'ray': the cluster's dashboard address (http://<head>:8265); empty: $RAY_ADDRESS, else http://127.0.0.1:8265")
    ray_engines: int = Field(
        default=0, ge=0, description="mode 'ray': engines (one per node) an extraction run spreads its shards over; 0: every node that fits"
    )
    ray_runtime_env: str = Field(
        default="",
        description="mode 'ray': a JSON Ray runtime_env for every stage job (env_vars, py_executable, ...), under the stage's own "
        "variables; nothing secret (Ray's dashboard shows it)",
    )
    python: str = Field(default=sys.executable, description="the Python interpreter on the host that has torch (and vllm)")
    working_dir: str = Field(default=".", description="working directory of stage processes on the host")
    data_dir: str = Field(
        default="",
        description=f"data directory on the host; empty: ${DATA_DIR_ENV} of this process (local and ray modes: every node "
        "of a Ray cluster must see it at that path, a shared volume)",
    )
    lock_dir: str = Field(
        default="",
        description=f"where stage locks and shard-lease guards live on the host (a local disk); empty: <data_dir>/{LOCKS_DIR}. "
        f"The stage processes get it as ${env_vars.LOCK_DIR.name}",
    )
    allow_cpu: bool = Field(default=True, description="let every stage run on CPU when the host has no GPU (small local targets, tests); false: only stages that declare cpu_allowed")
    remove_partial_files: bool = Field(default=False, description="delete partial files left by an aborted run instead of failing the pre-flight")
    check_code_version: bool = Field(
        default=True,
        description="refuse a stage when the host's eagle3-assets (package version and a hash of the code the stages run) is "
        "not this machine's; false only to run a deliberate difference",
    )
    preflight_timeout_s: float = Field(default=300.0, description="limit for the pre-flight (imports of large modules included)")
    termination_grace_s: float = Field(default=20.0, description="time a stage gets to stop after the run is terminated, before SIGKILL")
    serving_unit: str = Field(
        default="",
        description="the systemd unit of the generation server on the host (e.g. vllm-kimi.service): when the GPU pre-flight "
        "finds a stage's GPUs held, it names this unit as what to stop",
    )
    nvidia_smi: str = Field(default="nvidia-smi", description="the nvidia-smi the pre-flight runs on the host (a path where it is not on PATH)")
    hf_token: str | None = Field(
        default=None,
        description=f"Hugging Face token for a gated or private target on the hub, given to every stage as ${HF_TOKEN_ENV} on the "
        f"runner's stdin (never on a command line, never logged); set it with EnvVar('{HF_TOKEN_ENV}'), never as a literal",
    )

    # -- where and how

    def ssh_target(self) -> SSHTarget | None:
        if self.mode not in MODES:
            raise ValueError(f"gpu_host.mode {self.mode!r}: one of {MODES}")
        if self.mode in ("local", "ray"):
            return None
        if not self.ssh_host:
            raise ValueError("gpu_host.ssh_host is empty: mode 'ssh' needs the GPU host's name or address")
        return SSHTarget(
            host=self.ssh_host,
            port=self.ssh_port,
            user=self.ssh_user,
            identity_file=self.ssh_identity_file,
            known_hosts=self.ssh_known_hosts,
            known_hosts_file=self.ssh_known_hosts_file,
            connect_timeout_s=self.ssh_connect_timeout_s,
        )

    def connection(self) -> HostConnection:
        return HostConnection(self.ssh_target(), self.working_dir)

    def ray_jobs(self) -> RayStageJobs:
        """Mode 'ray': where the stage jobs go."""
        try:
            runtime_env = json.loads(self.ray_runtime_env) if self.ray_runtime_env.strip() else {}
        except ValueError as exc:
            raise ValueError(f"gpu_host.ray_runtime_env: not JSON ({exc})") from None
        if not isinstance(runtime_env, dict):
            raise ValueError("gpu_host.ray_runtime_env: a JSON object (Ray's runtime_env), not a list or a value")
        address = self.ray_address or os.environ.get("RAY_ADDRESS", "")
        return RayStageJobs(address, runtime_env, python=self.python)

    def label(self) -> str:
        return self.ray_jobs().label if self.mode == "ray" else self.connection().label

    def host_data_dir(self) -> str:
        if self.data_dir:
            return self.data_dir
        if self.mode == "ssh":
            raise ValueError("gpu_host.data_dir is empty: an SSH host needs its data directory (an absolute path on the host)")
        return str(data_dir())

    def host_lock_dir(self) -> str:
        return self.lock_dir or os.path.join(self.host_data_dir(), LOCKS_DIR)

    def stage_secrets(self) -> dict[str, str]:
        """The secrets every stage gets in its environment: those set. None on a Ray cluster, whose dashboard shows a
        job's environment: its nodes have their own (docs/production.md, "Ray cluster")."""
        return {HF_TOKEN_ENV: self.hf_token} if self.hf_token and self.mode != "ray" else {}

    def requirements_for(self, stage: str, requirements: StageRequirements | None = None) -> StageRequirements:
        return requirements or STAGE_REQUIREMENTS.get(stage) or StageRequirements()

    # -- pre-flight

    def preflight(self, stage: str, requirements: StageRequirements | None = None) -> dict:
        """Run the pre-flight for ``stage`` on the host; the report (``ok``, ``failures``, what was checked).

        Never raises for a host problem: an unreachable host or a broken Python
        is a failure line of the report, like any other.
        """
        requirements = self.requirements_for(stage, requirements)
        spec = build_spec(
            stage,
            requirements,
            data_dir=self.host_data_dir(),
            lock_dir=self.host_lock_dir(),
            partial_suffix=PARTIAL_SUFFIX,
            remove_partial_files=self.remove_partial_files,
            cpu_allowed_by_host=self.allow_cpu,
            nvidia_smi=self.nvidia_smi,
            serving_unit=self.serving_unit,
        )
        if self.check_code_version:  # the host compares its own code with this one's
            spec["code_version"] = preflight_module.code_version(str(Path(preflight_module.__file__).parents[2]))
        if self.mode == "ray":
            return self._ray_preflight(stage, spec)
        connection = self.connection()
        base = {"stage": stage, "host": connection.label, "python": self.python, "lock": {"path": spec["lock_path"]}}
        source = Path(preflight_module.__file__).read_text(encoding="utf-8")
        try:
            done = connection.run([self.python, "-", json.dumps(spec)], input=source, timeout_s=self.preflight_timeout_s)
        except HostError as exc:
            return {**base, "ok": False, "failures": [str(exc)]}
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        try:
            report = json.loads(lines[-1]) if done.returncode == 0 and lines else None
        except ValueError:
            report = None
        if not isinstance(report, dict):
            detail = _last_line(done.stderr) or _last_line(done.stdout) or "no output"
            return {**base, "ok": False, "failures": [f"host python {self.python} on {connection.label}: pre-flight did not run (exit {done.returncode}): {detail}"]}
        report["host"] = f"{report.get('host')} ({connection.label})"
        return report

    def _ray_preflight(self, stage: str, spec: dict) -> dict:
        """The pre-flight as a job on the cluster: the driver's node as on any host, then each node (ray_cluster.py)."""
        jobs = self.ray_jobs()
        base = {"stage": stage, "host": jobs.label, "python": self.python, "lock": {"path": spec["lock_path"]}}
        spec = {**spec, "ray_engines": self.ray_engines}
        try:
            report = jobs.preflight(spec, self._stage_env(spec["cpu_allowed"]), timeout_s=self.preflight_timeout_s)
        except RayClusterError as exc:
            return {**base, "ok": False, "failures": [str(exc)]}
        report["host"] = f"{report.get('host')} ({jobs.label})"
        return report

    def _stage_env(self, cpu_allowed: bool, env: Mapping[str, str] | None = None) -> dict[str, str]:
        return {
            **self.stage_secrets(), **(env or {}),
            DATA_DIR_ENV: self.host_data_dir(),
            env_vars.LOCK_DIR.name: self.host_lock_dir(),  # the stage's shard leases and its stage lock: one directory
            env_vars.ALLOW_CPU.name: "1" if cpu_allowed else "0",
        }  # fmt: skip

    # -- stages

    def run_stage(
        self,
        context: AssetExecutionContext | OpExecutionContext,
        stage: str,
        extras: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
        requirements: StageRequirements | None = None,
        on_custom_message: Callable[[Any, Mapping[str, Any]], None] | None = None,
    ) -> PipesClientCompletedInvocation:
        """Pre-flight, then run ``eagle3_assets.stages.<stage>`` on the host under Pipes; what it reported.

        ``env`` is added to the stage's environment (sent on the runner's stdin,
        never on a command line, never logged). ``requirements`` default to the
        stage's :data:`STAGE_REQUIREMENTS` entry. The pre-flight's report is
        attached to every result the stage reports (``gpu_host/...`` metadata).
        The stage finds its data directory in ``$EAGLE3_DATA_DIR`` (the host's).

        ``on_custom_message(payload, preflight_metadata)`` is called with each
        ``report_custom_message`` payload the moment it arrives (on the thread
        that reads the stage's output), so that what the stage reports part-way
        (a finished shard of a ranged run) is recorded even when the stage is
        killed later; an exception it raises fails the step after the stage ends.
        """
        validate_stage_name(stage)
        requirements = self.requirements_for(stage, requirements)
        report = self.preflight(stage, requirements)
        metadata = preflight_metadata(report)
        label = self.label()
        if not report["ok"]:
            lines = "\n".join(f"- {failure}" for failure in report["failures"])
            raise Failure(description=f"GPU host {label} is not ready for stage {stage}:\n{lines}", metadata=metadata, allow_retries=False)
        context.log.info(f"GPU host {label}: pre-flight for {stage} passed ({preflight_summary(report)})")

        stage_env = self._stage_env(requirements.cpu_allowed or self.allow_cpu, env)
        runner_args = [STAGE_PACKAGE, stage, "--lock", report["lock"]["path"], "--grace-s", str(self.termination_grace_s)]
        callback_errors: list[BaseException] = []

        def on_message(message: dict) -> None:
            if on_custom_message is not None and message.get("method") == "report_custom_message":
                try:
                    on_custom_message((message.get("params") or {}).get("payload"), metadata)
                except Exception as exc:  # noqa: BLE001 - raised on the run's thread once the stage is done
                    callback_errors.append(exc)

        if self.mode == "ray":
            if self.hf_token:
                context.log.info("gpu_host.hf_token is not sent to a Ray cluster (its dashboard shows a job's environment): its nodes need their own $HF_TOKEN")
            stage_env[PLACEMENT_ENV] = json.dumps(report["ray"]["placement"])
            context.log.info(f"stage {stage}: submitting to {label} (placement: {report['ray']['placement']})")
            completed = self.ray_jobs().run_stage(
                context, stage, runner_args, stage_env, extras, on_message, metadata, stop_grace_s=self.termination_grace_s
            )
            if callback_errors:
                raise callback_errors[0]
            return completed
        runner = [self.python, "-m", *runner_args]
        with open_pipes_session(
            context=context,
            context_injector=PipesEnvContextInjector(),
            message_reader=_RunnerStdoutMessageReader(),
            extras=dict(extras),
        ) as session:

            def handle(message: dict) -> None:
                session.message_handler.handle_message(message)
                on_message(message)

            process = StageProcess(
                self.connection(),
                runner,
                env={**stage_env, **session.get_bootstrap_env_vars()},
                on_message=handle,
                on_output=_forward_to_stderr,
            )
            try:
                process.start()
            except HostError as exc:
                raise Failure(description=f"stage {stage}: {exc}", metadata=metadata, allow_retries=False) from None
            context.log.info(f"stage {stage} started on {label}")
            try:
                returncode = process.wait()
            except BaseException:  # terminated run, Ctrl-C, a timeout: never leave the stage running
                context.log.warning(f"run terminated: stopping stage {stage} on {label} (its whole process group)")
                process.terminate(self.termination_grace_s)
                raise
            if returncode != 0:
                reason = process.runner_error() or _exit_reason(returncode, self.ssh_target() is not None)
                tail = "\n".join(process.output_tail)
                raise DagsterPipesExecutionError(f"stage {stage} on {label} failed: {reason}\nlast output lines:\n{tail}")
            if callback_errors:
                raise callback_errors[0]
        return PipesClientCompletedInvocation(session, metadata=metadata)


def _forward_to_stderr(line: str) -> None:
    """The stage's own stdout/stderr: into this step's captured stderr (the UI's compute logs)."""
    print(line, file=sys.stderr, flush=True)


def _exit_reason(returncode: int, over_ssh: bool) -> str:
    if over_ssh and returncode == 255:
        return "ssh connection failed or was lost (exit 255)"
    if returncode > 128:
        return f"killed by signal {returncode - 128} (exit {returncode})"
    return f"exit {returncode}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def preflight_summary(report: Mapping[str, Any]) -> str:
    gpus = report.get("gpus") or []
    gpu_part = f"{len(gpus)} GPU(s)" if gpus else f"no GPU, CPU allowed by {report.get('cpu_allowed_by')}"
    modules = report.get("modules") or {}
    return f"{len(modules)} modules import, {gpu_part}, python {report.get('python_version')}"


def preflight_metadata(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the pre-flight checked, as metadata the UI shows next to the materialisation."""
    metadata: dict[str, Any] = {
        "gpu_host/preflight_ok": bool(report.get("ok")),
        "gpu_host/host": str(report.get("host")),
        "gpu_host/python": f"{report.get('python')} ({report.get('python_version', '?')})",
    }
    if report.get("failures"):
        metadata["gpu_host/preflight_failures"] = MetadataValue.json(list(report["failures"]))
    if "modules" in report:
        metadata["gpu_host/modules"] = MetadataValue.json(report["modules"])
    if "gpus" in report:
        rows = ["| GPU | used MiB | total MiB | free MiB |", "| --- | --- | --- | --- |"]
        rows += [f"| {g['index']} | {g['used_mib']} | {g['total_mib']} | {g['free_mib']} |" for g in report["gpus"]]
        metadata["gpu_host/gpus"] = MetadataValue.md("\n".join(rows) if report["gpus"] else f"no GPU ({report.get('gpu_note')})")
    if report.get("gpu_processes"):
        rows = ["| GPU | PID | process | used MiB |", "| --- | --- | --- | --- |"]
        rows += [f"| {p['gpu_index']} | {p['pid']} | {p['name']} | {p['used_mib']} |" for p in report["gpu_processes"]]
        metadata["gpu_host/gpu_processes"] = MetadataValue.md("\n".join(rows))
    if report.get("code_version"):
        code = report["code_version"]
        metadata["gpu_host/code_version"] = f"{code.get('version')} (code {code.get('code_hash')}, {code.get('package_dir')})"
    lock = report.get("lock") or {}
    if lock.get("path"):
        metadata["gpu_host/lock"] = MetadataValue.path(lock["path"])
    if report.get("ray"):
        rows = ["| node | host | GPUs (Ray) | fits | why not |", "| --- | --- | --- | --- | --- |"]
        rows += [
            f"| {n.get('ip')} ({str(n.get('node_id'))[:12]}){' driver' if n.get('driver') else ''} | {n.get('host', '?')} | "
            f"{n.get('ray_gpus', 0)} | {'yes' if n.get('fits') else 'no'} | {'; '.join(n.get('failures', []) + n.get('unfit', []))} |"
            for n in report["ray"]["nodes"]
        ]
        metadata["gpu_host/ray_nodes"] = MetadataValue.md("\n".join(rows))
        metadata["gpu_host/ray_engines"] = len(report["ray"]["placement"]["nodes"])
    if report.get("systemd"):
        metadata["gpu_host/systemd_units"] = MetadataValue.json(report["systemd"])
    if report.get("disk"):
        metadata["gpu_host/disk_free_bytes"] = int(report["disk"]["free_bytes"])
        metadata["gpu_host/disk_needed_bytes"] = int(report["disk"]["needed_bytes"])
    if report.get("partial_files"):
        metadata["gpu_host/partial_files_found"] = int(report["partial_files"]["found"])
        metadata["gpu_host/partial_files_removed"] = int(report["partial_files"]["removed"])
    return metadata


def gpu_host_from_env() -> GPUHost:
    """The deployment's GPU host from the environment (:mod:`eagle3_assets.core.settings.environment`); every field stays editable per run.

    ``EAGLE3_GPU_HOST`` is ``local`` (default), ``ssh://[user@]host[:port]`` or ``ray`` (``EAGLE3_RAY_ADDRESS``).
    """
    where = env_vars.GPU_HOST.get()
    fields: dict[str, Any] = {}
    if where == "ray":
        fields["mode"] = "ray"
        fields["python"] = env_vars.GPU_HOST_PYTHON.get() or "python"  # the cluster's, found on its PATH
    elif where != "local":
        url = urlsplit(where)
        if url.scheme != "ssh" or not url.hostname:
            raise ValueError(f"EAGLE3_GPU_HOST={where!r}: expected 'local', 'ssh://[user@]host[:port]' or 'ray'")
        fields.update(mode="ssh", ssh_host=url.hostname, ssh_port=url.port or 22, ssh_user=url.username or "")
        fields["python"] = env_vars.GPU_HOST_PYTHON.get() or "python3"
    elif env_vars.GPU_HOST_PYTHON.is_set():
        fields["python"] = env_vars.GPU_HOST_PYTHON.get()
    for variable in (
        env_vars.GPU_HOST_WORKDIR, env_vars.GPU_HOST_DATA_DIR, env_vars.SSH_IDENTITY_FILE, env_vars.SSH_KNOWN_HOSTS,
        env_vars.SSH_KNOWN_HOSTS_FILE, env_vars.GPU_HOST_ALLOW_CPU, env_vars.SERVING_UNIT,
        env_vars.RAY_ADDRESS, env_vars.RAY_ENGINES, env_vars.RAY_RUNTIME_ENV,
    ):  # fmt: skip
        if variable.is_set():
            (field_name,) = [g.split(".", 1)[1] for g in variable.gives]
            fields[field_name] = variable.get()
    if env_vars.LOCK_DIR.is_set() and where == "local":  # this machine's lock directory is the local host's
        fields["lock_dir"] = env_vars.LOCK_DIR.get()
    if env_vars.HF_TOKEN.is_set():  # an EnvVar of an unset variable fails the run: only pass it when set
        fields["hf_token"] = EnvVar(HF_TOKEN_ENV)
    return GPUHost(**fields)
