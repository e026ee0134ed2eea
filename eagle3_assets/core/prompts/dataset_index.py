"""Indexes that let one shard of a prompt dataset be read without the rows before it.

Two small files per dataset, each stamped with the dataset's absolute path, size,
mtime (ns), inode and device, and trusted only while that stamp still matches:

- the **line index** of a JSONL file: the byte offset just past every newline, so
  row ``i`` is one seek away. Built in one sequential pass over the bytes (no JSON
  parsing); ``count_rows`` reads its header only.
- the **id index** (SQLite, one table ``id -> first usable row``): the shard's
  duplicate check ("has this id been used by an earlier row?") without re-reading
  the earlier rows. Built once by parsing every row; looked up per shard id.

A file that only grew by appending (same inode, and the last 4 KiB that were indexed
are unchanged) has its indexes extended from where they stopped instead of rebuilt.

Where: beside the dataset (``.<name>.lines``, ``.<name>.ids.sqlite``) when that
directory is writable, else under ``$EAGLE3_DATA_DIR/.cache/prompt_index/``. Both
are written to a temporary name and renamed into place, so a reader sees a whole
index or none; a published SQLite file is never modified again, so readers open it
``immutable`` (no locks: safe on NFS). A lock in the cache directory makes
concurrent shard runs wait for one builder instead of all parsing the dataset.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sqlite3
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_assets.core.storage.files import atomic_path, data_dir, stable_hash

LINE_INDEX_SUFFIX = "lines"
ID_INDEX_SUFFIX = "ids.sqlite"
CACHE_SUBDIR = Path(".cache") / "prompt_index"
_MAGIC = b"EAGLE3LI"
_FORMAT = 1
_HEADER_LEN = struct.Struct("<I")
_OFFSET = struct.Struct("<q")
_TAIL_BYTES = 4096
_SCAN_BLOCK = 1 << 20


@dataclass(frozen=True)
class FileStamp:
    """What identifies one version of a dataset file without reading it."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        path = Path(path).resolve()
        st = os.stat(path)
        return cls(str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


@dataclass(frozen=True)
class Prefix:
    """The first ``end`` bytes of a file as they were when indexed, recognised by their last bytes."""

    inode: int
    device: int
    end: int
    tail_sha256: str

    @classmethod
    def of(cls, path: Path, stamp: FileStamp, end: int) -> Prefix:
        return cls(stamp.inode, stamp.device, end, _tail_hash(path, end))

    def still_in(self, path: Path, stamp: FileStamp) -> bool:
        """Whether the file now is this prefix plus appended bytes (the common way a dataset grows)."""
        return (
            (stamp.inode, stamp.device) == (self.inode, self.device)
            and stamp.size >= self.end
            and _tail_hash(path, self.end) == self.tail_sha256
        )


def _tail_hash(path: Path, end: int) -> str:
    start = max(0, end - _TAIL_BYTES)
    with open(path, "rb") as fh:
        fh.seek(start)
        return hashlib.sha256(fh.read(end - start)).hexdigest()


def index_locations(dataset: Path, suffix: str) -> list[Path]:
    """Where an index of ``dataset`` may live, in order of preference."""
    dataset = Path(dataset).resolve()
    beside = dataset.parent / f".{dataset.name}.{suffix}"
    cached = data_dir() / CACHE_SUBDIR / f"{dataset.name}-{stable_hash(str(dataset))}.{suffix}"
    return [beside, cached]


def _publish(dataset: Path, suffix: str, write: Callable[[Path], None]) -> Path:
    """Write an index atomically at the first location that accepts it."""
    errors = []
    for location in index_locations(dataset, suffix):
        try:
            with atomic_path(location) as tmp:
                write(tmp)
            return location
        except OSError as exc:  # a read-only dataset directory: fall back to the data dir's cache
            errors.append(f"{location}: {exc}")
    raise OSError(f"cannot write the {suffix} index of {dataset} anywhere: " + "; ".join(errors))


@contextmanager
def _build_lock(dataset: Path, suffix: str) -> Iterator[None]:
    """One builder per index at a time; the others wait and then reuse its result."""
    lock = data_dir() / CACHE_SUBDIR / f"{Path(dataset).name}-{stable_hash(str(Path(dataset).resolve()))}.{suffix}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# ---------------------------------------------------------------- line index


@dataclass(frozen=True)
class LineIndex:
    """Row boundaries of a JSONL file; offsets are read from the index file on demand."""

    file: Path
    stamp: FileStamp
    complete_rows: int  # rows that end with a newline
    complete_end: int  # the byte just past them
    data_offset: int  # where the offsets start in ``file``
    how: str  # "reused", "extended" or "built": what obtaining it cost

    @property
    def rows(self) -> int:
        """Every row, the last one counted even without a final newline (as iterating the file does)."""
        return self.complete_rows + (1 if self.stamp.size > self.complete_end else 0)

    def end_of(self, rows: int) -> int:
        """Byte offset just past row ``rows - 1`` (0 for no rows)."""
        if rows <= 0:
            return 0
        if rows >= self.complete_rows:
            return self.complete_end if rows == self.complete_rows else self.stamp.size
        with open(self.file, "rb") as fh:
            fh.seek(self.data_offset + (rows - 1) * _OFFSET.size)
            return _OFFSET.unpack(fh.read(_OFFSET.size))[0]


def line_index(dataset: Path) -> LineIndex:
    """The line index of ``dataset`` as it is now: reused, extended after an append, or built."""
    stamp = FileStamp.of(dataset)
    found = _valid_line_index(dataset, stamp)
    if found:
        return found
    with _build_lock(dataset, LINE_INDEX_SUFFIX):
        stamp = FileStamp.of(dataset)
        found = _valid_line_index(dataset, stamp)  # another process may have built it meanwhile
        if found:
            return found
        ends, how = array("q"), "built"
        previous = _newest_line_index(dataset)
        if previous is not None and previous[1].still_in(Path(stamp.path), stamp):
            ends, how = previous[0], "extended"
        scan_from = ends[-1] if ends else 0
        _scan_newlines(Path(stamp.path), scan_from, stamp.size, ends)
        prefix = Prefix.of(Path(stamp.path), stamp, ends[-1] if ends else 0)
        header = json.dumps({"format": _FORMAT, "stamp": asdict(stamp), "prefix": asdict(prefix), "rows": len(ends)}).encode()
        if sys.byteorder == "big":
            ends.byteswap()
        payload = _MAGIC + _HEADER_LEN.pack(len(header)) + header

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as fh:
                fh.write(payload)
                ends.tofile(fh)

        file = _publish(dataset, LINE_INDEX_SUFFIX, write)
        return LineIndex(file, stamp, len(ends), prefix.end, len(payload), how)


def _scan_newlines(path: Path, start: int, stop: int, ends: array) -> None:
    """Append the offset just past every newline in bytes ``[start, stop)``: one sequential read."""
    with open(path, "rb") as fh:
        fh.seek(start)
        position = start
        while position < stop:
            block = fh.read(min(_SCAN_BLOCK, stop - position))
            if not block:
                break
            found = block.find(b"\n")
            while found != -1:
                ends.append(position + found + 1)
                found = block.find(b"\n", found + 1)
            position += len(block)


def _read_line_header(file: Path) -> tuple[dict, int] | None:
    try:
        with open(file, "rb") as fh:
            head = fh.read(len(_MAGIC) + _HEADER_LEN.size)
            if len(head) < len(_MAGIC) + _HEADER_LEN.size or head[: len(_MAGIC)] != _MAGIC:
                return None
            (length,) = _HEADER_LEN.unpack(head[len(_MAGIC) :])
            header = json.loads(fh.read(length))
            size = os.fstat(fh.fileno()).st_size
    except (OSError, ValueError):
        return None  # missing or damaged: rebuilt
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        return None
    data_offset = len(_MAGIC) + _HEADER_LEN.size + length
    if size != data_offset + header["rows"] * _OFFSET.size:
        return None  # truncated
    return header, data_offset


def _valid_line_index(dataset: Path, stamp: FileStamp) -> LineIndex | None:
    for file in index_locations(dataset, LINE_INDEX_SUFFIX):
        read = _read_line_header(file)
        if read and read[0]["stamp"] == asdict(stamp):
            return LineIndex(file, stamp, read[0]["rows"], read[0]["prefix"]["end"], read[1], "reused")
    return None


def _newest_line_index(dataset: Path) -> tuple[array, Prefix] | None:
    """The offsets and prefix of an index made for an earlier version of the file, if any."""
    best = None
    for file in index_locations(dataset, LINE_INDEX_SUFFIX):
        read = _read_line_header(file)
        if read and (best is None or read[0]["prefix"]["end"] > best[0]["prefix"]["end"]):
            best = (read[0], read[1], file)
    if best is None:
        return None
    header, data_offset, file = best
    ends = array("q")
    with open(file, "rb") as fh:
        fh.seek(data_offset)
        ends.frombytes(fh.read(header["rows"] * _OFFSET.size))
    if sys.byteorder == "big":
        ends.byteswap()
    return ends, Prefix(**header["prefix"])


# ---------------------------------------------------------------- id index


class IdIndex:
    """An open, read-only id index; close it (or use it in a ``with``) after the lookups."""

    def __init__(self, file: Path, db: sqlite3.Connection, rows: int, how: str):
        self.file = file
        self.rows = rows  # rows covered: [0, rows)
        self.how = how  # "reused", "extended" or "built"
        self._db = db

    def first_rows(self, ids: Iterable[str]) -> dict[str, int]:
        """For each of ``ids`` that some usable row carries, the first such row."""
        wanted = list(dict.fromkeys(ids))
        found: dict[str, int] = {}
        for i in range(0, len(wanted), 500):  # below SQLite's limit on bound parameters
            chunk = wanted[i : i + 500]
            query = f"SELECT id, first_row FROM ids WHERE id IN ({','.join('?' * len(chunk))})"
            found.update(self._db.execute(query, chunk).fetchall())
        return found

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> IdIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_readonly(file: Path) -> sqlite3.Connection:
    # immutable: a published index is never written again, so no locking (safe on NFS) and no journal lookups
    return sqlite3.connect(f"{file.resolve().as_uri()}?mode=ro&immutable=1", uri=True)


def id_index(
    dataset: Path,
    stamp: FileStamp,
    needed: int,
    extent: Callable[[], tuple[int, Prefix | None]],
    rules: str,
    usable_ids: Callable[[int, int], Iterable[tuple[int, str]]],
) -> IdIndex:
    """An index of the first usable row of every sample id, covering at least rows ``[0, needed)``.

    A new index covers ``extent()``: ``(rows, prefix)``, every row the file holds
    for good and the bytes they span (``prefix`` None: never extend, rebuild on
    change). ``usable_ids(a, b)`` yields ``(row, id)`` for the rows of ``[a, b)``
    that normalise; ``rules`` names the normalisation, so a change of it rebuilds.
    """
    wanted = {"stamp": asdict(stamp), "rules": rules}
    found = _valid_id_index(dataset, wanted, needed)
    if found:
        return found
    with _build_lock(dataset, ID_INDEX_SUFFIX):
        found = _valid_id_index(dataset, wanted, needed)
        if found:
            return found
        rows, prefix = extent()
        previous = _extendable_id_index(dataset, stamp, rules, rows)
        meta = {**wanted, "rows": rows, "prefix": asdict(prefix) if prefix else None}

        def write(tmp: Path) -> None:
            if previous is not None:
                shutil.copyfile(previous[0], tmp)
            db = sqlite3.connect(tmp)
            try:
                if previous is None:
                    db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, first_row INTEGER NOT NULL) WITHOUT ROWID")
                    db.execute("CREATE TABLE meta (json TEXT NOT NULL)")
                start = previous[1] if previous is not None else 0
                # rows arrive in order, so the first insert of an id is its first row
                db.executemany("INSERT OR IGNORE INTO ids VALUES (?, ?)", ((i, r) for r, i in usable_ids(start, rows)))
                db.execute("DELETE FROM meta")
                db.execute("INSERT INTO meta VALUES (?)", (json.dumps(meta),))
                db.commit()
            finally:
                db.close()

        file = _publish(dataset, ID_INDEX_SUFFIX, write)
        return IdIndex(file, _open_readonly(file), rows, "extended" if previous is not None else "built")


