"""A real local Ray cluster for the tests: a head and a worker, separate nodes on this machine.

Each node is started by Ray's own ``ray start`` in a session of its own, so a
node can be killed whole (its raylet, its workers, its agents: one process
group) the way a machine is lost, while the other goes on. The head has a
``head_node`` resource and the worker a ``worker_node`` one, one CPU each and
no GPU; the dashboard listens on loopback for job submission.

Started once per test session (tests/conftest.py: ``ray_cluster``), because a
start costs about 20 seconds here; a test that kills the worker adds it back
before it ends (:meth:`LocalRayCluster.ensure_worker`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
# Node deaths noticed within seconds, not Ray's default of about half a minute.
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    def __init__(self, object_store_bytes: int = 100_000_000):
        self.temp_dir = tempfile.mkdtemp(prefix="e3ray-")  # short: Ray's socket paths must fit 107 characters
        self.port = free_port()
        self.dashboard_port = free_port()
        self.object_store_bytes = object_store_bytes
        self.env = {**os.environ, **FAST_HEALTH_CHECKS, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0"}
        self.head_sid: int | None = None
        self.worker_sid: int | None = None
        self.extra_sids: list[int] = []

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ray_start(self, args: list[str], env: dict[str, str] | None = None) -> int:
        """``ray start ...`` in a new session; the session id (= process group) its daemons keep."""
        process = subprocess.Popen(
            [str(BIN / "ray"), "start", *args, "--disable-usage-stats", f"--object-store-memory={self.object_store_bytes}",
             # Ray's default (52365) is one per machine: a second node's agent, or another session's head, fails to bind it.
             f"--dashboard-agent-listen-port={free_port()}"],
            env=env or self.env,
            # Not the checkout: Ray puts a job's working directory on its workers' sys.path, and a node must find
            # the package its own way (a node with another copy is a test of its own).
            cwd=self.temp_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        out, _ = process.communicate(timeout=180)
        if process.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed ({process.returncode}):\n{out[-3000:]}")
        return process.pid

    def start(self) -> LocalRayCluster:
        self.head_sid = self._ray_start([
            "--head", f"--port={self.port}", f"--dashboard-port={self.dashboard_port}", "--dashboard-host=127.0.0.1",
            "--include-dashboard=true", f"--ray-client-server-port={free_port()}", f"--temp-dir={self.temp_dir}",
            "--num-cpus=1", "--num-gpus=0", '--resources={"head_node": 1}',
        ])  # fmt: skip
        self._wait_for_dashboard()
        self.add_worker()
        return self

    def add_worker(self, env: dict[str, str] | None = None, resource: str = "worker_node") -> int:
        """Another node on this machine; its session id. ``env``: the node's own environment (other code, say)."""
        before = self.alive_nodes()
        sid = self._ray_start(
            [f"--address={self.gcs_address}", "--num-cpus=1", "--num-gpus=0", f'--resources={{"{resource}": 1}}'], env=env
        )
        if resource == "worker_node":
            self.worker_sid = sid
        else:
            self.extra_sids.append(sid)
        self.wait_for_nodes(len(before) + 1)
        return sid

    def ensure_worker(self) -> None:
        if self.worker_sid is None or not _session_alive(self.worker_sid):
            self.worker_sid = None
            self.add_worker()

    def kill_node(self, sid: int) -> None:
        """The node whose daemons are in session ``sid``, lost at once (SIGKILL to every process of it)."""
        expected = len(self.alive_nodes()) - 1
        _kill_session(sid)
        self.wait_for_nodes(expected)

    def kill_worker(self) -> None:
        assert self.worker_sid is not None, "no worker node"
        self.kill_node(self.worker_sid)
        self.worker_sid = None

    def session_of(self, pid: int) -> int:
        return os.getsid(pid)

    def alive_nodes(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.dashboard}/nodes?view=summary", timeout=10) as response:
            summary = json.load(response)["data"]["summary"]
        return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]

    def wait_for_nodes(self, count: int, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            alive = len(self.alive_nodes())
            if alive == count:
                return
            assert time.monotonic() < deadline, f"Ray cluster: {alive} node(s) alive, expected {count} within {timeout_s:.0f}s"
            time.sleep(0.5)

    def _wait_for_dashboard(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=5):
                    return
            except OSError:
                assert time.monotonic() < deadline, f"Ray dashboard {self.dashboard} did not answer within {timeout_s:.0f}s"
                time.sleep(0.5)

    def stop(self) -> None:
        for sid in [self.worker_sid, *self.extra_sids, self.head_sid]:
            if sid is not None:
                _kill_session(sid)
        # A job's entrypoint runs in a session of its own (so that Ray can stop its group), in the head's working
        # directory: one still running when the cluster went (a stage of a failed test) is found there.
        for pid in _processes_under(self.temp_dir):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _processes_under(directory: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd").startswith(directory):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _session_alive(sid: int) -> bool:
    try:
        os.killpg(sid, 0)
        return True
    except ProcessLookupError:
        return False


def _kill_session(sid: int, timeout_s: float = 30) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while _session_alive(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
