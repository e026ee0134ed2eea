"""Where a secret could have been written: every file under some roots, SQLite values (compressed or not) included."""

from __future__ import annotations

import sqlite3
import zlib
from pathlib import Path


def files_holding(needle: str, roots: list[Path]) -> list[str]:
    """Every file under ``roots`` holding ``needle``: as bytes, and inside SQLite values (Dagster zlib-compresses snapshots)."""
    found, raw = [], needle.encode()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            if raw in data:
                found.append(str(path))
            elif data.startswith(b"SQLite format 3"):
                found += [f"{path}:{where}" for where in _sqlite_values_holding(path, raw)]
    return found


def _sqlite_values_holding(path: Path, raw: bytes) -> list[str]:
    hits = []
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        for (table,) in db.execute("select name from sqlite_master where type = 'table'").fetchall():
            for row in db.execute(f'select * from "{table}"'):
                for value in row:
                    blob = value.encode() if isinstance(value, str) else value if isinstance(value, bytes) else b""
                    try:
                        blob += zlib.decompress(blob)
                    except zlib.error:
                        pass
                    if raw in blob:
                        hits.append(table)
    return hits
