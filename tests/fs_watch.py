"""A directory tree watched from outside the product with Linux inotify: every create, write, rename and delete.

Used to measure what a stage keeps on disk without trusting the stage's own
report and without polling (a poll can miss a short-lived peak). The kernel
queues one event per change; this watcher replays them in order and keeps the
tree's files and their sizes, so the peak it reports is the largest the tree
held at any event. A file's size is read when its event is handled, which can
only be later (and larger) than at the event: the peak errs on the high side.
A file created and deleted before its first event is handled is not counted;
the files it is used on (a shard's parts, kept while they are trained from)
live for seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
from pathlib import Path

IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x8, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_IGNORED, IN_Q_OVERFLOW, IN_ISDIR = 0x100, 0x200, 0x400, 0x8000, 0x4000, 0x40000000
MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
HEADER = struct.Struct("iIII")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class TreeWatcher(threading.Thread):
    """Watches ``root`` (created later is fine: its parent is watched until it appears) and everything under it."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root = Path(root)
        self.fd = _libc.inotify_init()
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init failed")
        self.stop_r, self.stop_w = os.pipe()
        self.paths: dict[int, Path] = {}  # watch descriptor -> directory
        self.sizes: dict[Path, int] = {}  # every file under root -> its size when last seen
        self.dirs: set[Path] = set()  # the root's direct subdirectories
        self.names: set[str] = set()  # every direct subdirectory name ever seen
        self.peak_bytes = self.peak_dirs = self.events = 0
        self.overflowed = False
        self._watch(self.root.parent)
        if self.root.is_dir():
            self._adopt(self.root)

    def _watch(self, directory: Path) -> None:
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(directory), MASK)
        if wd >= 0:
            self.paths[wd] = directory

    def _adopt(self, directory: Path) -> None:
        """Watches a directory, then takes in what is already in it (created before its watch existed)."""
        self._watch(directory)
        if directory.parent == self.root:
            self.dirs.add(directory)
            self.names.add(directory.name)
        try:
            entries = list(directory.iterdir())
        except FileNotFoundError:
            return
        # A directory is adopted again when its create event was queued before an earlier look took it in. What that
        # look saw and is gone now (a .tmp renamed to its final name) would otherwise count beside its successor until
        # its own queued event is handled: a peak the tree never held.
        present = set(entries)
        known = {directory / p.relative_to(directory).parts[0] for p in [*self.sizes, *self.dirs] if directory in p.parents}
        for gone in known - present:
            self._forget(gone)
        for entry in entries:
            if entry.is_dir():
                self._adopt(entry)
            else:
                self._seen_file(entry)

    def _seen_file(self, path: Path) -> None:
        try:
            self.sizes[path] = path.stat().st_size
        except FileNotFoundError:
            pass  # already gone: its delete event follows

    def _forget(self, path: Path) -> None:
        self.sizes.pop(path, None)
        for known in [p for p in self.sizes if path in p.parents]:
            del self.sizes[known]
        self.dirs.discard(path)

    def _handle(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self.overflowed = True
            return
        directory = self.paths.get(wd)
        if directory is None or mask & IN_IGNORED:
            return
        path = directory / name if name else directory
        if directory == self.root.parent:  # only the root's own appearance matters there
            if name == self.root.name and mask & (IN_CREATE | IN_MOVED_TO) and mask & IN_ISDIR:
                self._adopt(self.root)
        elif mask & (IN_DELETE | IN_MOVED_FROM | IN_DELETE_SELF):
            self._forget(path)
        elif mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            self._adopt(path)
        elif not mask & IN_ISDIR and mask & (IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO):
            self._seen_file(path)
        self.events += 1
        self.peak_bytes = max(self.peak_bytes, sum(self.sizes.values()))
        self.peak_dirs = max(self.peak_dirs, len(self.dirs))

    def run(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd, self.stop_r], [], [])
            if self.fd in ready:
                self._drain()
            elif self.stop_r in ready:
                self._drain(block=False)
                return

    def _drain(self, block: bool = True) -> None:
        while True:
            if not block and not select.select([self.fd], [], [], 0)[0]:
                return
            buffer = os.read(self.fd, 1 << 16)
            offset = 0
            while offset < len(buffer):
                wd, mask, _cookie, length = HEADER.unpack_from(buffer, offset)
                offset += HEADER.size
                name = buffer[offset : offset + length].rstrip(b"\0").decode()
                offset += length
                self._handle(wd, mask, name)
            if block:
                return

    def finish(self) -> None:
        """Handles every event queued so far, then stops."""
        os.write(self.stop_w, b"x")
        self.join()
        os.close(self.fd)
        os.close(self.stop_r)
        os.close(self.stop_w)
