"""One row of a prompt dataset normalised to ``id`` + chat ``messages``, or rejected with a reason.

Accepted forms, per row:
- open-perfectblend style ``conversations``: ``[{"from": "human"|"gpt"|"system", "value": ...}]``
  (``role``/``content`` keys work too);
- OpenAI style ``messages``: ``[{"role": ..., "content": ...}]``;
- a plain question field: ``question``, ``prompt`` or ``instruction`` (plus an optional ``system``).

The target regenerates its own answers, so trailing assistant turns are dropped:
the prompt is the conversation up to and including its last user turn.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import polars as pl

from eagle3_assets.core.storage.files import stable_hash

# The normal form's ``messages`` column, in every file that carries a prompt (prompts, traces, held-out sets).
MESSAGES_DTYPE = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
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
# Names the rules that decide a row's id and whether it is usable; the id index built
# under other rules is rebuilt. Bump it whenever normalise_record changes its verdicts.
ID_RULES = "ids-v2: bad_id, blank questions"


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



def judge_row(row: DatasetRow) -> tuple[str, list[dict[str, str]]] | RowRejected:
    if row.parse_error is not None:
        return RowRejected(row.error_reason, row.parse_error)
    try:
        return normalise_record(row.record)
    except RowRejected as exc:
        return exc


def usable_id(row: DatasetRow) -> str | None:
    """The sample id of a row that normalises, else None: what the duplicate check counts."""
    outcome = judge_row(row)
    return outcome[0] if isinstance(outcome, tuple) else None
