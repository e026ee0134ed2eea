"""The GPU host resource over real SSH: a real ``sshd`` on a loopback port, real Dagster runs.

The fixture starts Debian's OpenSSH server (``/usr/sbin/sshd``, installed by
``.ci/run``) as the current user with a throw-away host key and a throw-away
client key; the "remote" host is this machine, reached through sshd, so the
stage runs in an SSH session exactly as on a GPU host.
"""


import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from dagster import (
    AssetCheckSpec,
    AssetExecutionContext,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    EnvVar,
    RunConfig,
    asset,
    materialize,
)

from eagle3_assets.core.gpu_host.preflight import lock_holder, process_cmdline, stray_stage_processes
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements
from eagle3_assets.core.serving.vllm_launcher import free_port
from eagle3_assets.defs.gpu_host_ready import gpu_host_ready_job
from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
from eagle3_assets.glue.partitions import register_shards
from resources.gpu_host import GPU_POOL, STAGE_REQUIREMENTS, GPUHost, ensure_gpu_pool_limit
from resources.target_model import TargetModel
from tests.extraction_helpers import write_validated_traces
from tests.secret_scan import files_holding

REPO = Path(__file__).resolve().parents[1]
STAGE = "host_probe"


@dataclass(frozen=True)
class SSHServer:
    port: int
    user: str
    identity_file: Path
    known_hosts_file: Path
    log: Path

    def host(self, data_dir: Path, **fields) -> GPUHost:
        settings = {
            "mode": "ssh",
            "ssh_host": "127.0.0.1",
            "ssh_port": self.port,
            "ssh_user": self.user,
            "ssh_identity_file": str(self.identity_file),
            "ssh_known_hosts": "strict",
            "ssh_known_hosts_file": str(self.known_hosts_file),
            "python": sys.executable,
            "working_dir": str(REPO),
            "data_dir": str(data_dir),
            "termination_grace_s": 6.0,
        }
        return GPUHost(**{**settings, **fields})


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> SSHServer:
    binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(binary):
        pytest.fail("sshd not found: install Debian's openssh-server (.ci/run does: apt-get install -y openssh-server)")
    root = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(root / name)], check=True)
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    port, user = free_port(), getpass.getuser()
    config = root / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {root / 'host_key'}",
                f"PidFile {root / 'sshd.pid'}",
                f"AuthorizedKeysFile {root / 'authorized_keys'}",
                f"AllowUsers {user}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "UsePAM no",
                "StrictModes no",
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    known_hosts = root / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {(root / 'host_key.pub').read_text()}")
    log = root / "sshd.log"
    with open(log, "wb") as log_file:
        server = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stdout=log_file, stderr=subprocess.STDOUT)
    ssh = SSHServer(port, user, root / "client_key", known_hosts, log)
    try:
        deadline = time.monotonic() + 20
        probe = ssh.host(root).ssh_target().ssh_argv("exec true")
        while subprocess.run(probe, capture_output=True).returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start (exit {server.poll()}):\n{log.read_text()}")
            time.sleep(0.2)
        yield ssh
    finally:
        server.terminate()
        server.wait(timeout=10)


def probe_asset(modules: list[str], requirements: StageRequirements | None = None, hold_s: float = 0):
    @asset(name="probe", check_specs=[AssetCheckSpec("modules_import", asset="probe", blocking=True)])
    def probe(context: AssetExecutionContext, gpu_host: GPUHost):
        extras = {"modules": modules, "check_name": "modules_import", "hold_s": hold_s}
        return gpu_host.run_stage(context, STAGE, extras, requirements=requirements).get_materialize_result()

    return probe


