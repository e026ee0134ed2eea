"""The stage runner: ``python -m eagle3_assets.stages <stage> --lock <path>``, on the GPU host.

It sits between the orchestrator (directly, or at the far end of an SSH
connection) and the stage process ``python -m eagle3_assets.stages.<stage>``:

- reads one JSON line ``{"env": {...}}`` from stdin and adds it to the stage's
  environment (secrets and the Dagster Pipes bootstrap arrive this way, never
  on a command line);
- takes the stage lock (see :class:`eagle3_assets.core.gpu_host.stage_lock.StageLock`)
  and passes it to the stage, so the lock is held as long as the stage or
  anything it started runs; a lock held by a live process is an error naming
  its PID and command line;
- starts the stage in a process group of its own, with the stage's stdout and
  stderr going to this process's stderr, and the stage's Pipes messages going
  through a pipe to this process's stdout, which therefore carries nothing but
  JSON lines;
- stops the stage's whole process group (SIGINT, then SIGTERM, then SIGKILL)
  when stdin ends (the orchestrator stopped, died, or lost the connection) or
  when this process is told to stop (SIGTERM, SIGINT, SIGHUP).

As a Ray job's entrypoint (``--ray-job``, a GPU host on a Ray cluster) the
environment comes with the job, stdin is not watched, and stdout is the job's
log, which the orchestrator tails for the same JSON lines.

Standard library and ``dagster_pipes`` only: the host needs no Dagster.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from eagle3_assets.core.gpu_host.preflight import STAGE_PACKAGE, holder_line
from eagle3_assets.core.gpu_host.stage_lock import StageLock
from eagle3_assets.core.gpu_host.stage_requirements import validate_stage_name

RUNNER_KEY = "eagle3_runner"
LOCK_HELD_EXIT = 75  # EX_TEMPFAIL: someone else is running this stage
_PR_SET_PDEATHSIG = 1

_stdout_lock = threading.Lock()


def emit(line: bytes) -> None:
    """Write one line to stdout, whole: the orchestrator parses each line as JSON."""
    with _stdout_lock:
        sys.stdout.buffer.write(line if line.endswith(b"\n") else line + b"\n")
        sys.stdout.buffer.flush()


def emit_record(**record) -> None:
    emit(json.dumps({RUNNER_KEY: record}).encode())


def _die_with_parent() -> None:
    """In the stage (before exec): get SIGTERM if the runner dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _run_id(env: dict) -> str | None:
    """The Dagster run id from the Pipes context, for the lock record (best effort)."""
    raw = env.get("DAGSTER_PIPES_CONTEXT")
    if not raw:
        return None
    try:
        from dagster_pipes import decode_param

        params = decode_param(raw)
        return (params.get("data") or {}).get("run_id")
    except Exception:  # noqa: BLE001 - the record is informative only
        return None


class StageGroup:
    """The stage's process group and the one way to stop it."""

    def __init__(self, process: subprocess.Popen, grace_s: float):
        self.process = process
        self.grace_s = grace_s
        self.stopping = threading.Event()

    def stop(self, reason: str) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        print(f"[stage runner] stopping stage (PID {self.process.pid} and its group): {reason}", file=sys.stderr, flush=True)
        threading.Thread(target=self._escalate, daemon=True).start()

    def _escalate(self) -> None:
        for sig, wait in ((signal.SIGINT, self.grace_s / 2), (signal.SIGTERM, self.grace_s / 2), (signal.SIGKILL, 0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.process.poll() is not None and not _group_alive(self.process.pid):
                    return
                time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _read_first_line(fd: int) -> bytes:
    """The first line of ``fd``, read unbuffered so that nothing after it is consumed."""
    line = bytearray()
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return bytes(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_assets.stages", description=__doc__.splitlines()[0])
    parser.add_argument("stage", help="module under eagle3_assets.stages")
    parser.add_argument("--lock", required=True, help="the stage lock file on this host")
    parser.add_argument("--grace-s", type=float, default=20.0, help="time the stage gets to stop before SIGKILL")
    parser.add_argument(
        "--ray-job",
        action="store_true",
        help="run as a Ray job's entrypoint: the environment is the job's (its runtime_env), there is no stdin to read "
        "or watch, and Ray stops the job by signalling this process",
    )
    args = parser.parse_args(argv)
    stage = validate_stage_name(args.stage)

    if args.ray_job:
        env_additions = {}
    else:
        first = _read_first_line(0)
        if not first:
            emit_record(error="no environment line on stdin: the orchestrator went away before the stage started")
            return 2
        env_additions = json.loads(first).get("env", {})
    env = {**os.environ, **{str(k): str(v) for k, v in env_additions.items()}}

    module = f"{STAGE_PACKAGE}.{stage}"
    command = [sys.executable, "-m", module]
    lock = StageLock(args.lock)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {
        "pid": os.getpid(),
        "cmdline": " ".join([sys.executable, "-m", STAGE_PACKAGE, stage]),
        "stage": stage,
        "host": socket.gethostname(),
        "started_at": started_at,
        "run_id": _run_id(env),
    }
    holder = lock.try_acquire(record)
    if holder is not None:
        message = holder_line(args.lock, holder)
        emit_record(error=message)
        print(f"[stage runner] {message}", file=sys.stderr, flush=True)
        return LOCK_HELD_EXIT

    from dagster_pipes import DAGSTER_PIPES_MESSAGES_ENV_VAR, encode_param

    read_end, write_end = os.pipe()
    # The stage writes its Pipes messages to the pipe (the file writer opens the path per message).
    env[DAGSTER_PIPES_MESSAGES_ENV_VAR] = encode_param({"path": f"/dev/fd/{write_end}"})
    process = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr.fileno(),
        stderr=sys.stderr.fileno(),
        pass_fds=(write_end, lock.fd),
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    os.close(write_end)
    lock.update({**record, "stage_pid": process.pid, "stage_cmdline": " ".join(command)})
    emit_record(pid=os.getpid(), stage_pid=process.pid, pgid=process.pid, lock=args.lock)
    group = StageGroup(process, args.grace_s)

    def on_signal(signum, _frame):
        group.stop(f"runner received {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    def forward_messages() -> None:
        with os.fdopen(read_end, "rb") as messages:
            for line in messages:
                emit(line)

    def watch_stdin() -> None:
        # os.read, not sys.stdin: a daemon thread blocked in a buffered reader aborts interpreter shutdown.
        while os.read(0, 65536):
            pass
        if process.poll() is None:
            group.stop("stdin closed: the orchestrator stopped the run or went away")

    forwarder = threading.Thread(target=forward_messages, name="pipes-forwarder", daemon=True)
    forwarder.start()
    if not args.ray_job:  # a Ray job's stdin is not the orchestrator's: Ray's stop_job signals this process instead
        threading.Thread(target=watch_stdin, name="stdin-watchdog", daemon=True).start()

    returncode = process.wait()
    stopped = group.stopping.is_set()
    if _group_alive(process.pid):
        # Whatever the stage left running in its group would hold the SSH session (and the
        # stage lock) open after the stage is done: a stage leaves nothing behind.
        group.stop("the stage exited; stopping the processes it left running")
        deadline = time.monotonic() + args.grace_s + 10
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    # Messages written just before exit are still in the pipe: read them to the end (bounded,
    # in case a process that left the group still holds the pipe).
    forwarder.join(timeout=10)
    # Close, not unlock: an flock belongs to the open file, which processes the stage
    # started still share; the lock ends when the last of them exits.
    lock.close()
    emit_record(exit_code=returncode, stopped=stopped)
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main())
