"""Where assets write, and how: atomically, so a crash never leaves a half file behind.

Every asset writes under ``$EAGLE3_DATA_DIR/<asset name>/`` (default ``./data``) and
per-shard files are named by their shard key. A file is written to a temporary
name in the same directory and renamed into place; a reader sees the old file or
the new one, never a prefix.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.settings.environment import DATA_DIR
from eagle3_assets.core.storage.shard_paths import PARTIAL_SUFFIX, data_dir

if TYPE_CHECKING:  # polars is read where a frame is written, not on import: a GPU host's extraction and training need none
    import polars as pl

DATA_DIR_ENV = DATA_DIR.name


def asset_dir(asset_name: str, root: Path | None = None) -> Path:
    path = (root or data_dir()) / asset_name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _create_unique(parent: Path, prefix: str, suffix: str, create) -> Path:
    """Create a new entry under a fresh random name with ``create(path)``; retry on a name clash."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            create(path)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary name in {parent} for {prefix}*{suffix}")


def _new_file(path: Path) -> None:
    # Mode 0o666 lets the kernel apply the process's umask (and any default ACL),
    # as a plain open() would: tempfile.mkstemp's 0600 would survive the rename and
    # hide every output from the group that serves or trains on it.
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))


def staging_dir(final: Path, suffix: str = PARTIAL_SUFFIX) -> Path:
    """A new empty directory beside ``final``, to be filled and renamed onto it.

    Created with mode 0o777 less the umask (tempfile.mkdtemp's 0700 would survive the rename).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return _create_unique(final.parent, f".{final.name}.", suffix, lambda p: os.mkdir(p, 0o777))


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it into place only on success.

    The file gets the mode a plain ``open()`` would give (0o666 less the umask).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_unique(final.parent, f".{final.name}.", PARTIAL_SUFFIX, _new_file)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a file's creation, rename or removal in ``path`` itself durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(final: Path, payload: bytes) -> None:
    with atomic_path(final) as tmp:
        tmp.write_bytes(payload)


def write_json_atomic(final: Path, obj: Any) -> None:
    write_bytes_atomic(final, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_parquet_atomic(final: Path, frame: pl.DataFrame) -> None:
    with atomic_path(final) as tmp:
        frame.write_parquet(tmp)


def stable_hash(obj: Any, length: int = 16) -> str:
    """A short content hash of a JSON-serialisable object (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def file_hash(path: Path, length: int = 16) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:length]