def _id_meta(file: Path, keep_open: bool = False) -> tuple[dict, sqlite3.Connection | None] | None:
    if not file.is_file():
        return None
    db = None
    try:
        db = _open_readonly(file)
        (raw,) = db.execute("SELECT json FROM meta").fetchone()
        meta = json.loads(raw)
    except (sqlite3.Error, TypeError, ValueError):
        if db is not None:
            db.close()
        return None  # damaged: rebuilt
    if not keep_open:
        db.close()
        db = None
    return meta, db


def _valid_id_index(dataset: Path, wanted: dict, rows: int) -> IdIndex | None:
    for file in index_locations(dataset, ID_INDEX_SUFFIX):
        found = _id_meta(file, keep_open=True)
        if found is None:
            continue
        meta, db = found
        if {k: meta.get(k) for k in wanted} == wanted and meta["rows"] >= rows:
            return IdIndex(file, db, meta["rows"], "reused")
        db.close()
    return None


def _extendable_id_index(dataset: Path, stamp: FileStamp, rules: str, rows: int) -> tuple[Path, int] | None:
    """An index of an earlier version of the file whose rows are all still there unchanged."""
    for file in index_locations(dataset, ID_INDEX_SUFFIX):
        found = _id_meta(file)
        meta = found[0] if found else None
        if not meta or meta.get("rules") != rules or not meta.get("prefix") or meta["rows"] > rows:
            continue
        if Prefix(**meta["prefix"]).still_in(Path(stamp.path), stamp):
            return file, meta["rows"]
    return None
