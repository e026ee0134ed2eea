"""Read a prompt dataset and normalise it to ``id`` + chat ``messages``.

Accepted forms, per row:
- open-perfectblend style ``conversations``: ``[{"from": "human"|"gpt"|"system", "value": ...}]``
  (``role``/``content`` keys work too);
- OpenAI style ``messages``: ``[{"role": ..., "content": ...}]``;
- a plain question field: ``question``, ``prompt`` or ``instruction`` (plus an optional ``system``).

The target regenerates its own answers, so trailing assistant turns are dropped:
the prompt is the conversation up to and including its last user turn.

A bad row is rejected with a reason code and keeps its place in the row count, so
shard boundaries never depend on how many rows were bad. A file that cannot be
read at all raises :class:`DatasetReadError` naming the file and the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

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


class DatasetReadError(RuntimeError):
    """The dataset as a whole cannot be read (missing, undecodable, not a table)."""


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


@dataclass(frozen=True)
class ShardPrompts:
    accepted: pl.DataFrame  # PROMPTS_SCHEMA
    rejected: pl.DataFrame  # REJECTED_SCHEMA


def iter_dataset_rows(source: str, stop: int | None = None) -> Iterator[DatasetRow]:
    """Yield every row of a JSONL file, a Parquet file or a Hugging Face dataset, in order."""
    path = Path(source)
    if path.suffix in {".jsonl", ".json", ".ndjson"} or (path.exists() and path.suffix != ".parquet"):
        yield from _iter_jsonl(path, stop)
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path, stop)
    elif "/" in source and not path.exists() and not source.startswith((".", "/")):
        yield from _iter_hub(source, stop)
    else:
        raise DatasetReadError(f"prompt dataset {source}: no such file (expected .jsonl, .parquet or a hub name)")


def _iter_jsonl(path: Path, stop: int | None) -> Iterator[DatasetRow]:
    if not path.is_file():
        raise DatasetReadError(f"prompt dataset {path}: no such file")
    with open(path, "rb") as fh:
        for index, raw in enumerate(fh):
            if stop is not None and index >= stop:
                return
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetReadError(f"prompt dataset {path}, line {index + 1}: not UTF-8 text ({exc.reason})") from exc
            if not text.strip():
                yield DatasetRow(index, None, "empty line")
                continue
            try:
                yield DatasetRow(index, json.loads(text))
            except json.JSONDecodeError as exc:
                yield DatasetRow(index, None, f"invalid JSON at column {exc.colno}: {exc.msg}")


def _iter_parquet(path: Path, stop: int | None) -> Iterator[DatasetRow]:
    try:
        frame = pl.read_parquet(path, n_rows=stop)
    except Exception as exc:  # polars raises several types for unreadable files
        raise DatasetReadError(f"prompt dataset {path}: cannot read as Parquet ({exc})") from exc
    for index, record in enumerate(frame.iter_rows(named=True)):
        yield DatasetRow(index, record)


def _iter_hub(name: str, stop: int | None) -> Iterator[DatasetRow]:
    try:
        import datasets  # optional: only users who can reach the hub need it
    except ImportError as exc:
        raise DatasetReadError(f"prompt dataset {name}: reading a hub dataset needs `pip install datasets`") from exc
    repo, _, split = name.partition(":")
    dataset = datasets.load_dataset(repo, split=split or "train", streaming=True)
    for index, record in enumerate(dataset):
        if stop is not None and index >= stop:
            return
        yield DatasetRow(index, record)


def normalise_record(record: Any) -> tuple[str, list[dict[str, str]]]:
    """Return ``(id, messages)`` for one row, or raise :class:`RowRejected`."""
    if not isinstance(record, dict):
        raise RowRejected("not_an_object", f"row is a {type(record).__name__}, not an object")
    messages = _messages_of(record)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # the target writes its own answer
    if not any(m["role"] == "user" for m in messages):
        raise RowRejected("missing_fields", "no user turn")
    if not messages[-1]["content"].strip():
        raise RowRejected("empty_question", "the last user turn is empty")
    raw_id = next((record[f] for f in ID_FIELDS if record.get(f) not in (None, "")), None)
    sample_id = str(raw_id) if raw_id is not None else "sha-" + stable_hash(messages)
    return sample_id, messages


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
    """Normalise the rows of one shard; duplicates are judged against every earlier row."""
    rows = row_range(key, shard_size)
    seen: set[str] = set()
    accepted: list[dict] = []
    rejected: list[dict] = []
    for row in iter_dataset_rows(source, stop=rows.stop):
        in_shard = row.row_index >= rows.start
        if row.parse_error is not None:
            if in_shard:
                rejected.append(_rejection(row.row_index, None, "invalid_json", row.parse_error))
            continue
        try:
            sample_id, messages = normalise_record(row.record)
        except RowRejected as exc:
            if in_shard:
                rejected.append(_rejection(row.row_index, None, exc.reason, exc.detail))
            continue
        if sample_id in seen:
            if in_shard:
                rejected.append(_rejection(row.row_index, sample_id, "duplicate_id", f"id {sample_id} appeared earlier"))
            continue
        seen.add(sample_id)
        if in_shard:
            accepted.append({"row_index": row.row_index, "id": sample_id, "messages": messages})
    return ShardPrompts(
        accepted=pl.DataFrame(accepted, schema=PROMPTS_SCHEMA),
        rejected=pl.DataFrame(rejected, schema=REJECTED_SCHEMA),
    )


def _rejection(row_index: int, sample_id: str | None, reason: str, detail: str) -> dict:
    return {"row_index": row_index, "id": sample_id, "reason": reason, "detail": detail}


def count_rows(source: str) -> int:
    """Rows in the dataset, bad ones included: what the shard keys are computed from."""
    count = 0
    for count, _ in enumerate(iter_dataset_rows(source), start=1):
        pass
    return count
