"""Read a prompt dataset and normalise it to ``id`` + chat ``messages``.

Accepted forms, per row:
- open-perfectblend style ``conversations``: ``[{"from": "human"|"gpt"|"system", "value": ...}]``
  (``role``/``content`` keys work too);
- OpenAI style ``messages``: ``[{"role": ..., "content": ...}]``;
- a plain question field: ``question``, ``prompt`` or ``instruction`` (plus an optional ``system``).

The target regenerates its own answers, so trailing assistant turns are dropped:
the prompt is the conversation up to and including its last user turn.

A bad row (including a JSONL line that is not UTF-8) is rejected with a reason code
and keeps its place in the row count, so shard boundaries never depend on how many
rows were bad. A file that cannot be read at all (missing, not Parquet) raises
:class:`DatasetReadError` naming the file.

Loading a shard reads that shard's rows only: a JSONL file through its line index,
a Parquet file by row slice; the duplicate-id check asks the dataset's id index
(see :mod:`eagle3_assets.core.dataset_index`). A hub dataset is streamed from its
first row, as it offers no random access.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.dataset_index import FileStamp, LineIndex, Prefix, id_index, line_index
from eagle3_assets.core.sharding import row_range
from eagle3_assets.core.storage import stable_hash

ID_FIELDS = ("id", "conversation_id", "uuid", "sample_id")
QUESTION_FIELDS = ("question", "prompt", "instruction")
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}

MESSAGES_DTYPE = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
PROMPTS_SCHEMA = {"row_index": pl.Int64, "id": pl.String, "messages": MESSAGES_DTYPE}
REJECTED_SCHEMA = {"row_index": pl.Int64, "id": pl.String, "reason": pl.String, "detail": pl.String}
# Names the rules that decide a row's id and whether it is usable; the id index built
# under other rules is rebuilt. Bump it whenever normalise_record changes its verdicts.
ID_RULES = "ids-v2: bad_id, blank questions"


class DatasetReadError(RuntimeError):
    """The dataset as a whole cannot be read (missing, not a table)."""


class RowRejected(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DatasetRow:
    row_index: int
    record: Any  # the parsed row, or None when it could not be parsed
    parse_error: str | None = None
    error_reason: str = "invalid_json"  # the rejection reason when parse_error is set


@dataclass(frozen=True)
class ShardPrompts:
    accepted: pl.DataFrame  # PROMPTS_SCHEMA
    rejected: pl.DataFrame  # REJECTED_SCHEMA
    indexes: dict[str, str] = field(default_factory=dict)  # index name -> "reused" / "extended" / "built"


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
            usable = _usable_id(row)
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
                usable = _usable_id(row)
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
                usable = _usable_id(row)
                if usable is not None:
                    self._earlier.add(usable)
                continue
            yield row

    def ids_before(self, ids: set[str], start: int) -> tuple[set[str], dict[str, str]]:
        return ids & self._earlier, {}


def normalise_record(record: Any) -> tuple[str, list[dict[str, str]]]:
    """Return ``(id, messages)`` for one row, or raise :class:`RowRejected`."""
    if not isinstance(record, dict):
        raise RowRejected("not_an_object", f"row is a {type(record).__name__}, not an object")
    messages = _messages_of(record)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # the target writes its own answer
    if not any(m["role"] == "user" for m in messages):
        raise RowRejected("missing_fields", "no user turn")
    if is_blank(messages[-1]["content"]):
        raise RowRejected("empty_question", "the last user turn is empty or only invisible characters")
    field_name = next((f for f in ID_FIELDS if record.get(f) not in (None, "")), None)
    if field_name is None:
        return "sha-" + stable_hash(messages), messages
    raw_id = record[field_name]
    # bool is an int to Python, and str() of a float, list or dict is no stable id
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise RowRejected("bad_id", f"{field_name} is a {type(raw_id).__name__} ({raw_id!r:.60}); use a string or an integer")
    return str(raw_id), messages


# Characters that draw nothing yet are not whitespace to str.strip(): Hangul fillers
# and the braille blank (letters/symbols to Unicode, used to fake empty text).
_INVISIBLE_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
# Format (zero-width space/joiners, BOM, word joiner, bidi marks), space separators,
# line/paragraph separators and control characters.
_INVISIBLE_CATEGORIES = frozenset({"Cf", "Zs", "Zl", "Zp", "Cc"})


def is_blank(text: str) -> bool:
    """True when ``text`` shows nothing: empty, whitespace, or only invisible characters such as U+200B."""
    return all(
        ch.isspace() or ch in _INVISIBLE_LETTERS or unicodedata.category(ch) in _INVISIBLE_CATEGORIES for ch in text
    )


def _messages_of(record: dict) -> list[dict[str, str]]:
    turns = record.get("conversations")
    if turns is None:
        turns = record.get("messages")
    if turns is not None:
        if not isinstance(turns, list):
            raise RowRejected("missing_fields", "conversations/messages is not a list")
        return [_turn(t, i) for i, t in enumerate(turns)]
    field = next((f for f in QUESTION_FIELDS if f in record), None)
    if field is None:
        wanted = ", ".join(("conversations", "messages") + QUESTION_FIELDS)
        raise RowRejected("missing_fields", f"none of the fields {wanted}")
    if not isinstance(record[field], str):
        raise RowRejected("missing_fields", f"{field} is not a string")
    system = record.get("system")
    messages = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    return messages + [{"role": "user", "content": record[field]}]


def _turn(turn: Any, position: int) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise RowRejected("missing_fields", f"turn {position} is not an object")
    role = turn.get("from", turn.get("role"))
    content = turn.get("value", turn.get("content"))
    if role not in ROLE_ALIASES:
        raise RowRejected("bad_role", f"turn {position} has role {role!r}")
    if not isinstance(content, str):
        raise RowRejected("missing_fields", f"turn {position} has no text")
    return {"role": ROLE_ALIASES[role], "content": content}


def load_shard(source: str, key: str, shard_size: int) -> ShardPrompts:
    """Normalise the rows of one shard; duplicates are judged against every earlier row.

    Reads the shard's own rows; the earlier rows are consulted through the dataset's
    id index (built once per version of the file), not re-read.
    """
    rows = row_range(key, shard_size)
    dataset = open_dataset(source)
    judged = [(row, _judge(row)) for row in dataset.rows(rows.start, rows.stop)]
    candidates = {outcome[0] for _, outcome in judged if isinstance(outcome, tuple)}
    seen, indexes = dataset.ids_before(candidates, rows.start)
    accepted: list[dict] = []
    rejected: list[dict] = []
    for row, outcome in judged:
        if isinstance(outcome, RowRejected):
            rejected.append(_rejection(row.row_index, None, outcome.reason, outcome.detail))
            continue
        sample_id, messages = outcome
        if sample_id in seen:
            rejected.append(_rejection(row.row_index, sample_id, "duplicate_id", f"id {sample_id} appeared earlier"))
            continue
        seen.add(sample_id)
        accepted.append({"row_index": row.row_index, "id": sample_id, "messages": messages})
    return ShardPrompts(
        accepted=pl.DataFrame(accepted, schema=PROMPTS_SCHEMA),
        rejected=pl.DataFrame(rejected, schema=REJECTED_SCHEMA),
        indexes=indexes,
    )


def _judge(row: DatasetRow) -> tuple[str, list[dict[str, str]]] | RowRejected:
    if row.parse_error is not None:
        return RowRejected(row.error_reason, row.parse_error)
    try:
        return normalise_record(row.record)
    except RowRejected as exc:
        return exc


def _usable_id(row: DatasetRow) -> str | None:
    """The sample id of a row that normalises, else None: what the duplicate check counts."""
    outcome = _judge(row)
    return outcome[0] if isinstance(outcome, tuple) else None


def _rejection(row_index: int, sample_id: str | None, reason: str, detail: str) -> dict:
    return {"row_index": row_index, "id": sample_id, "reason": reason, "detail": detail}


def count_rows(source: str) -> int:
    """Rows in the dataset, bad ones included: what the shard keys are computed from."""
    return open_dataset(source).count()
