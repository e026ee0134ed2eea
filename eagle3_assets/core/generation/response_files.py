"""A file of responses made elsewhere, read row by row as rows of the platform's ``raw_responses`` contract.

Two formats (:func:`format_of`, by the file's suffix): JSONL, one response a
line, in any of the shapes such files take (a row with ``messages`` and the
response's ``reasoning``/``reasoning_content`` and ``content`` beside them or in
the assistant's last turn; or a whole chat completion, ``choices[0].message``,
under the row or its ``response``), and Parquet, the platform's own
``raw_responses`` shards from another instance. :func:`adopted_row` turns one
row into the contract, or refuses it with a reason (:class:`RowRefused`);
:func:`prompt_key` is what two prompts share when they are the same question.
Which rows a shard takes, and its journal and record, are :mod:`.adopt`'s.
Dagster-free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.generation.completions import REASONING_FIELDS, parse_completion

SERVER_PREFIX = "import:"  # the ``server`` of an adopted row: which file it came from


class AdoptionError(ValueError):
    """The source cannot be adopted at all (missing, unreadable, another format); names the file and what is wrong."""


class RowRefused(ValueError):
    """A row of the file that is not taken: ``reason`` is a key of :data:`.adopt.REFUSALS`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def adopted_row(row: Mapping[str, Any], sample_id: str, source_name: str, source_format: str) -> dict[str, Any]:
    """One row of the ``raw_responses`` contract from one row of the file; :class:`RowRefused` with the reason when it is none."""
    if source_format == "parquet":
        if row.get("error") is not None:
            raise RowRefused("request_error", str(row["error"])[:200])
        response = {k: row.get(k) for k in ("reasoning", "content", "reasoning_field", "finish_reason", "prompt_tokens", "completion_tokens")}
        response["prompt_token_ids"], response["output_token_ids"] = row.get("prompt_token_ids"), row.get("output_token_ids")
        model = row.get("model") or ""
    else:
        response = _jsonl_response(row)
        response_object = row.get("response") if isinstance(row.get("response"), dict) else {}
        model = str(row.get("model") or response_object.get("model") or "")
    for name in ("reasoning", "content"):
        if response.get(name) is not None and not isinstance(response[name], str):
            raise RowRefused("malformed_response", f"{name} is a {type(response[name]).__name__}, not text")
    if not (response.get("reasoning") or "").strip() and not (response.get("content") or "").strip():
        raise RowRefused("no_response")
    finish = response.get("finish_reason")
    return {
        "id": sample_id,
        "reasoning": response.get("reasoning") or None,
        "content": response.get("content"),
        "reasoning_field": response.get("reasoning_field") or "none",
        # A file without finish reasons holds finished answers (synth_10k does): the content rules still test the answer.
        "finish_reason": str(finish) if finish is not None else "stop",
        "prompt_tokens": _int_or_none(response.get("prompt_tokens")),
        "completion_tokens": _int_or_none(response.get("completion_tokens")),
        "latency_s": None,
        "server": f"{SERVER_PREFIX}{source_name}",
        "model": model,
        "attempts": 0,
        "error": None,
        "prompt_token_ids": _ids(response.get("prompt_token_ids")),
        "output_token_ids": _ids(response.get("output_token_ids")),
    }


def _jsonl_response(row: Mapping[str, Any]) -> dict[str, Any]:
    """The response of a JSONL row: a chat completion (the row, or its ``response``), else its reasoning/content fields."""
    completion = row.get("response") if isinstance(row.get("response"), dict) else row
    if isinstance(completion.get("choices"), list):
        try:
            return parse_completion(completion)
        except ValueError as exc:
            raise RowRefused("malformed_response", str(exc)) from None
    holder: Mapping[str, Any] = row
    messages = row.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        holder = {**row, **messages[-1]}  # the answer is the conversation's last turn
    reasoning, reasoning_field = None, "none"
    for name in REASONING_FIELDS:  # vLLM's current name first, then the older one (and SGLang's)
        value = holder.get(name)
        if isinstance(value, str) and value.strip():
            reasoning, reasoning_field = value, name
            break
    usage = row.get("usage") if isinstance(row.get("usage"), dict) else {}
    return {
        "reasoning": reasoning,
        "content": holder.get("content"),
        "reasoning_field": reasoning_field,
        "finish_reason": finish_reason_of(row),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
    }


def finish_reason_of(row: Mapping[str, Any]) -> str | None:
    if row.get("finish_reason") is not None:
        return str(row["finish_reason"])
    completion = row.get("response") if isinstance(row.get("response"), dict) else row
    choices = completion.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict) and choices[0].get("finish_reason") is not None:
        return str(choices[0]["finish_reason"])
    return None


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The prompt's turns of a file's row (the assistant's answer, when the row carries it last, left out), or None."""
    messages = row.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        turns = list(messages)
        if turns[-1].get("role") == "assistant":
            turns = turns[:-1]
        return turns or None
    for name in ("prompt", "question"):
        if isinstance(row.get(name), str):
            return [{"role": "user", "content": row[name]}]
    return None


def prompt_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """What two prompts share when they are the same question: their roles and whitespace-normalised texts."""
    turns = [[str(m.get("role")), " ".join(str(m.get("content") or "").split())] for m in messages]
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode()).hexdigest()


def source_rows(path: Path, source_format: str) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    """(where, row, problem) per row of the file; ``problem`` says why a line is no JSON object."""
    if source_format == "parquet":
        try:
            frame = pl.read_parquet(path)
        except Exception as exc:  # noqa: BLE001 - polars raises several kinds for a bad file
            raise AdoptionError(f"adopting responses: {path} is not a readable Parquet file: {exc}") from None
        missing = {"id", "reasoning", "content"} - set(frame.columns)
        if missing:
            raise AdoptionError(f"adopting responses: {path} has no column(s) {sorted(missing)}: not a raw_responses Parquet")
        for number, row in enumerate(frame.iter_rows(named=True), 1):
            yield f"row {number}", row, None
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except ValueError as exc:
                yield f"line {number}", {}, f"not JSON: {exc}"
                continue
            if not isinstance(row, dict):
                yield f"line {number}", {}, f"a JSON {type(row).__name__}, not an object"
                continue
            yield f"line {number}", row, None


def format_of(path: Path) -> str:
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise AdoptionError(f"adopting responses: {path}: expected a .jsonl file of chat completions or a raw_responses .parquet")


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ids(value: Any) -> list[int] | None:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else None
