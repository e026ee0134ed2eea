"""An append-only, fsync'd JSONL journal of one shard's finished requests.

Generation is the slowest and costliest stage (hours of a large GPU server), so
every response is made durable as it arrives, and a rerun of the shard
asks the server only for the ids that are not durable yet (resume by sample
id, never by line count). When every id of the shard has a row, the journal is
turned into the shard's Parquet file (written to a temporary name, renamed into
place) and removed.

File layout: the first line is a header naming the *fingerprint* of what the
rows were made from (prompts, model, sampling); each further line is one
finished row. A process killed mid-write (SIGKILL, power loss) leaves at most a
torn last line, which is dropped and truncated away when the journal is reopened.
A journal whose fingerprint is not the current one (the sampling parameters or
the prompts changed) is set aside, never mixed into the new run. The header is
written atomically: the journal comes into being complete with its header (a
temporary file linked into place, which fails if the name exists), so there is
never a journal without a header, nor one with two. A header line anywhere but
the first line, or a row without an id, is a corrupt journal, named as such.

A finished shard's Parquet with another fingerprint is never overwritten: it is
moved to ``superseded/<shard>.<fingerprint>.parquet`` with a JSON sidecar that
says which generation settings made it (:func:`keep_superseded`).

Each row is written to the file (the operating system's page cache) the moment
it is appended, so it survives the process being killed at any moment; a syncer
thread ``fsync``s the file every ``sync_interval_s`` (1 s) when rows were
written, and on close, so a power loss costs at most about the last second
(group commit, as databases do). The syncer stays off the hot path on purpose:
a design that handed every row to a writer thread which fsync'd each batch
measured 0.67 to 0.74 of the bare client's responses/s in bench/generation.py
(P2) on a busy 2-core machine, this one 0.82 to 0.93 (a write issued while an
fsync of the same file runs waits for it, and each wake-up of a thread is a
hand-over of Python's GIL).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.storage.shard_paths import superseded_path
from eagle3_assets.core.storage.files import PARTIAL_SUFFIX, atomic_path, fsync_dir, write_json_atomic

JOURNAL_FORMAT = 1
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # built once: used per row
FINGERPRINT_METADATA_KEY = "eagle3.fingerprint"
# JSON of the settings that made a finished shard (what generation sent, and its retry policy).
GENERATION_METADATA_KEY = "eagle3.generation"


class JournalCorruptError(RuntimeError):
    """A line other than the last cannot be parsed: the file was edited or damaged, not torn by a crash."""


class ShardJournal:
    """The journal of one shard: ``load`` what is durable, ``append`` new rows, ``finalize`` into Parquet."""

    def __init__(self, path: Path, fingerprint: str, *, key: str = "id", sync_interval_s: float = 1.0):
        self.path = Path(path)
        self.sync_interval_s = sync_interval_s
        self.fingerprint = fingerprint
        self.key = key
        self._fd: int | None = None
        self._unsynced = False  # rows written since the last fsync began
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        self._sync_error: BaseException | None = None
        self.set_aside: Path | None = None  # where a journal of another fingerprint was moved, if any

    # ---------------------------------------------------------------- reading
    def load(self) -> dict[str, dict[str, Any]]:
        """The latest durable row of every id (a later row of an id replaces an earlier one).

        A torn last line is dropped and cut off the file, so that the next
        append starts on a clean line. A journal written for another
        fingerprint is renamed aside (``*.stale.jsonl``) and nothing is loaded.
        """
        if not self.path.exists():
            return {}
        raw = self.path.read_bytes()
        complete_end = raw.rfind(b"\n") + 1  # bytes after the last newline are a torn write
        lines = raw[:complete_end].splitlines()
        rows: dict[str, dict[str, Any]] = {}
        if not lines:
            self._truncate(0)
            return rows
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("journal") != JOURNAL_FORMAT:
            raise JournalCorruptError(f"{self.path}: line 1 is not a journal header; move the file away to start the shard afresh")
        if header.get("fingerprint") != self.fingerprint:
            self.set_aside = self.path.with_name(f"{self.path.name.removesuffix('.jsonl')}.{header.get('fingerprint')}.stale.jsonl")
            os.replace(self.path, self.set_aside)
            return {}
        for number, line in enumerate(lines[1:], start=2):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise JournalCorruptError(f"{self.path}, line {number}: not JSON ({exc.msg}); the journal was damaged") from None
            if isinstance(row, dict) and "journal" in row and self.key not in row:
                raise JournalCorruptError(
                    f"{self.path}, line {number}: a second journal header (two runs wrote this shard's journal, or "
                    "journals were joined); its rows cannot be trusted. Move the file aside (it is not needed: the "
                    "shard's finished Parquet, if any, is untouched) and materialise the shard again"
                )
            if not isinstance(row, dict) or not isinstance(row.get(self.key), str):
                raise JournalCorruptError(f"{self.path}, line {number}: not a row with an {self.key!r}; the journal was damaged")
            rows[row[self.key]] = row
        if complete_end < len(raw):
            self._truncate(complete_end)
        return rows

    def _truncate(self, size: int) -> None:
        with open(self.path, "rb+") as fh:
            fh.truncate(size)
            os.fsync(fh.fileno())

    # ---------------------------------------------------------------- writing
    def open(self, seed_rows: Iterable[Mapping[str, Any]] = ()) -> ShardJournal:
        """Open for appending; a new journal comes into being with its header (and ``seed_rows``), durably."""
        if self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()  # an empty file holds nothing (load() cut it to nothing): make it afresh
        if not self.path.exists():
            self._create(seed_rows)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._stop.clear()
        self._syncer = threading.Thread(target=self._sync_loop, name=f"journal-{self.path.name}", daemon=True)
        self._syncer.start()
        return self

    def _create(self, seed_rows: Iterable[Mapping[str, Any]]) -> None:
        """Write header and seed rows to a temporary file, then link it to the journal's name.

        ``os.link`` fails when the name exists, so two writers can never both
        write a header into one journal (as an ``O_APPEND`` open of a missing
        file followed by a header write could), and a crash leaves either no
        journal or a complete header.
        """
        header = {"journal": JOURNAL_FORMAT, "fingerprint": self.fingerprint}
        fd, tmp_name = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=PARTIAL_SUFFIX, dir=self.path.parent)
        try:
            _write_all(fd, _line(header) + b"".join(_line(row) for row in seed_rows))
            os.fsync(fd)
            os.close(fd)
            fd = -1
            try:
                os.link(tmp_name, self.path)
            except FileExistsError:
                raise JournalCorruptError(
                    f"{self.path}: another run created this journal at the same moment; only one run may generate "
                    "a shard at a time. Materialise the shard again once the other run has ended"
                ) from None
            fsync_dir(self.path.parent)
        finally:
            if fd >= 0:
                os.close(fd)
            os.unlink(tmp_name)

    def append(self, row: Mapping[str, Any]) -> None:
        """Write one row now: it survives a killed process at once, a power loss after the next fsync."""
        if self._fd is None:
            raise RuntimeError(f"journal {self.path} is not open")
        if self._sync_error is not None:
            raise OSError(f"journal {self.path}: fsync failed: {self._sync_error}") from self._sync_error
        _write_all(self._fd, _line(row))
        self._unsynced = True

    def close(self) -> None:
        """Fsync what was written, stop the syncer, close the file; raise if an fsync failed."""
        if self._syncer is not None:
            self._stop.set()
            self._syncer.join()
            self._syncer = None
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
        if self._sync_error is not None:
            raise OSError(f"journal {self.path}: fsync failed: {self._sync_error}") from self._sync_error

    def _sync_loop(self) -> None:
        try:
            while not self._stop.wait(self.sync_interval_s):
                if self._unsynced:
                    self._unsynced = False  # a row written from here on is covered by this fsync or the next
                    os.fsync(self._fd)
        except BaseException as exc:  # surfaced by append()/close() in the caller's thread
            self._sync_error = exc

    def __enter__(self) -> ShardJournal:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------- finishing
    def finalize(
        self,
        parquet_path: Path,
        ids: Sequence[str],
        rows: Mapping[str, Mapping[str, Any]],
        schema: Mapping[str, pl.DataType],
        generation: Mapping[str, Any] | None = None,
    ) -> pl.DataFrame:
        """Write exactly one row per id (in ``ids`` order) to ``parquet_path`` atomically, then drop the journal.

        The fingerprint goes into the Parquet file's metadata, so that a later
        run of the same shard with the same inputs can tell the file is its own,
        and so do the ``generation`` settings, so that the file says what made it.
        A finished file of another fingerprint is kept (:func:`keep_superseded`)
        by the caller before this replaces it.
        """
        missing = [i for i in ids if i not in rows]
        if missing:
            raise ValueError(f"{self.path}: cannot finalise, {len(missing)} ids have no row (first: {missing[:5]})")
        frame = pl.DataFrame([{name: rows[i].get(name) for name in schema} for i in ids], schema=dict(schema))
        metadata = {FINGERPRINT_METADATA_KEY: self.fingerprint}
        if generation is not None:
            metadata[GENERATION_METADATA_KEY] = json.dumps(generation, sort_keys=True)
        with atomic_path(parquet_path) as tmp:
            frame.write_parquet(tmp, metadata=metadata)
        self.path.unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        return frame


def parquet_fingerprint(path: Path) -> str | None:
    """The fingerprint a finalised shard was written with, or None (no file, or written without one)."""
    if not Path(path).is_file():
        return None
    return pl.read_parquet_metadata(path).get(FINGERPRINT_METADATA_KEY)


def parquet_generation(path: Path) -> dict[str, Any] | None:
    """The generation settings a finalised shard records, or None (no file, or written without them)."""
    if not Path(path).is_file():
        return None
    recorded = pl.read_parquet_metadata(path).get(GENERATION_METADATA_KEY)
    return json.loads(recorded) if recorded else None


def keep_superseded(parquet_path: Path, new_fingerprint: str, new_generation: Mapping[str, Any] | None = None) -> Path | None:
    """Move a finished shard of another fingerprint out of the way instead of overwriting it; return where it went.

    The file goes to ``superseded/<shard>.<its fingerprint>.parquet`` (a
    numbered name if that one is taken: nothing is ever overwritten), beside a
    ``.json`` sidecar naming its settings, the settings that replaced it and
    when. Readers of ``<shard>.parquet`` never see it there. Nothing deletes
    it: removing a finished generation is the operator's decision.
    """
    parquet_path = Path(parquet_path)
    old_fingerprint = parquet_fingerprint(parquet_path)
    if not parquet_path.is_file() or old_fingerprint == new_fingerprint:
        return None
    target = superseded_path(parquet_path, old_fingerprint or "unknown")
    target.parent.mkdir(parents=True, exist_ok=True)
    number = 1
    while target.exists() or target.with_suffix(".json").exists():
        number += 1
        target = superseded_path(parquet_path, f"{old_fingerprint or 'unknown'}-{number}")
    sidecar = {
        "shard_file": parquet_path.name,
        "fingerprint": old_fingerprint,
        "generation": parquet_generation(parquet_path),
        "rows": pl.scan_parquet(parquet_path).select(pl.len()).collect().item(),
        "superseded_by": {"fingerprint": new_fingerprint, "generation": dict(new_generation) if new_generation else None},
        "superseded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json_atomic(target.with_suffix(".json"), sidecar)
    os.replace(parquet_path, target)
    fsync_dir(target.parent)
    fsync_dir(parquet_path.parent)
    return target


def _write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]


def _line(row: Mapping[str, Any]) -> bytes:
    return (_JSON.encode(row) + "\n").encode()


