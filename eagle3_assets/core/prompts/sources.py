"""Where prompt rows come from: a JSONL file, a Parquet file or a hub dataset, read a shard at a time.

A JSONL file is read through its line index, a Parquet file by row slice; the
duplicate-id check asks the dataset's id index (see
:mod:`eagle3_assets.core.prompts.dataset_index`). A hub dataset is streamed from its
first row, as it offers no random access. Row indexes count every row, bad ones
included (a JSONL line that is not UTF-8 too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.prompts.dataset_index import FileStamp, LineIndex, Prefix, id_index, line_index
from eagle3_assets.core.prompts.records import ID_RULES, DatasetRow, usable_id


class DatasetReadError(RuntimeError):
    """The dataset as a whole cannot be read (missing, not a table)."""



def iter_dataset_rows(source: str, stop: int | None = None) -> Iterator[DatasetRow]:
    """Yield every row of a JSONL file, a Parquet file or a Hugging Face dataset, in order."""
    dataset = open_dataset(source)
    yield from dataset.rows(0, stop)


def open_dataset(source: str) -> PromptSource:
    """The reader for ``source``: a JSONL or Parquet file, or a hub dataset name."""
    path = Path(source)
    if path.suffix in {".jsonl", ".json", ".ndjson"} or (path.exists() and path.suffix != ".parquet"):
        return JsonlSource(path)
    if path.suffix == ".parquet":
        return ParquetSource(path)
    if "/" in source and not path.exists() and not source.startswith((".", "/")):
        return HubSource(source)
    raise DatasetReadError(f"prompt dataset {source}: no such file (expected .jsonl, .parquet or a hub name)")


class PromptSource:
    """One way of reading a dataset. Row indexes count every row, bad ones included."""

    def count(self) -> int:
        raise NotImplementedError

    def rows(self, start: int, stop: int | None) -> Iterator[DatasetRow]:
        """Rows ``[start, stop)`` (to the end when ``stop`` is None)."""
        raise NotImplementedError

    def ids_before(self, ids: set[str], start: int) -> tuple[set[str], dict[str, str]]:
        """Which of ``ids`` a usable row before ``start`` already carries; and what the answer cost (index -> how)."""
        raise NotImplementedError


class JsonlSource(PromptSource):
    """A JSONL file, read through its line index: a shard costs its own rows, wherever it is."""

    def __init__(self, path: Path):
        self.path = path
        self._lines: LineIndex | None = None  # one version of the file per reader

    def _line_index(self) -> LineIndex:
        if self._lines is not None:
            return self._lines
        try:
            self._lines = line_index(self.path)
            return self._lines
        except FileNotFoundError:
            raise DatasetReadError(f"prompt dataset {self.path}: no such file") from None
        except IsADirectoryError:
            raise DatasetReadError(f"prompt dataset {self.path}: is a directory, not a JSONL file") from None

    def count(self) -> int:
        return self._line_index().rows

    def rows(self, start: int, stop: int | None) -> Iterator[DatasetRow]:
        # From row 0 no index is needed; otherwise one seek to the row's offset. Then
        # line by line, so memory stays one line whatever the range.
        offset = 0
        if start > 0:
            lines = self._line_index()
            stop = lines.rows if stop is None else min(stop, lines.rows)  # the rows of the version indexed
            if start >= stop:
                return
            offset = lines.end_of(start)
        elif not self.path.is_file():
            raise DatasetReadError(f"prompt dataset {self.path}: no such file")
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            row_index = start
            while stop is None or row_index < stop:
                raw = fh.readline()
                if not raw:
                    return
                yield _parse_line(raw, row_index, offset)
                offset += len(raw)
                row_index += 1

    def ids_before(self, ids: set[str], start: int) -> tuple[set[str], dict[str, str]]:
        if start == 0 or not ids:
            return set(), {}
        lines = self._line_index()

        def extent() -> tuple[int, Prefix]:
            # every row that ends with a newline; a last line without one may still be being written
            return lines.complete_rows, Prefix.of(Path(lines.stamp.path), lines.stamp, lines.complete_end)

        # rows before a shard's start all end with a newline, so `start` rows are always coverable
        with id_index(self.path, lines.stamp, min(start, lines.complete_rows), extent, ID_RULES, self._usable_ids) as ids_index:
            first = ids_index.first_rows(ids)
        return {i for i, row in first.items() if row < start}, {"line_index": lines.how, "id_index": ids_index.how}

    def _usable_ids(self, start: int, stop: int) -> Iterator[tuple[int, str]]:
        for row in self.rows(start, stop):
            usable = usable_id(row)
            if usable is not None:
                yield row.row_index, usable


def _parse_line(raw: bytes, row_index: int, offset: int) -> DatasetRow:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        detail = f"byte {offset + exc.start} of the file is not UTF-8 ({exc.reason}): re-encode or remove line {row_index + 1}"
        return DatasetRow(row_index, None, detail, "not_utf8")
    if not text.strip():
        return DatasetRow(row_index, None, "empty line")
    try:
        return DatasetRow(row_index, json.loads(text))
    except json.JSONDecodeError as exc:
        return DatasetRow(row_index, None, f"invalid JSON at column {exc.colno}: {exc.msg}")


class ParquetSource(PromptSource):
    """A Parquet file, sliced by rows: polars reads only the row groups the slice touches."""

    BATCH_ROWS = 65_536  # rows normalised at a time while building the id index

    def __init__(self, path: Path):
        self.path = path

    def _fail(self, exc: Exception) -> DatasetReadError:
        if not self.path.exists():
            return DatasetReadError(f"prompt dataset {self.path}: no such file")
        return DatasetReadError(f"prompt dataset {self.path}: cannot read as Parquet ({exc})")

    def count(self) -> int:
        try:
            return pl.scan_parquet(self.path).select(pl.len()).collect().item()
        except Exception as exc:  # polars raises several types for unreadable files
            raise self._fail(exc) from exc

    def rows(self, start: int, stop: int | None) -> Iterator[DatasetRow]:
        try:
            frame = pl.scan_parquet(self.path).slice(start, None if stop is None else max(stop - start, 0)).collect()
        except Exception as exc:
            raise self._fail(exc) from exc
        for offset, record in enumerate(frame.iter_rows(named=True)):
            yield DatasetRow(start + offset, record)

    def ids_before(self, ids: set[str], start: int) -> tuple[set[str], dict[str, str]]:
        if start == 0 or not ids:
            return set(), {}
        stamp = FileStamp.of(self.path)
        # a Parquet file is rewritten, never appended to: the index covers all of it and is rebuilt on change
        with id_index(self.path, stamp, start, lambda: (self.count(), None), ID_RULES, self._usable_ids) as ids_index:
            first = ids_index.first_rows(ids)
        return {i for i, row in first.items() if row < start}, {"id_index": ids_index.how}

    def _usable_ids(self, start: int, stop: int) -> Iterator[tuple[int, str]]:
        for batch in range(start, stop, self.BATCH_ROWS):
            for row in self.rows(batch, min(batch + self.BATCH_ROWS, stop)):
                usable = usable_id(row)
                if usable is not None:
                    yield row.row_index, usable


class HubSource(PromptSource):
    """A Hugging Face dataset, streamed: no random access, so a shard reads every row before it."""

    def __init__(self, name: str):
        self.name = name
        self._earlier: set[str] = set()

    def _stream(self) -> Iterator[Any]:
        try:
            import datasets  # optional: only users who can reach the hub need it
        except ImportError as exc:
            raise DatasetReadError(f"prompt dataset {self.name}: reading a hub dataset needs `pip install datasets`") from exc
        repo, _, split = self.name.partition(":")
        return iter(datasets.load_dataset(repo, split=split or "train", streaming=True))

    def count(self) -> int:
        return sum(1 for _ in self._stream())

    def rows(self, start: int, stop: int | None) -> Iterator[DatasetRow]:
        # the rows before the shard go by anyway: remember their ids for ids_before
        self._earlier = set()
        for index, record in enumerate(self._stream()):
            if stop is not None and index >= stop:
                return
            row = DatasetRow(index, record)
            if index < start:
                usable = usable_id(row)
                if usable is not None:
                    self._earlier.add(usable)
                continue
            yield row

    def ids_before(self, ids: set[str], start: int) -> tuple[set[str], dict[str, str]]:
        return ids & self._earlier, {}

