"""One writer per shard: an exclusive lease file beside the shard's files.

Every stage that writes a shard's files (``prompts``, ``raw_responses``,
``validated_traces`` on the orchestrator; ``extract_hidden_states`` on the GPU
host) holds ``<asset dir>/<shard>.lease`` while it writes. Two runs of one shard
(a pool limit of 2, a double click, a backfill beside a manual run) would
otherwise both generate everything and race on the same files.

The lease is a JSON record: run id, host, pid, the process's start time (so a
recycled pid is not mistaken for the holder), when it was taken and a
heartbeat the holder refreshes. A second writer:

- finds no lease: creates it (written whole, then renamed into place, under a
  short ``flock`` on ``<lock dir>/<asset>.leases.guard`` (``shard_paths.lock_dir``), so that two
  takers never both win);
- finds a live holder on this host: fails at once with a message naming the
  holding run, host and pid (failing at once is honest: a wait would hold a
  pool slot doing nothing);
- finds a holder that is gone (pid not running, or running a different
  process): takes the lease over and says so in the log;
- finds a holder on another host, which it cannot probe: refuses, unless the
  holder's heartbeat is older than ``$EAGLE3_LEASE_STALE_AFTER_S`` (default
  900 s; the holder refreshes it every 60 s) or the operator names that host in
  ``$EAGLE3_LEASE_TAKEOVER`` (comma separated; ``*`` for any).

Whoever holds the lease is the shard's only writer, so every temporary file
of that shard (``.<shard>.*.partial`` beside the shard's files, ``*.partial``
inside ``<asset dir>/<shard>/``) is a leftover of a writer that died: the new
holder removes them, one log line per file.

Standard library only: the GPU host's pre-flight (sent to the host as source)
imports it where the package is installed, to tell a dead holder's leftovers
from a live writer's files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from eagle3_assets.core.settings.environment import LEASE_STALE_AFTER_S, LEASE_TAKEOVER
from eagle3_assets.core.storage.shard_paths import lease_path, lock_dir, shard_partials

GUARD_SUFFIX = ".leases.guard"
TAKEOVER_ENV = LEASE_TAKEOVER.name
HEARTBEAT_S = 60.0

# What lease_state() says about an existing lease.
ABSENT, LIVE, DEAD, REMOTE, STALE = "absent", "live", "dead", "remote", "stale"


class ShardBusyError(RuntimeError):
    """Another live writer holds the shard's lease; the message names it and what to do."""


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), or None when it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    if not fields or fields[0] == "Z":  # a zombie has exited
        return None
    return int(fields[19])


