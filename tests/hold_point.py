"""Fault injection: a process of the product held at a named call until the test kills it there.

A kill that polls for a file and then signals lands wherever the process has got
to by then: on a loaded machine the work can finish first, on a fast one the
kill lands earlier than meant. A :class:`HoldPoint` instead stops the process
at the call the test names (tests/hold_point_site/sitecustomize.py does it in
the process; see there for the settings), tells the test which process it is,
and waits; the test's SIGKILL then lands exactly there. It reaches processes the
test does not start itself (a GPU host's stage under a Dagster run): every Python
process started with :meth:`HoldPoint.env` in its environment carries it, and
the first one to reach the call is held.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

SITE = Path(__file__).resolve().parent / "hold_point_site"


class HoldPoint:
    """``target`` is ``module:Qualified.name``; the ``call``-th call (of those with an argument containing ``matching``) is held ``when``."""

    def __init__(self, target: str, *, call: int = 1, when: str = "after", matching: str = ""):
        assert when in ("before", "after"), when
        self.settings = {
            "EAGLE3_TEST_HOLD_AT": target,
            "EAGLE3_TEST_HOLD_CALL": str(call),
            "EAGLE3_TEST_HOLD_WHEN": when,
            "EAGLE3_TEST_HOLD_MATCH": matching,
            "EAGLE3_TEST_HOLD_SOCKET": f"eagle3-hold-{uuid.uuid4().hex}",
        }
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind("\0" + self.settings["EAGLE3_TEST_HOLD_SOCKET"])
        self.server.listen(1)
        self.connection: socket.socket | None = None
        self.pid: int | None = None
        self.killed = False

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with the hold's settings, and its sitecustomize first on ``PYTHONPATH``."""
        path = os.pathsep.join(filter(None, [str(SITE), base.get("PYTHONPATH")]))
        return {**base, **self.settings, "PYTHONPATH": path}

    def wait(self, still_going: Callable[[], bool], what: str, timeout_s: float = 600) -> int:
        """Block until a process is held at the call; its pid. Fails within a second once ``still_going()`` turns false."""
        deadline = time.monotonic() + timeout_s
        self.server.settimeout(1.0)
        while self.connection is None:
            try:
                self.connection, _ = self.server.accept()
            except TimeoutError:
                assert still_going(), f"{what}: the process ended before it reached {self.settings['EAGLE3_TEST_HOLD_AT']}"
                assert time.monotonic() < deadline, f"{what}: not reached within {timeout_s:.0f}s"
        self.connection.settimeout(None)
        report = json.loads(self.connection.makefile().readline())
        self.pid = report["pid"]
        return self.pid

    def kill(self) -> None:
        """SIGKILL the held process, where it is held, and return once it is gone."""
        assert self.pid is not None, "nothing is held"
        if self.killed:
            return
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # already gone (reaped)
            self.killed = True
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            select.select([pidfd], [], [])  # readable once the process has exited
            self.killed = True
        finally:
            os.close(pidfd)

    def __enter__(self) -> HoldPoint:
        return self

    def __exit__(self, *exc_info) -> None:
        """A process still held (an assertion failed before the kill) is killed there too: none is left held or let go on."""
        if self.pid is not None:
            self.kill()
        if self.connection is not None:
            self.connection.close()
        self.server.close()


class CallRecord:
    """Records every call of the named product functions, in every Python process started with :meth:`env` or under :meth:`patch_environ`.

    ``targets``: ``module:Qualified.name`` each. The record is written by the
    test's own wrap (tests/hold_point_site/sitecustomize.py), not by the
    product, so it counts what the product did, not what it says it did.
    """

    def __init__(self, path: Path, *targets: str):
        self.path = Path(path)
        self.settings = {"EAGLE3_TEST_RECORD_AT": ",".join(targets), "EAGLE3_TEST_RECORD_FILE": str(self.path)}

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with the record's settings, and its sitecustomize first on ``PYTHONPATH``."""
        path = os.pathsep.join(filter(None, [str(SITE), base.get("PYTHONPATH")]))
        return {**base, **self.settings, "PYTHONPATH": path}

    def patch_environ(self, monkeypatch) -> None:
        """This process's environment, for the processes it starts (a GPU host's stage under an in-process run)."""
        for key, value in self.env(os.environ).items():
            monkeypatch.setenv(key, value)

    def calls(self, target: str | None = None) -> list[dict]:
        """The calls recorded so far (of ``target`` only, when given), oldest first."""
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [row for row in rows if target is None or row["at"] == target]
