"""A real ``dagster dev -w workspace.yaml`` (webserver + daemon), or the webserver alone, on a free port.

Shared by the UI test, the scripted-backfill test and ``bench/backfill.py``.
It runs over a temporary ``DAGSTER_HOME`` (telemetry off) in its own process
group: stopping it sends the SIGINT ``dagster dev`` shuts down on (it stops
its webserver and daemon), then kills the group, which also takes the run
workers the code server spawned.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle3_assets.core.serving.vllm_launcher import free_port, read_log_tail, start_logged
from tests.hold_point import SITE  # the tests' one sitecustomize (Python loads only the first on the path)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# How often the backfill daemon of a test's Dagster wakes (Dagster's own: 30 s, with no setting; see
# tests/hold_point_site/sitecustomize.py). A backfill of three asset levels waits one wake-up per level, half a tick on
# average after the level before it ends: 2 s, not 5, as the run queue is looked at every second (deploy/dagster-dev.yaml).
TEST_DAEMON_TICK_S = 2.0

_LOCATIONS = """{ workspaceOrError { __typename ... on Workspace { locationEntries {
  name loadStatus locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


def write_instance_yaml(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "dagster.yaml"
    if not path.exists():
        shutil.copyfile(REPO / "deploy" / "dagster-dev.yaml", path)  # what `make dev` runs on
    return path


def with_daemon_tick(env: dict[str, str], tick_s: float = TEST_DAEMON_TICK_S) -> dict[str, str]:
    """``env`` for Dagster processes whose backfill daemon wakes every ``tick_s`` seconds instead of 30."""
    path = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "EAGLE3_TEST_DAEMON_TICK_S": str(tick_s)}


def _sigint_default() -> None:
    # Started from a background job, this process inherits SIGINT ignored, and so would
    # `dagster dev`, which then ignores SIGINT and SIGTERM alike: give it the default back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class DagsterDev:
    """``dagster dev`` (``daemon=True``) or ``dagster-webserver`` over ``home``; a context manager.

    ``daemon_tick_s``: how often its backfill daemon wakes (None: Dagster's own 30 s, what a benchmark measures).
    """

    def __init__(
        self, home: Path, env: dict[str, str], log_path: Path, daemon: bool = True, startup_timeout_s: float = 600.0,
        daemon_tick_s: float | None = TEST_DAEMON_TICK_S,
    ):  # fmt: skip
        self.home = Path(home)
        self.env = env
        self.log_path = Path(log_path)
        self.daemon = daemon
        self.startup_timeout_s = startup_timeout_s
        self.daemon_tick_s = daemon_tick_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> DagsterDev:
        write_instance_yaml(self.home)
        serve = ["-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(self.port)]
        cmd = [str(BIN / "dagster"), "dev", *serve] if self.daemon else [str(BIN / "dagster-webserver"), *serve]
        env = {**os.environ, **self.env, "DAGSTER_HOME": str(self.home)}
        if self.daemon_tick_s is not None:
            env = with_daemon_tick(env, self.daemon_tick_s)
        self.process = start_logged(cmd, self.log_path, env=env, preexec_fn=_sigint_default, cwd=REPO)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        """Until the webserver answers and the code location has loaded (a load error fails at once)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.describe()} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                entries = self.graphql(_LOCATIONS)["workspaceOrError"]["locationEntries"]
                errors = [e for e in entries if (e["locationOrLoadError"] or {}).get("__typename") == "PythonError"]
                if errors:
                    raise RuntimeError(f"code location failed to load: {errors[0]['locationOrLoadError']['message']}")
                if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                    return
            except (urllib.error.URLError, OSError, KeyError, TypeError):
                pass  # not serving yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.describe()} not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(1)

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            payload = json.loads(response.read())
        if payload.get("errors"):
            raise RuntimeError(f"GraphQL errors: {payload['errors']}")
        return payload["data"]

    def instance(self):
        """A DagsterInstance on the same home: what the webserver and daemon record, read directly."""
        from dagster import DagsterInstance

        return DagsterInstance.from_config(str(self.home))

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group: run workers, a webserver that did not stop
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None

    def log_tail(self, lines: int = 60) -> str:
        return read_log_tail(self.log_path, lines)

    def describe(self) -> str:
        return f"{'dagster dev' if self.daemon else 'dagster-webserver'} on {self.url} (log {self.log_path})"

    def __enter__(self) -> DagsterDev:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