def read_lease(path: Path | str) -> dict[str, Any] | None:
    """The lease's record, None when there is none; an unreadable lease reads as an empty record (a dead writer's)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def lease_state(record: Mapping[str, Any] | None, *, now: float | None = None, stale_after_s: float | None = None) -> str:
    """``absent``, ``live`` (holder runs on this host), ``dead``, ``remote`` (another host, fresh) or ``stale``."""
    if record is None:
        return ABSENT
    if not record.get("host") or not isinstance(record.get("pid"), int):
        return DEAD  # a record that cannot name a holder names no live one
    if record["host"] != socket.gethostname():
        takeover = set(LEASE_TAKEOVER.get())
        if "*" in takeover or record["host"] in takeover:
            return STALE
        limit = stale_after_s if stale_after_s is not None else LEASE_STALE_AFTER_S.get()
        beat = float(record.get("heartbeat_at") or record.get("started_at_s") or 0)
        return STALE if (now or time.time()) - beat > limit else REMOTE
    ticks = process_start_ticks(record["pid"])
    if ticks is None or (record.get("pid_start") is not None and ticks != record["pid_start"]):
        return DEAD
    return LIVE


def describe(record: Mapping[str, Any]) -> str:
    """``run abc on host h (pid 123) since 2025-...``: the holder in the words an operator needs."""
    return (
        f"run {record.get('run_id') or 'unknown'} on host {record.get('host', '?')} (pid {record.get('pid', '?')}) "
        f"since {record.get('started_at', '?')}"
    )


def lapse(asset_dir: Path | str, key: str, *, run_id: str | None, why: str, log: Callable[[str], None] = print) -> bool:
    """End the lease of ``key`` that run ``run_id`` holds through a writer known to be gone; whether one was ended.

    For a coordinator that handed the shard to a writer on another node and was
    told by the cluster that the writer died (a Ray node lost): the lease would
    otherwise read as a remote, fresh holder until its heartbeat went stale
    (``$EAGLE3_LEASE_STALE_AFTER_S``), and the rerun that should finish the
    shard would be refused. Only this run's lease of that shard is ended: the
    run handed the shard to that one writer alone. Its partial files stay for
    the next holder to remove, each logged.
    """
    if not run_id:
        return False
    asset_dir = Path(asset_dir)
    path = lease_path(asset_dir, key)
    with _guard_of(asset_dir):
        record = read_lease(path)
        if not record or record.get("run_id") != run_id:
            return False
        path.unlink(missing_ok=True)
    log(f"{key}: lease of {describe(record)} ended: {why}")
    return True


class ShardLease:
    """``with ShardLease(asset_dir, key, asset=..., run_id=..., log=...):`` the shard's files are yours to write."""

    def __init__(
        self,
        asset_dir: Path | str,
        key: str,
        *,
        asset: str,
        run_id: str | None = None,
        log: Callable[[str], None] = print,
        stale_after_s: float | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ):
        self.asset_dir = Path(asset_dir)
        self.key = key
        self.asset = asset
        self.run_id = run_id
        self.log = log
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.path = lease_path(self.asset_dir, key)
        self.token = uuid.uuid4().hex
        self.record: dict[str, Any] = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------ taking
    def acquire(self) -> ShardLease:
        self.asset_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.record = {
            "asset": self.asset,
            "shard": self.key,
            "run_id": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": process_start_ticks(os.getpid()),
            "started_at": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            "started_at_s": now,
            "heartbeat_at": now,
            "token": self.token,
        }
        with self._guard():
            previous = read_lease(self.path)
            state = lease_state(previous, now=now, stale_after_s=self.stale_after_s)
            if state == LIVE:
                raise ShardBusyError(
                    f"{self.key} of {self.asset} is being written by {describe(previous)}; "
                    f"wait for it or cancel that run (lease {self.path})"
                )
            if state == REMOTE:
                raise ShardBusyError(
                    f"{self.key} of {self.asset} is being written by {describe(previous)}, on another host this one cannot probe "
                    f"(lease {self.path}, heartbeat {now - float(previous.get('heartbeat_at') or 0):.0f}s ago); wait for it, or, if that "
                    f"host's run is gone, set {TAKEOVER_ENV}={previous.get('host')} to take the shard over"
                )
            self._write(self.record)
        if state in (DEAD, STALE):
            self.log(f"{self.key}: took over the lease of {describe(previous)}, which is gone ({state})")
        self._remove_leftovers()
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease-{self.key}", daemon=True)
        self._beat.start()
        return self

    def _remove_leftovers(self) -> None:
        """Temporary files of this shard: only a writer that died can have left them (we are its only writer)."""
        for path in shard_partials(self.asset_dir, self.key):
            size = path.stat().st_size if path.is_file() else None
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            self.log(f"{self.key}: removed {path} ({'a directory' if size is None else f'{size} bytes'}), left by an interrupted writer of the shard")

    # --------------------------------------------------------------- holding
    def _heartbeat(self) -> None:
        # A holder on another host is only judged by this: keep it fresh while the work runs.
        while not self._stop.wait(self.heartbeat_s):
            try:
                with self._guard():
                    current = read_lease(self.path)
                    if not current or current.get("token") != self.token:
                        return  # taken over (an operator's decision): nothing of ours to refresh
                    self.record["heartbeat_at"] = time.time()
                    self._write(self.record)
            except OSError:
                pass  # a missed beat is harmless; the next one retries

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        with self._guard():
            current = read_lease(self.path)
            if current and current.get("token") == self.token:
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShardLease:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

    # --------------------------------------------------------------- helpers
    def _write(self, record: Mapping[str, Any]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{self.token}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(dict(record), sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def _guard(self):
        return _guard_of(self.asset_dir)


def _guard_of(asset_dir: Path) -> _Guard:
    # Beside the stage locks (the one lock directory), not among the shard's files: an asset's directory holds its outputs.
    locks = lock_dir(asset_dir.parent)
    locks.mkdir(parents=True, exist_ok=True)
    return _Guard(locks / f"{asset_dir.name}{GUARD_SUFFIX}")


class _Guard:
    """An ``flock`` held for the few milliseconds of a lease decision; the kernel drops it if we die."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> _Guard:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                return self
            except OSError as exc:  # interrupted by a signal: try again
                if exc.errno != errno.EINTR:
                    os.close(self.fd)
                    raise

    def __exit__(self, *exc_info) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
