"""Shard files are verified before they are trusted, and a corrupt one is moved aside, never silently reused.

A later stage reads a shard's Parquet through :func:`read_shard_parquet` or
:func:`verify_shard_parquet`: a truncated or damaged file (a disk fault, a
copy cut short, a hand edit) then fails with a :class:`ShardFileError` that
names the file, the shard, the asset that wrote it and what to do, instead of
a bare ``ComputeError`` or ``Invalid thrift`` from the Parquet reader.

The stage that wrote the file, when rerun, calls :func:`quarantine_if_corrupt`
first: a file that does not verify is renamed ``<name>.corrupt-<UTC time>``
(kept for inspection, logged) and the stage rebuilds it.

Verifying means decoding every row group of every column: the footer alone
(what a schema check reads) survives damage to the data pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # polars is imported where a file is read: a GPU host's extraction and training need none
    import polars as pl

CORRUPT_MARK = ".corrupt-"


class ShardFileError(ValueError):
    """A shard file is missing, truncated or damaged; the message names it and the fix."""


def shard_of(path: Path) -> str:
    """``shard-00003`` for ``.../shard-00003.parquet`` or ``.../shard-00003/part-00000.safetensors``."""
    path = Path(path)
    return path.parent.name if path.suffix == ".safetensors" else path.name.split(".")[0]


def _fix(asset: str, shard: str) -> str:
    return f"rerun {asset} for {shard}: the file will be quarantined and rebuilt"


def verify_parquet(path: Path) -> None:
    """Decode the whole file (every column, every row group); raise what the reader raises."""
    import polars as pl

    for _ in pl.scan_parquet(path).collect_batches(chunk_size=4096, engine="streaming"):
        pass


def verify_shard_parquet(path: Path, *, asset: str, shard: str | None = None) -> Path:
    """``path`` when it exists and decodes entirely; else a ShardFileError naming it, its shard and the fix."""
    path = Path(path)
    shard = shard or shard_of(path)
    if not path.is_file():
        raise ShardFileError(f"{asset} {shard}: {path} does not exist; materialise {asset} for {shard} first")
    try:
        verify_parquet(path)
    except Exception as exc:  # polars raises ComputeError, OSError, PanicException... for a damaged file
        raise ShardFileError(
            f"{asset} {shard}: {path} is truncated or corrupt ({type(exc).__name__}: {_one_line(exc)}); {_fix(asset, shard)}"
        ) from exc
    return path


def read_shard_parquet(path: Path, *, asset: str, shard: str | None = None, columns: Sequence[str] | None = None) -> pl.DataFrame:
    """The shard file's rows (``columns`` only), after verifying the whole file."""
    import polars as pl

    verify_shard_parquet(path, asset=asset, shard=shard)
    try:
        return pl.read_parquet(path, columns=list(columns) if columns is not None else None)
    except Exception as exc:  # a missing column, say: still name the file
        shard = shard or shard_of(path)
        raise ShardFileError(f"{asset} {shard}: {path}: cannot read {list(columns or [])} ({_one_line(exc)}); {_fix(asset, shard)}") from exc


def quarantine(path: Path, log: Callable[[str], None], why: str) -> Path:
    """Rename ``path`` to ``<name>.corrupt-<UTC time>`` beside it, and say so."""
    path = Path(path)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = path.with_name(f"{path.name}{CORRUPT_MARK}{stamp}")
    path.rename(aside)
    log(f"quarantined {path} as {aside.name}: {why}; it will be rebuilt")
    return aside


def quarantine_if_corrupt(path: Path, log: Callable[[str], None]) -> Path | None:
    """For the stage that writes ``path``: move it aside when it exists and does not decode; where it went, or None."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        verify_parquet(path)
    except Exception as exc:
        return quarantine(path, log, f"it does not decode ({type(exc).__name__}: {_one_line(exc)})")
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