def test_a_stage_runs_over_ssh_and_its_logs_metadata_and_check_arrive_in_dagster(sshd, data_dir):
    instance = DagsterInstance.ephemeral()
    host = sshd.host(data_dir)
    result = materialize([probe_asset(["json", "polars"])], resources={"gpu_host": host}, instance=instance)
    assert result.success
    (materialization,) = result.asset_materializations_for_node("probe")
    metadata = {k: v.value for k, v in materialization.metadata.items()}
    assert metadata["ssh_connection"].split()[2:] == ["127.0.0.1", str(sshd.port)], "the stage ran in the SSH session"
    assert metadata["modules"]["polars"] and metadata["modules"]["json"]
    assert metadata["gpu_host/preflight_ok"] is True
    assert metadata["gpu_host/host"].endswith(f"({sshd.user}@127.0.0.1:{sshd.port})")
    assert metadata["gpu_host/modules"]["dagster_pipes"]
    assert (data_dir / STAGE / "probe.json").is_file()
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "modules_import" and check.passed
    logs = [e.message for e in instance.all_logs(result.run_id) if e.is_dagster_event is False]
    assert any("host_probe: probing 2 modules" in m for m in logs), "the stage's log lines arrive in the run"
    assert lock_holder(host.host_lock_dir() + f"/{STAGE}.lock") is None, "the lock ends with the stage"


