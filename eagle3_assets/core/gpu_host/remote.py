"""Running commands on the GPU host: this machine, or another one over SSH.

Everything sent to a host is an argument list. Over SSH the remote command is
one string for the remote login shell, so every argument is quoted with
``shlex.quote``: a data directory named ``x; touch /tmp/pwned`` stays a
directory name. Values that may be secret (environment variables for a stage)
never go on a command line, where ``ps`` on either machine would show them:
they travel on the process's stdin. Nothing here logs them.

Dagster-free: :class:`StageProcess` runs the stage runner (``python -m
eagle3_assets.stages <stage>``) and hands each line it prints to callbacks;
the GPU host resource turns those lines into Dagster Pipes messages.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

KNOWN_HOSTS_POLICIES = ("strict", "accept-new", "insecure")
# ssh's own exit status when the connection (not the remote command) failed.
SSH_CONNECTION_FAILED = 255
RUNNER_KEY = "eagle3_runner"
_HOSTNAME = re.compile(r"^[A-Za-z0-9_.:\[\]%-]+$")
_USERNAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class HostError(RuntimeError):
    """The host could not be reached or could not run the command; the message names which and why."""


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to reach the GPU host over SSH (OpenSSH client, key authentication only).

    ``known_hosts``: ``strict`` (the host key must already be in
    ``known_hosts_file``, or ssh's default file), ``accept-new`` (trust on
    first use, then strict) or ``insecure`` (no host key check: a test rig
    only). ``BatchMode`` is always on: ssh never prompts for a password.
    """

    host: str
    port: int = 22
    user: str = ""
    identity_file: str = ""
    known_hosts: str = "strict"
    known_hosts_file: str = ""
    connect_timeout_s: int = 15
    server_alive_interval_s: int = 15

    def __post_init__(self) -> None:
        if not self.host or self.host.startswith("-") or not _HOSTNAME.match(self.host):
            raise ValueError(f"ssh host {self.host!r}: not a host name or address")
        if self.user and not _USERNAME.match(self.user):
            raise ValueError(f"ssh user {self.user!r}: not a user name")
        if not 0 < int(self.port) < 65536:
            raise ValueError(f"ssh port {self.port}: not a TCP port")
        if self.known_hosts not in KNOWN_HOSTS_POLICIES:
            raise ValueError(f"ssh known_hosts policy {self.known_hosts!r}: one of {KNOWN_HOSTS_POLICIES}")

    @property
    def label(self) -> str:
        """``user@host:port``, what logs and errors name (no key material, no options)."""
        return f"{self.user + '@' if self.user else ''}{self.host}:{self.port}"

    def ssh_argv(self, remote_command: str) -> list[str]:
        """``ssh <options> -- <host> <remote_command>``; ``remote_command`` must already be quoted."""
        argv = [
            "ssh",
            "-T",  # no terminal: stdout and stderr stay separate, bytes stay bytes
            "-p", str(int(self.port)),
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={int(self.connect_timeout_s)}",
            "-o", f"ServerAliveInterval={int(self.server_alive_interval_s)}",
            "-o", "ServerAliveCountMax=4",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        if self.user:
            argv += ["-l", self.user]
        if self.identity_file:
            argv += ["-i", os.path.expanduser(self.identity_file), "-o", "IdentitiesOnly=yes"]
        if self.known_hosts == "strict":
            argv += ["-o", "StrictHostKeyChecking=yes"]
        elif self.known_hosts == "accept-new":
            argv += ["-o", "StrictHostKeyChecking=accept-new"]
        else:
            argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
        if self.known_hosts_file and self.known_hosts != "insecure":
            argv += ["-o", f"UserKnownHostsFile={os.path.expanduser(self.known_hosts_file)}"]
        return [*argv, "--", self.host, remote_command]


def remote_shell_command(argv: Sequence[str], cwd: str | None = None) -> str:
    """One POSIX shell command line running ``argv`` in ``cwd``, every argument quoted."""
    command = "exec " + shlex.join([str(a) for a in argv])
    if cwd and cwd != ".":
        command = f"cd -- {shlex.quote(str(cwd))} && {command}"
    return command


class HostConnection:
    """Runs argument lists on the GPU host: here (``ssh=None``) or over SSH."""

    def __init__(self, ssh: SSHTarget | None = None, working_dir: str = "."):
        self.ssh = ssh
        self.working_dir = working_dir or "."

    @property
    def label(self) -> str:
        return self.ssh.label if self.ssh else "local"

    def command(self, argv: Sequence[str]) -> tuple[list[str], str | None]:
        """The local argv to execute and its cwd (None over SSH: the remote side changes directory)."""
        if self.ssh is None:
            return [str(a) for a in argv], self.working_dir
        return self.ssh.ssh_argv(remote_shell_command(argv, self.working_dir)), None

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
        """Run to completion; a connection failure or a missing program raises :class:`HostError`."""
        local_argv, cwd = self.command(argv)
        try:
            done = subprocess.run(local_argv, cwd=cwd, input=input, capture_output=True, text=True, timeout=timeout_s)
        except FileNotFoundError as exc:
            raise HostError(f"{self.label}: cannot run {exc.filename or local_argv[0]}: not found") from None
        except NotADirectoryError:
            raise HostError(f"{self.label}: working directory {self.working_dir!r} is not a directory") from None
        except subprocess.TimeoutExpired:
            raise HostError(f"{self.label}: {shlex.join(argv[:1])} did not finish within {timeout_s:.0f}s") from None
        if self.ssh is not None and done.returncode == SSH_CONNECTION_FAILED:
            raise HostError(f"ssh {self.label}: {last_line(done.stderr) or 'connection failed'}")
        return done

    def popen(self, argv: Sequence[str]) -> subprocess.Popen:
        """Start ``argv`` with pipes on stdin, stdout and stderr, in a session of its own.

        Its own session: a Ctrl-C meant for the orchestrator does not reach ssh
        (or the local runner) before the orchestrator has asked the stage to stop.
        """
        local_argv, cwd = self.command(argv)
        try:
            return subprocess.Popen(
                local_argv,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise HostError(f"{self.label}: cannot run {exc.filename or local_argv[0]}: not found") from None
        except NotADirectoryError:
            raise HostError(f"{self.label}: working directory {self.working_dir!r} is not a directory") from None


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class StageProcess:
    """The stage runner on the host, driven from here.

    Protocol with ``python -m eagle3_assets.stages`` (the runner): the first
    line on its stdin is JSON ``{"env": {...}}`` (added to the stage's
    environment; this is how secrets and the Pipes bootstrap travel); after
    that stdin stays open, and its end (this process closing it, or dying, or
    the SSH connection dropping) makes the runner stop the stage's process
    group. The runner's stdout carries only JSON lines: the stage's Pipes
    messages, and its own ``{"eagle3_runner": {...}}`` records (PIDs, errors).
    Its stderr carries the stage's stdout and stderr.
    """

    def __init__(
        self,
        connection: HostConnection,
        runner_argv: Sequence[str],
        env: Mapping[str, str],
        on_message: Callable[[dict], None],
        on_output: Callable[[str], None],
        tail_lines: int = 40,
    ):
        self.connection = connection
        self.runner_argv = list(runner_argv)
        self.env = dict(env)
        self.on_message = on_message
        self.on_output = on_output
        self.runner_records: list[dict] = []
        self.output_tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.process: subprocess.Popen | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle

    def start(self) -> "StageProcess":
        self.process = self.connection.popen(self.runner_argv)
        self._threads = [
            threading.Thread(target=self._read_stdout, name="stage-stdout", daemon=True),
            threading.Thread(target=self._read_stderr, name="stage-stderr", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        try:
            assert self.process.stdin is not None
            self.process.stdin.write((json.dumps({"env": self.env}) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the runner is already gone; wait() reports why
        return self

    def wait(self, poll_s: float = 0.2) -> int:
        """Wait for the runner to exit and for its output to be read to the end; its exit status."""
        assert self.process is not None
        while self.process.poll() is None:
            time.sleep(poll_s)
        for thread in self._threads:
            thread.join(timeout=30)
        self._close_stdin()
        return self.process.returncode

    def terminate(self, grace_s: float = 20.0) -> None:
        """Stop the stage and everything it started, on the host, within about ``grace_s``.

        Three ways, for the three ways things break: ask the runner by PID (over
        a second SSH connection when remote), close its stdin (the runner's
        watchdog stops the stage's process group), and if the runner is still
        there after the grace period, kill the local end (ssh, or the local
        runner's group), which also ends the remote runner's stdin.
        """
        if self.process is None or self.process.poll() is not None:
            return
        runner_pid = self.runner_pid()
        if self.connection.ssh is not None and runner_pid:
            try:
                self.connection.run(["kill", "-TERM", str(runner_pid)], timeout_s=min(grace_s, 15.0))
            except HostError:
                pass  # the connection is down too; closing stdin below still reaches the runner when it can
        elif self.connection.ssh is None:
            _signal_group(self.process.pid, signal.SIGTERM)
        self._close_stdin()
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        for thread in self._threads:
            thread.join(timeout=5)

    def runner_pid(self) -> int | None:
        for record in self.runner_records:
            if isinstance(record.get("pid"), int):
                return record["pid"]
        return None

    def runner_error(self) -> str | None:
        for record in self.runner_records:
            if record.get("error"):
                return str(record["error"])
        return None

    # -- reading

    def _read_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if not line.strip():
                continue
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if isinstance(message, dict) and isinstance(message.get(RUNNER_KEY), dict):
                self.runner_records.append(message[RUNNER_KEY])
            elif isinstance(message, dict):
                self.on_message(message)
            else:
                self._output(line)

    def _read_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for raw in self.process.stderr:
            self._output(raw.decode(errors="replace").rstrip("\n"))

    def _output(self, line: str) -> None:
        self.output_tail.append(line)
        self.on_output(line)

    def _close_stdin(self) -> None:
        try:
            if self.process is not None and self.process.stdin is not None and not self.process.stdin.closed:
                self.process.stdin.close()
        except BrokenPipeError:
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
