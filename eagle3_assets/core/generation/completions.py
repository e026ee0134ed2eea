"""The wire format of an OpenAI-compatible chat completion, as a ``raw_responses`` row records it.

What a response is parsed into (the reasoning read from ``message.reasoning``,
vLLM since late 2025, else from ``message.reasoning_content``, older vLLM and
SGLang; the token ids vLLM returns with ``return_token_ids``), the row's
schema, the error kinds a row's ``error`` starts with, and the small helpers
that turn a failed request into a row's text (credentials never included).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from eagle3_assets.core.generation.redaction import redact_credentials

# The contract of ``<data>/raw_responses/<shard>.parquet`` (one row per prompt).
ROW_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "reasoning": pl.String(),
    "content": pl.String(),
    "reasoning_field": pl.String(),  # "reasoning" | "reasoning_content" | "none"
    "finish_reason": pl.String(),
    "prompt_tokens": pl.Int64(),
    "completion_tokens": pl.Int64(),
    "latency_s": pl.Float64(),  # of the attempt whose outcome the row records
    "server": pl.String(),  # base URL that answered, without credentials ("" when no request was sent)
    "model": pl.String(),
    "attempts": pl.Int64(),  # requests sent for this sample over its whole life, every run (0: never sent)
    "error": pl.String(),  # "<kind>: <detail>", null on success
    # The ids the server rendered the prompt into and the ids it generated (the end-of-turn token included when
    # generation stopped on it); null when the server returns none (SGLang, return_token_ids off, older files).
    "prompt_token_ids": pl.List(pl.Int64()),
    "output_token_ids": pl.List(pl.Int64()),
}

REASONING_FIELDS = ("reasoning", "reasoning_content")  # in order of preference
SAMPLE_ID_HEADER = "X-Eagle3-Sample-Id"  # lets server logs (and the tests' fault proxy) name the sample
CANARY_ID = "eagle3-canary"  # the pre-flight's request, under that header

# Error kinds (the part of ``error`` before the colon); PROMPT_TOO_LONG comes from response_rules.
HTTP_ERROR = "http"
CONNECTION_ERROR = "connection"
READ_TIMEOUT = "read_timeout"
MALFORMED_RESPONSE = "malformed_response"


@dataclass(frozen=True)
class Sample:
    id: str
    messages: list[dict[str, str]]


def parse_completion(payload: Any) -> dict[str, Any]:
    """The fields of one chat completion that a row keeps; ValueError when the shape is not a completion."""
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("no choices[0] in the response")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ValueError("choices[0].message is missing")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError("message.content is not a string")
    reasoning, reasoning_field = None, "none"
    for name in REASONING_FIELDS:
        value = message.get(name)
        if isinstance(value, str) and value:
            reasoning, reasoning_field = value, name
            break
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    return {
        "reasoning": reasoning,
        "content": content,
        "reasoning_field": reasoning_field,
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": _int_or_none(usage.get("prompt_tokens")),
        "completion_tokens": _int_or_none(usage.get("completion_tokens")),
        # vLLM with return_token_ids: the prompt's ids at the top level, the generated ids in the choice.
        "prompt_token_ids": _token_ids(payload.get("prompt_token_ids"), "prompt_token_ids"),
        "output_token_ids": _token_ids(choice.get("token_ids"), "choices[0].token_ids"),
    }


def _token_ids(value: Any, name: str) -> list[int] | None:
    """A list of token ids as the server sent it; None when absent; ValueError when it is something else."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f"{name} is not a list of token ids")
    return value


def prompt_tokens_upper_bound(messages: Sequence[Mapping[str, str]]) -> int:
    """A bound on the prompt's token count that needs no tokenizer.

    A token covers at least one byte (byte-level BPE, SentencePiece with byte
    fallback), and a chat template adds a few tokens per message. Prompts under
    the bound's limit cannot be too long, so only the rare long ones are counted
    exactly (``/tokenize``).
    """
    return sum(len(str(m.get("content", "")).encode()) + 16 for m in messages) + 64


def retryable_status(status: int) -> bool:
    return status in (408, 429) or 500 <= status < 600


def server_error_message(payload: bytes) -> str:
    """The server's error message (OpenAI error JSON), else the start of the body."""
    try:
        body = json.loads(payload)
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
        if message:
            return str(message)[:300]
    except (ValueError, AttributeError):
        pass
    return body_excerpt(payload)


def body_excerpt(payload: bytes, limit: int = 120) -> str:
    return repr(payload[:limit].decode("utf-8", errors="replace"))


def describe_error(exc: BaseException) -> str:
    """An exception as a row's error or a log line shows it: a message that quotes a URL loses its credentials."""
    text = redact_credentials(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def sample_id_header_value(sample_id: str) -> str:
    return urllib.parse.quote(sample_id, safe="")


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