def command_lines() -> dict[int, bytes]:
    """Every process's command line on this machine, read from /proc now (raw bytes, NUL-separated)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                pass  # gone meanwhile
    return found


def parent_of(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


class StageWatch:
    """Watches this machine's processes while the stage runs: its environment, and every command line.

    The stage's process is the one started with ``-m eagle3_assets.stages.<stage>`` whose ``EAGLE3_DATA_DIR`` is
    ``data_dir`` (other runs of the same stage on this machine are not it); its environment is kept. Every
    round, the command line of every process on the machine is searched for ``secret`` (a superset of the
    stage's process tree: this test's ssh client, sshd's session, the runner, the stage); the tree itself is
    recorded (the stage's ancestors up to init, and this process's ssh children) so that the test can assert
    that the search covered it while it ran.
    """

    def __init__(self, stage: str, data_dir: Path, secret: str):
        self.module, self.data_dir = f"eagle3_assets.stages.{stage}", str(data_dir)
        self.stage = stage
        self.secret = secret.encode()
        self.environment: dict[str, str] | None = None
        self.pid: int | None = None  # the stage's
        self.leaks: dict[int, str] = {}  # pid -> a command line holding the secret
        self.tree: dict[int, str] = {}  # pid -> command line, of the stage's processes seen while it ran
        self.rounds_with_stage = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "StageWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            lines = command_lines()
            for pid, raw in lines.items():
                if self.secret in raw:  # kept with the token masked: the failure message shows where, not what
                    self.leaks[pid] = raw.replace(self.secret, b"<HF_TOKEN>").replace(b"\0", b" ").decode(errors="replace")
            stage = self._stage_pid()
            if stage is None:
                continue
            self.rounds_with_stage += 1
            pid: int | None = stage
            while pid and pid in lines:  # the stage and its ancestors, to init
                self.tree[pid] = lines[pid].replace(b"\0", b" ").decode(errors="replace")
                pid = parent_of(pid)
            for pid, raw in lines.items():  # the orchestrator's side: this process's ssh client
                if raw.startswith(b"ssh\0") and parent_of(pid) == os.getpid():
                    self.tree[pid] = raw.replace(b"\0", b" ").decode(errors="replace")

    def _stage_pid(self) -> int | None:
        for pid, cmdline in stray_stage_processes(self.stage):
            if self.module not in cmdline.split():
                continue  # the runner (-m eagle3_assets.stages <stage>), not the stage
            if self.environment is None:
                try:
                    raw = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                environment = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
                if environment.get("EAGLE3_DATA_DIR") != self.data_dir:
                    continue
                self.environment = environment
                self.pid = pid
            if pid == self.pid:
                return pid
        return None


def test_the_extraction_stage_runs_over_ssh_with_a_secret_that_shows_nowhere(sshd, data_dir, tiny_target, tmp_path, capfd, monkeypatch):
    """The real ``hidden_states`` asset and its stage on a tiny shard, on the host behind sshd, given HF_TOKEN as an EnvVar.

    The token reaches the stage's environment (seen in /proc while it runs, with the SSH session's own variables)
    and appears on no command line of the stage's process tree while it runs, in no log line, no captured stdout/stderr, no metadata, no instance file and no file of the data dir.
    """
    secret = "hf_eagle3-ssh-stage-secret-31337"
    monkeypatch.setenv("HF_TOKEN", secret)
    shard = "shard-00000"
    write_validated_traces(data_dir, shard, tiny_target, count=6)
    home = tmp_path / "dagster_home"
    home.mkdir()
    host = sshd.host(data_dir, hf_token=EnvVar("HF_TOKEN"))
    resources = {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": host}
    run_config = RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1)})
    capfd.readouterr()  # only what the run prints counts below
    with DagsterInstance.local_temp(tempdir=str(home)) as instance, StageWatch("extract_hidden_states", data_dir, secret) as stage:
        register_shards(instance, [shard])
        result = materialize([hidden_states], partition_key=shard, resources=resources, instance=instance, run_config=run_config)
        logs = [str(entry) for entry in instance.all_logs(result.run_id)]
    captured = capfd.readouterr()

    assert result.success
    assert all(check.passed for check in result.get_asset_check_evaluations())
    (materialization,) = result.asset_materializations_for_node("hidden_states")
    metadata = {name: value.value for name, value in materialization.metadata.items()}
    assert metadata["gpu_host/host"].endswith(f"({sshd.user}@127.0.0.1:{sshd.port})") and metadata["tokens"] > 0
    assert (data_dir / "hidden_states" / shard / "metadata.json").is_file()
    assert stage.environment is not None, "the stage's process was never seen"
    assert stage.environment.get("SSH_CONNECTION", "").split()[2:] == ["127.0.0.1", str(sshd.port)], "the stage ran in the SSH session"
    assert stage.environment.get("HF_TOKEN") == secret, "the stage was given the token"
    # ...and on no command line while it ran: not the ssh client's here, not sshd's session's, not the runner's or the stage's.
    assert stage.leaks == {}, f"the token is on command lines: {stage.leaks}"
    tree = list(stage.tree.values())
    assert stage.rounds_with_stage >= 1 and any("-m eagle3_assets.stages.extract_hidden_states" in c for c in tree)
    assert any("-m eagle3_assets.stages extract_hidden_states" in c for c in tree), f"the runner was not seen: {tree}"
    assert any(c.startswith("sshd") or "/sshd" in c.split()[0] for c in tree), f"sshd's session was not seen: {tree}"
    assert any(c.startswith("ssh ") and f"-p {sshd.port}" in c for c in tree), f"the ssh client was not seen: {tree}"

    assert any("extract_hidden_states" in line for line in logs) and captured.err, "the scans below look at real output"
    assert not [line for line in logs if secret in line]
    assert secret not in captured.out and secret not in captured.err
    assert secret not in json.dumps(metadata, default=str)
    assert files_holding(secret, [home, data_dir]) == []


def test_a_failed_preflight_stops_the_stage_before_it_starts(sshd, data_dir):
    requirements = StageRequirements(modules=["eagle3_no_such_module"], cpu_allowed=True)
    result = materialize(
        [probe_asset(["json"], requirements)],
        resources={"gpu_host": sshd.host(data_dir)},
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    error = failure.step_failure_data.user_failure_data
    assert f"GPU host {sshd.user}@127.0.0.1:{sshd.port} is not ready for stage {STAGE}" in error.description
    assert "- module eagle3_no_such_module: does not import in" in error.description
    assert error.metadata["gpu_host/preflight_ok"].value is False
    assert not (data_dir / STAGE / "probe.json").exists(), "the stage never ran"


def test_an_injection_attempt_in_the_data_dir_stays_a_directory_name(sshd, tmp_path):
    marker = tmp_path / "pwned-by-substitution"
    data = tmp_path / f"x; touch /tmp/pwned; $(touch {marker}); `touch {marker}`"
    Path("/tmp/pwned").unlink(missing_ok=True)
    host = sshd.host(data, working_dir=str(REPO), lock_dir=str(data / "locks; touch /tmp/pwned"))
    result = materialize([probe_asset(["json"])], resources={"gpu_host": host}, instance=DagsterInstance.ephemeral())
    assert result.success
    assert (data / STAGE / "probe.json").is_file(), "the hostile name was used as a directory, verbatim"
    assert not Path("/tmp/pwned").exists() and not marker.exists()


def test_cancelling_the_run_kills_the_remote_stage(sshd, data_dir, tmp_path):
    """Terminating a run delivers SIGINT to the run's process (what Dagster's run launcher does);
    the stage's process group on the far side of SSH must go with it."""
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    host = sshd.host(data_dir)
    run = subprocess.Popen(
        [sys.executable, "-c", CANCELLED_RUN_SOURCE, json.dumps(host.model_dump())],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(dagster_home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lock = Path(host.host_lock_dir()) / f"{STAGE}.lock"
    holder, deadline = None, time.monotonic() + 90
    while not (holder and holder.get("stage_pid_alive")):
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read().decode()[-3000:] if run.poll() is not None else "timed out"
        time.sleep(0.2)
        holder = lock_holder(str(lock))
    stage_pid, runner_pid = holder["stage_pid"], holder["pid"]
    assert "eagle3_assets.stages.host_probe" in holder["stage_pid_cmdline"]
    assert process_cmdline(stage_pid) is not None
    instance = DagsterInstance.from_config(str(dagster_home))
    wait_until_holding(run, instance, deadline)
    run.send_signal(signal.SIGINT)
    output = run.communicate(timeout=60)[0].decode()
    assert_cancelled_stage_gone(stage_pid, runner_pid, lock, data_dir / STAGE / "probe.json", output, wait_s=20)

    (record,) = instance.get_run_records()
    assert record.dagster_run.status in {DagsterRunStatus.CANCELED, DagsterRunStatus.FAILURE}, output[-2000:]
    messages = [e.message for e in instance.all_logs(record.dagster_run.run_id)]
    assert any("run terminated: stopping stage host_probe" in m for m in messages), output[-2000:]
    # The stage never finished, yet its log line is in the run: messages stream while the stage runs.
    assert any("host_probe: holding for 120s" in m for m in messages)
    instance.dispose()


def test_a_crashing_stage_fails_the_step_with_its_last_output_lines(data_dir):
    # Local mode: the same runner and Pipes path without SSH. A bad extra makes the stage raise.
    host = GPUHost(mode="local", working_dir=str(REPO))
    result = materialize(
        [probe_asset(["json"], hold_s="not a number")],
        resources={"gpu_host": host},
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    message = failure.step_failure_data.error.cause.message  # the step error wraps the stage's
    assert f"stage {STAGE} on local failed: exit 1" in message
    assert "could not convert string to float: 'not a number'" in message, "the stage's traceback is in the error"
    assert lock_holder(host.host_lock_dir() + f"/{STAGE}.lock") is None


def test_an_unknown_host_key_is_refused(sshd, data_dir, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    report = sshd.host(data_dir, ssh_known_hosts_file=str(empty)).preflight(STAGE)
    assert report["failures"] == [f"ssh {sshd.user}@127.0.0.1:{sshd.port}: Host key verification failed."]


def test_gpu_host_ready_runs_the_preflight_on_its_own_over_ssh(sshd, data_dir, monkeypatch, tiny_target):
    host = sshd.host(data_dir)
    resources = {"gpu_host": host, "target_model": TargetModel(path=str(tiny_target))}
    # Only host_probe: other engineers' stages register themselves when their assets are imported.
    config = {"ops": {"gpu_host_preflight": {"config": {"stages": [STAGE], "probe_modules": ["json"]}}}}
    ready = gpu_host_ready_job.execute_in_process(resources=resources, run_config=config, instance=DagsterInstance.ephemeral())
    assert ready.success
    (output,) = [e for e in ready.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    metadata = output.step_output_data.metadata
    assert metadata["preflight/host_probe"].value["ok"] is True
    assert metadata["host_probe"].value["ssh_connection"], "host_probe ran over SSH"

    monkeypatch.setitem(STAGE_REQUIREMENTS, "host_probe", StageRequirements(modules=["eagle3_no_such_module"], cpu_allowed=True))
    not_ready = gpu_host_ready_job.execute_in_process(
        resources=resources, run_config=config, instance=DagsterInstance.ephemeral(), raise_on_error=False
    )
    assert not not_ready.success
    (failure,) = [e for e in not_ready.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    assert "- host_probe: module eagle3_no_such_module: does not import" in failure.step_failure_data.user_failure_data.description


def test_the_gpu_pool_gets_a_limit_of_one_unless_one_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE3_GPU_POOL_LIMIT", raising=False)
    limits = {}
    for name, preset in (("fresh", None), ("operator_set", 2)):
        home = tmp_path / name
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        with DagsterInstance.from_config(str(home)) as instance:
            if preset is not None:
                instance.event_log_storage.set_concurrency_slots(GPU_POOL, preset)
            limits[name] = ensure_gpu_pool_limit(instance)
            assert instance.event_log_storage.get_concurrency_info(GPU_POOL).slot_count == limits[name]
    assert limits == {"fresh": 1, "operator_set": 2}, "one GPU stage at a time by default; an operator's limit is kept"


def wait_until_holding(run: subprocess.Popen, instance: DagsterInstance, deadline: float) -> None:
    """Until CANCELLED_RUN_SOURCE's stage says it is holding (its log line streamed into the run): it has started its
    work, and a cancel now lands in the middle of it."""

    def holding() -> bool:
        records = instance.get_run_records()
        return bool(records) and any("host_probe: holding for 120s" in e.message for e in instance.all_logs(records[0].dagster_run.run_id))

    while not holding():
        assert run.poll() is None, run.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the stage never said it was holding"
        time.sleep(0.2)


def assert_cancelled_stage_gone(stage_pid: int, runner_pid: int, lock: Path, output_file: Path, output: str, wait_s: float) -> None:
    """The cancelled run's stage and runner are gone within ``wait_s``, the lock is free, the stage's output never written."""
    deadline = time.monotonic() + wait_s
    while (process_cmdline(stage_pid) or process_cmdline(runner_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_cmdline(stage_pid) is None, f"the stage (PID {stage_pid}) survived the cancelled run:\n{output[-2000:]}"
    assert process_cmdline(runner_pid) is None, f"the runner (PID {runner_pid}) survived the cancelled run"
    assert lock_holder(str(lock)) is None
    assert not output_file.exists(), "the stage was stopped before it finished"


CANCELLED_RUN_SOURCE = """
import json, sys
from dagster import AssetExecutionContext, DagsterInstance, asset, materialize
from resources.gpu_host import GPUHost

@asset(name="long_probe")
def long_probe(context: AssetExecutionContext, gpu_host: GPUHost):
    return gpu_host.run_stage(context, "host_probe", {"modules": [], "hold_s": 120}).get_materialize_result()

host = GPUHost(**json.loads(sys.argv[1]))
with DagsterInstance.get() as instance:
    result = materialize([long_probe], resources={"gpu_host": host}, instance=instance, raise_on_error=False)
print("run finished, success:", result.success, flush=True)
"""
