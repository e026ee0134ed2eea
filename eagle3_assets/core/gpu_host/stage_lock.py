"""The stage lock: one run of a stage at a time on a host, held by the stage runner and inherited by the stage.

Standard library only: the stage runner (``python -m eagle3_assets.stages``)
takes it on the host before anything else is imported.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from eagle3_assets.core.gpu_host.preflight import describe_holder, read_lock_record


class StageLock:
    """A per-stage lock file on the host: ``flock`` held by the stage runner and inherited by the stage.

    The kernel drops an ``flock`` when the last process holding it exits, so a
    crashed run never leaves a stale lock; the file's content (JSON: PIDs,
    command line, run id, start time) only describes the current holder while
    the lock is held.
    """

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def try_acquire(self, holder: Mapping[str, Any], attempts: int = 5, wait_s: float = 0.2) -> dict | None:
        """Take the lock and record ``holder``; return None, or the live holder's record when it is taken.

        Retries briefly: a pre-flight probing the lock holds it for a moment.
        """
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        for attempt in range(attempts):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if attempt == attempts - 1:
                    os.close(fd)
                    return describe_holder(read_lock_record(self.path))
                time.sleep(wait_s)
        self.fd = fd
        self.update(holder)
        return None

    def update(self, holder: Mapping[str, Any]) -> None:
        assert self.fd is not None, "update() needs the lock"
        payload = json.dumps(dict(holder), sort_keys=True).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, payload, 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Unlock for every process sharing the lock file (also ones that inherited it)."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.close()

    def close(self) -> None:
        """Drop this process's hold; the lock stays while an inheriting process still holds it open."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
