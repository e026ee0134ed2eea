"""Regenerate reasoning traces through an OpenAI-compatible server (vLLM, SGLang), fast and resumably.

Why a hand-written aiohttp client for the samples and not the ``openai`` SDK:
the SDK, on its default transport and on its aiohttp one alike, becomes the
bottleneck at the concurrency a GPU server needs: against an instant stub it
answers a small fraction of what plain aiohttp does (``bench/generation.py``
prints both figures; docs/performance.md). The pre-flight's single canary
request does go through the SDK (:mod:`.openai_client`). The wire format is
exactly OpenAI's chat completions either way, so any server that speaks it
works.

What the client gets right, because the story this project comes from got it wrong:

- one read timeout long enough for a whole generation (default 1,800 s), apart
  from a short connect timeout; a request that times out reading is *not*
  re-sent (re-sending slow requests makes retry storms);
- retries with exponential backoff and jitter on connection errors, 408, 429
  and 5xx only; a 400 (a bad request stays bad) is recorded, never retried;
- the reasoning is read from ``message.reasoning`` (vLLM since late 2025) and
  else from ``message.reasoning_content`` (older vLLM, SGLang), and every row
  records which field carried it;
- a pre-flight (``/health``, ``/v1/models``, one canary request that must come
  back with reasoning) runs before the first sample is sent, so a server without
  a reasoning parser fails the run at once instead of after 10,000 requests;
- every finished row goes to the shard's journal (:mod:`.journal`) as it
  arrives; a rerun sends only the ids not yet durable, the rows that ended in an
  error, and the rows whose response validation would reject for a reason a new
  generation can fix (:mod:`.response_rules`: empty reasoning, empty answer, a
  cut or aborted generation), up to ``max_attempts_per_sample`` requests per
  sample over its whole life. A content failure is *not* re-sent within the run
  that got it: when the server itself is at fault (no reasoning parser), instant
  retries would only spend the sample's attempts before anyone can fix it;
- a finished shard is never overwritten by a generation with other settings:
  it is kept under ``superseded/`` (:func:`.journal.keep_superseded`), and
  reused if the settings come back;
- credentials in a server URL are used for requests and shown nowhere
  (:mod:`.redaction`): rows, logs and errors name the server without them;
- the token ids the server saw and generated are asked for (vLLM's
  ``return_token_ids``) and kept beside the text (``prompt_token_ids``,
  ``output_token_ids``), so that validation can check the supervised tokens
  against what the target really produced, not only against a re-tokenisation
  of the parser's text fields. Asking for them changes no response, so it is no
  part of a shard's identity.

Nothing here imports Dagster: the asset (``eagle3_assets/raw_responses.py``)
is a thin wrapper, and the benchmark drives this module directly.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import polars as pl
from pydantic import ConfigDict

from eagle3_assets.core.job_schema import JobSchema, given, setting
from eagle3_assets.core.journal import ShardJournal, keep_superseded, parquet_fingerprint, parquet_generation
from eagle3_assets.core.shard_paths import superseded_path
from eagle3_assets.core.markdown import markdown_histogram
from eagle3_assets.core.openai_client import async_openai_client
from eagle3_assets.core.redaction import has_credentials, redact_credentials, redact_url
from eagle3_assets.core.response_rules import (
    DEFAULT_MAX_ATTEMPTS_PER_SAMPLE,
    NO_REASONING_DIAGNOSIS,
    PROMPT_TOO_LONG,
    content_failures,
)
from eagle3_assets.core.storage import stable_hash

if TYPE_CHECKING:
    import openai

# Makes the pre-flight's canary client for a server's base URL (credentials included; the caller closes it).
CanaryClient = Callable[[str], "openai.AsyncOpenAI"]

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
_JSON = json.JSONEncoder(ensure_ascii=False)  # one encoder for every request body, not one per call
SAMPLE_ID_HEADER = "X-Eagle3-Sample-Id"  # lets server logs (and the tests' fault proxy) name the sample
CANARY_ID = "eagle3-canary"
DEFAULT_CANARY_PROMPT = "What is 17 + 25? Think it through step by step, then give the answer."
DEFAULT_CANARY_MAX_TOKENS = 512
DEFAULT_PROGRESS_INTERVAL_S = 5.0
# A server that refused a connection gets no new request for this long while another server is up,
# then one request at a time until one is answered (a circuit breaker's half-open state). Without it
# a dead server, having nothing in flight, is the "fewest in flight" choice for every new request:
# each sample would pay a failed attempt and a backoff before its retry went elsewhere.
SERVER_DOWN_COOLDOWN_S = 10.0

# Error kinds (the part of ``error`` before the colon); PROMPT_TOO_LONG comes from response_rules.
HTTP_ERROR = "http"
CONNECTION_ERROR = "connection"
READ_TIMEOUT = "read_timeout"
MALFORMED_RESPONSE = "malformed_response"


class Sampling(JobSchema):
    """How the target samples; unset fields are left to the server (vLLM's extensions included)."""

    model_config = ConfigDict(frozen=True)

    temperature: float = setting(0.6, "sampling temperature (match how the target is served)", ge=0)
    top_p: float = setting(0.95, "nucleus sampling: the smallest set of tokens whose probability reaches top_p", gt=0, le=1)
    top_k: int | None = setting(None, "vLLM extension; unset: the server's default")
    min_p: float | None = setting(None, "vLLM extension; unset: the server's default")
    presence_penalty: float | None = setting(None, "OpenAI presence penalty; unset: the server's default")
    frequency_penalty: float | None = setting(None, "OpenAI frequency penalty; unset: the server's default")
    repetition_penalty: float | None = setting(None, "vLLM extension; unset: the server's default")
    seed: int | None = setting(None, "per-request sampling seed; unset: random")

    def request_fields(self) -> dict[str, Any]:
        """The fields a request carries: the ones that are set."""
        return {name: value for name, value in self.model_dump().items() if value is not None}


class GenerationSettings(JobSchema):
    """How requests are sent, retried and kept: the settings of ``vllm_server`` (the resource is this class and ``Sampling``)."""

    model_config = ConfigDict(frozen=True)

    # Never printed, never part of a fingerprint.
    api_key: str | None = setting(None, "bearer token; set it with EnvVar('VLLM_API_KEY'), never as a literal", repr=False)
    concurrency: int = setting(128, "requests in flight per run (per shard being generated)", gt=0)
    max_tokens: int = setting(8192, "completion token limit per request, reasoning included", gt=0)
    extra_body: Mapping[str, Any] = setting({}, "merged into every request body, e.g. {'chat_template_kwargs': {'thinking': true}}")
    connect_timeout_s: float = setting(10.0, "to open a connection; failures are retried", gt=0)
    read_timeout_s: float = setting(1800.0, "for one whole generation; a read timeout is not retried", gt=0)
    # /tokenize answers in milliseconds; it must not inherit the read timeout of a whole generation, or one stuck
    # call would hold a worker for half an hour. On a timeout the server judges the prompt itself.
    tokenize_timeout_s: float = setting(
        30.0, "for one /tokenize call (exact count of a prompt that may not fit); on a timeout the server judges the prompt", gt=0
    )
    max_retries: int = setting(5, "retries on connection errors, 408, 429 and 5xx (never on other 4xx)", ge=0)
    retry_backoff_s: float = setting(1.0, "first backoff; doubles per retry, with jitter", ge=0)
    retry_backoff_max_s: float = setting(60.0, "the longest backoff between two tries of a request", ge=0)
    # So many samples in a row ending with retries exhausted means the server is gone:
    # stop (the journal keeps what is done) rather than fill the shard with error rows.
    max_consecutive_failures: int = setting(64, "samples in a row failing all retries before the run stops", gt=0)
    # Validation reads the same setting from the shard's file.
    allow_truncated: bool = setting(
        False,
        "generations cut by max_tokens are usable: a rerun does not send them again, and validated_traces keeps them "
        "(its own allow_truncated, when set, overrides)",
    )
    max_attempts_per_sample: int = setting(
        DEFAULT_MAX_ATTEMPTS_PER_SAMPLE,
        "requests per sample over all runs after which a response validation rejects (no reasoning, no answer, "
        "cut, aborted) is kept as it is instead of being sent again on the next run of the shard",
        gt=0,
    )
    # Not part of :meth:`identity`: the responses are the same either way.
    return_token_ids: bool = setting(
        True,
        "ask the server for the prompt's and the generation's token ids (vLLM's return_token_ids), kept in "
        "raw_responses so that validated_traces checks the supervised tokens against what the target generated. Turn off "
        "only for a server that refuses unknown request fields; it changes no response and no shard's identity",
    )


class GenerationConfig(GenerationSettings):
    """Everything the client needs; the Dagster resource builds one (``VLLMServerResource.generation_config``)."""

    base_urls: tuple[str, ...] = given("base URLs of the servers (no /v1); requests are spread over them")
    model: str = given("the model name the server serves (vLLM's --served-model-name)")
    sampling: Mapping[str, Any] = setting(Sampling().request_fields(), "sampling fields of every request (see Sampling)")

    def model_post_init(self, _context: Any) -> None:
        if not self.base_urls:
            raise ValueError("vllm_server.base_urls is empty: give at least one server URL")
        for url in self.base_urls:
            parsed = urllib.parse.urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"vllm_server.base_urls: {redact_url(url)!r} is not an http(s) URL such as http://127.0.0.1:8000")
            if self.api_key and has_credentials(url):
                raise ValueError(
                    f"vllm_server.base_urls: {redact_url(url)!r} carries credentials and an API key is set too; an HTTP "
                    "request has one Authorization header: use one or the other"
                )
        if self.concurrency < 1 or self.max_tokens < 1 or self.max_retries < 0 or self.max_attempts_per_sample < 1:
            raise ValueError("vllm_server: concurrency, max_tokens and max_attempts_per_sample must be >= 1, max_retries >= 0")

    @property
    def servers(self) -> tuple[str, ...]:
        """The base URLs requests go to, credentials included: never log these, show :attr:`shown_servers`."""
        return tuple(u.rstrip("/").removesuffix("/v1") for u in self.base_urls)

    @property
    def shown_servers(self) -> tuple[str, ...]:
        return tuple(redact_url(s) for s in self.servers)

    def settings(self) -> dict[str, Any]:
        """What a finished shard records of how it was made: the identity, the retry policy, whether ids were asked for."""
        return {
            **self.identity(),
            "allow_truncated": self.allow_truncated,
            "max_attempts_per_sample": self.max_attempts_per_sample,
            "return_token_ids": self.return_token_ids,
        }

    def request_fields(self) -> dict[str, Any]:
        """The request body without the messages: the identity's fields, plus ``return_token_ids`` when asked for.

        ``extra_body`` is merged last, so a value given there wins.
        """
        fields: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens}
        fields.update({k: v for k, v in self.sampling.items() if v is not None})
        if self.return_token_ids:
            fields["return_token_ids"] = True
        fields.update(self.extra_body)
        return fields

    def identity(self) -> dict[str, Any]:
        """What decides the responses (lineage): model, max_tokens, sampling, extra_body; never URLs or secrets.

        ``return_token_ids`` only adds the ids to the response, so it is left
        out: turning it on or off must not supersede every finished shard.
        """
        fields: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens}
        fields.update({k: v for k, v in self.sampling.items() if v is not None})
        fields.update(self.extra_body)
        return fields


@dataclass(frozen=True)
class Sample:
    id: str
    messages: list[dict[str, str]]


class PreflightError(RuntimeError):
    """The server is not fit for the run; raised before any sample is sent."""


class ServerUnavailableError(RuntimeError):
    """Too many samples in a row failed after all retries; the run stops, the journal keeps what is done."""


@dataclass
class PreflightReport:
    servers: list[str]
    max_model_len: int | None  # the smallest over the servers
    models: dict[str, dict[str, Any]]  # per server: the /v1/models entry of the model
    canary_reasoning_field: str
    canary_reasoning: str


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


class GenerationClient:
    """One aiohttp session over every server; ``complete`` never raises for a sample's failure."""

    def __init__(self, config: GenerationConfig, log: Callable[[str], None] | None = None):
        self.config = config
        self.log = log or (lambda line: None)
        self._session: aiohttp.ClientSession | None = None
        self._servers = config.servers
        self._shown = dict(zip(config.servers, config.shown_servers))  # what rows, logs and errors say
        self._inflight: dict[str, int] = {s: 0 for s in self._servers}
        self._down_until: dict[str, float] = {}  # servers that refused a connection and have not answered since
        self._turn = 0
        self._fields = config.request_fields()  # built once: this runs per request at thousands/s
        # What the run's metadata shows of failover: failed attempts per server (connection errors,
        # retryable statuses) and retries that went to another server than the attempt that failed.
        self.failed_attempts: Counter[str] = Counter()
        self.failovers = 0

    async def __aenter__(self) -> GenerationClient:
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.config.concurrency + 8, limit_per_host=0),
            # sock_read bounds the wait for the (non-streamed) response: one whole generation.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s),
            headers=headers,
        )
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("GenerationClient used outside `async with`")
        return self._session

    def _pick_server(self, avoid: str | None = None) -> str:
        """The server with the fewest requests in flight (rotating among ties), avoiding the one that just failed
        and those that recently refused connections (unless no other is left)."""
        servers = self._servers
        if len(servers) == 1:
            return servers[0]
        self._turn = (self._turn + 1) % len(servers)
        order = servers[self._turn :] + servers[: self._turn]
        now = time.monotonic()
        up = [s for s in order if self._usable(s, now)]
        # Preference: an up server other than the one that just failed, then that one if it is up (it
        # answered, e.g. 503: alive), then any other, then any.
        candidates = [s for s in up if s != avoid] or up or [s for s in order if s != avoid] or list(order)
        return min(candidates, key=self._inflight.__getitem__)

    def _usable(self, server: str, now: float) -> bool:
        """Not known to be down; or down, its cooldown over, and no probe request already in flight to it."""
        until = self._down_until.get(server)
        return until is None or (until <= now and self._inflight[server] == 0)

    def _mark_down(self, server: str, exc: BaseException) -> None:
        """``server`` could not be connected to: keep new requests off it for a while (logged once per outage)."""
        if len(self._servers) == 1:
            return  # nowhere else to go: the retries and their backoff decide
        now = time.monotonic()
        if server not in self._down_until:
            others = [self._shown[s] for s in self._servers if s != server]
            self.log(
                f"server {self._shown[server]} unreachable ({_describe(exc)}): new requests go to {', '.join(others)} "
                f"until it answers again (tried every {SERVER_DOWN_COOLDOWN_S:g}s)"
            )
        self._down_until[server] = now + SERVER_DOWN_COOLDOWN_S

    def _backoff_s(self, attempt: int, retry_after: str | None) -> float:
        """Exponential backoff with jitter (half fixed, half random), or the server's Retry-After if longer."""
        ceiling = min(self.config.retry_backoff_max_s, self.config.retry_backoff_s * 2 ** (attempt - 1))
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)
        try:
            delay = max(delay, min(float(retry_after), self.config.retry_backoff_max_s)) if retry_after else delay
        except ValueError:
            pass  # an HTTP-date Retry-After: keep our own backoff
        return delay

    # ------------------------------------------------------------ pre-flight
    async def preflight(
        self, canary_prompt: str = DEFAULT_CANARY_PROMPT, canary_max_tokens: int = DEFAULT_CANARY_MAX_TOKENS, canary_client: CanaryClient | None = None
    ) -> PreflightReport:
        """``/health``, ``/v1/models`` and one canary completion with reasoning on every server, or PreflightError.

        The canary goes through the ``openai`` SDK: ``canary_client`` makes one
        for a server's base URL (the Dagster resource passes its
        ``get_async_client``); by default one is built from this client's config.
        """
        models: dict[str, dict[str, Any]] = {}
        for server in self.config.servers:
            shown = self._shown[server]
            status, body = await self._get(server, "/health")
            if status != 200:
                raise PreflightError(f"vLLM server {shown}: /health answered HTTP {status}: {_excerpt(body)}")
            status, body = await self._get(server, "/v1/models")
            if status in (401, 403):
                raise PreflightError(f"vLLM server {shown}: /v1/models answered HTTP {status}: the API key is missing or wrong (set VLLM_API_KEY)")
            if status != 200:
                raise PreflightError(f"vLLM server {shown}: /v1/models answered HTTP {status}: {_excerpt(body)}")
            try:
                listed = {m["id"]: m for m in json.loads(body)["data"]}
            except (ValueError, KeyError, TypeError):
                raise PreflightError(f"vLLM server {shown}: /v1/models did not return a model list: {_excerpt(body)}") from None
            if self.config.model not in listed:
                raise PreflightError(
                    f"vLLM server {shown} does not serve model {self.config.model!r} (it serves {sorted(listed)}); "
                    "set vllm_server.served_model_name to one of them"
                )
            models[shown] = listed[self.config.model]
        lengths = [m["max_model_len"] for m in models.values() if isinstance(m.get("max_model_len"), int)]
        max_model_len = min(lengths) if lengths else None
        if max_model_len is not None and self.config.max_tokens > max_model_len:
            raise PreflightError(
                f"vllm_server.max_tokens={self.config.max_tokens} exceeds the server's max_model_len={max_model_len} "
                "(vLLM rejects every such request): lower max_tokens or serve with a longer --max-model-len"
            )
        canary_row: dict[str, Any] = {}
        for server in self.config.servers:
            shown = self._shown[server]
            sdk = (canary_client or self._sdk_client)(server)
            async with sdk:
                canary_row = await self._canary(sdk, canary_prompt, min(self.config.max_tokens, canary_max_tokens))
            if canary_row["error"]:
                raise PreflightError(f"vLLM server {shown}: the canary request failed: {canary_row['error']}")
            if not (canary_row["reasoning"] or "").strip():
                raise PreflightError(
                    f"vLLM server {shown}: the canary response carries no reasoning (neither message.reasoning nor "
                    f"message.reasoning_content; finish_reason={canary_row['finish_reason']!r}, content starts "
                    f"{(canary_row['content'] or '')[:80]!r}). {NO_REASONING_DIAGNOSIS}"
                )
        return PreflightReport(
            servers=list(self.config.shown_servers),
            max_model_len=max_model_len,
            models=models,
            canary_reasoning_field=canary_row["reasoning_field"],
            canary_reasoning=canary_row["reasoning"][:200],
        )

    def _sdk_client(self, server: str) -> openai.AsyncOpenAI:
        config = self.config
        return async_openai_client(
            server, config.api_key, connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.read_timeout_s, max_retries=config.max_retries
        )

    async def _canary(self, sdk: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> dict[str, Any]:
        """The canary's completion as a row's fields (``error`` set when it failed); read from the raw JSON as every row is.

        The SDK retries what :meth:`complete` retries (connection errors, 408, 429, 5xx); the request body is the
        samples' own (sampling, ``extra_body``, ``return_token_ids``), sent as the SDK's ``extra_body``.
        """
        import openai

        fields = dict(self._fields)
        fields["max_tokens"] = max_tokens
        model = fields.pop("model")
        try:
            raw = await sdk.chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                extra_body=fields,
                extra_headers={SAMPLE_ID_HEADER: CANARY_ID},
            )
            payload = raw.content
        except openai.APIStatusError as exc:
            return {"error": f"{HTTP_ERROR} {exc.status_code}: {_error_message(exc.response.content)}"}
        except openai.APITimeoutError:
            return {"error": f"{READ_TIMEOUT}: no response within {self.config.read_timeout_s:g}s"}
        except openai.APIConnectionError as exc:
            return {"error": f"{CONNECTION_ERROR}: {_describe(exc.__cause__ or exc)}"}
        try:
            return {**parse_completion(json.loads(payload)), "error": None}
        except ValueError as exc:  # JSONDecodeError is a ValueError
            return {"error": f"{MALFORMED_RESPONSE}: {exc}; body starts {_excerpt(payload)}"}

    async def _get(self, server: str, path: str) -> tuple[int, bytes]:
        try:
            async with self.session.get(server + path, timeout=aiohttp.ClientTimeout(total=60, sock_connect=self.config.connect_timeout_s)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PreflightError(f"vLLM server {self._shown[server]}: {path} did not answer: {_describe(exc)}") from None

    async def prompt_tokens(self, messages: Sequence[Mapping[str, str]], sample_id: str) -> int | None:
        """The prompt's exact token count from vLLM's ``/tokenize`` (None: no such endpoint, or no answer within ``tokenize_timeout_s``)."""
        server = self._pick_server()
        body = {"model": self.config.model, "messages": list(messages), "add_generation_prompt": True}
        body.update({k: v for k, v in self.config.extra_body.items() if k == "chat_template_kwargs"})
        timeout = aiohttp.ClientTimeout(total=self.config.tokenize_timeout_s, sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.post(
                server + "/tokenize", json=body, headers={SAMPLE_ID_HEADER: _header_value(sample_id)}, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    return None
                count = (await resp.json(content_type=None)).get("count")
                return count if isinstance(count, int) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None

    # ------------------------------------------------------------ one sample
    async def complete(self, sample: Sample, max_tokens: int | None = None, server: str | None = None, prior_attempts: int = 0) -> dict[str, Any]:
        """One row for ``sample``: the response, or the error it ended in after the retries the error allows.

        ``prior_attempts`` are the requests earlier runs sent for the sample:
        the row's ``attempts`` counts on from them. With a fixed ``seed`` the
        request of a sample sent again uses ``seed + prior_attempts``: the same
        seed would bring back the same rejected response.

        The row carries ``_retries_exhausted`` (dropped before it is journaled)
        so that the caller can tell a server that is gone from a bad sample.
        """
        fields = dict(self._fields)
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if prior_attempts and isinstance(fields.get("seed"), int):
            fields["seed"] += prior_attempts
        fields["messages"] = sample.messages
        body = _JSON.encode(fields).encode()
        headers = {SAMPLE_ID_HEADER: _header_value(sample.id)}
        sent, chosen = 0, ""
        while True:
            sent += 1
            attempts = prior_attempts + sent
            failed = chosen
            chosen = server or self._pick_server(avoid=failed or None)
            if failed and chosen != failed:
                self.failovers += 1
            started = time.perf_counter()
            retry_after: str | None = None
            self._inflight[chosen] += 1
            try:
                async with self.session.post(chosen + "/v1/chat/completions", data=body, headers=headers) as resp:
                    status, payload = resp.status, await resp.read()
                    if status != 200:
                        retry_after = resp.headers.get("Retry-After")
            except aiohttp.SocketTimeoutError:
                latency = time.perf_counter() - started
                detail = f"{READ_TIMEOUT}: no response within {self.config.read_timeout_s:g}s (not retried: a re-sent slow request only adds load)"
                return self._error_row(sample, detail, chosen, attempts, latency)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
                # Retried (below) on another server when there is one: a reset mid-response (the server
                # died while generating) loses nothing but the time spent on it.
                status, payload, error = None, b"", f"{CONNECTION_ERROR}: {_describe(exc)}"
                if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
                    self._mark_down(chosen, exc)  # nothing listens there (refused, unreachable)
            finally:
                self._inflight[chosen] -= 1
            latency = time.perf_counter() - started
            if status is not None and self._down_until.pop(chosen, None) is not None:
                self.log(f"server {chosen} answers again (HTTP {status}): it gets requests again")
            if status == 200:
                try:
                    parsed = parse_completion(json.loads(payload))
                except ValueError as exc:  # JSONDecodeError is a ValueError
                    return self._error_row(sample, f"{MALFORMED_RESPONSE}: {exc}; body starts {_excerpt(payload)}", chosen, attempts, latency)
                return {"id": sample.id, **parsed, "latency_s": latency, "server": self._shown[chosen], "model": self.config.model, "attempts": attempts, "error": None}
            if status is not None:
                error = f"{HTTP_ERROR} {status}: {_error_message(payload)}"
                if not _retryable_status(status):
                    return self._error_row(sample, error, chosen, attempts, latency)
            self.failed_attempts[chosen] += 1
            if sent > self.config.max_retries:
                row = self._error_row(sample, f"{error} (after {sent} attempts)", chosen, attempts, latency)
                row["_retries_exhausted"] = True
                return row
            await asyncio.sleep(self._backoff_s(sent, retry_after))

    def _error_row(self, sample: Sample, error: str, server: str, attempts: int, latency_s: float) -> dict[str, Any]:
        """A row without a response; ``server`` is where the last request went ("" for none), shown without credentials."""
        return {
            "id": sample.id, "reasoning": None, "content": None, "reasoning_field": "none", "finish_reason": None,
            "prompt_tokens": None, "completion_tokens": None, "latency_s": latency_s, "server": self._shown.get(server, ""),
            "model": self.config.model, "attempts": attempts, "error": redact_credentials(error),
            "prompt_token_ids": None, "output_token_ids": None,
        }  # fmt: skip


# ------------------------------------------------------------------ a shard
@dataclass
class Progress:
    """What the run log shows every few seconds."""

    done: int
    total: int
    errors: int
    output_tokens_per_s: float
    elapsed_s: float
    eta_s: float | None

    def line(self) -> str:
        eta = "?" if self.eta_s is None else _duration(self.eta_s)
        share = self.done / self.total if self.total else 1.0
        return (
            f"{self.done}/{self.total} rows ({share:.0%}), {self.errors} errors, "
            f"{self.output_tokens_per_s:,.0f} output tok/s, elapsed {_duration(self.elapsed_s)}, ETA {eta}"
        )


@dataclass
class ShardOutcome:
    frame: pl.DataFrame  # the shard's rows, as written to Parquet
    preflight: PreflightReport
    reused: int  # rows already durable (journal or earlier Parquet), good, and not sent again
    sent: int  # samples this run sent (or settled without a request)
    wall_s: float  # of the generation, pre-flight excluded
    output_tokens: int  # completion tokens generated by this run
    set_aside: Path | None  # a journal of other inputs, moved aside
    failed_attempts_by_server: dict[str, int] = field(default_factory=dict)  # retryable failures, per server (shown names)
    failovers: int = 0  # retries sent to another server than the attempt that failed
    resent: dict[str, int] = field(default_factory=dict)  # durable rows sent again, by why: error kinds, content failures
    attempts_exhausted: list[str] = field(default_factory=list)  # content failures kept: max_attempts_per_sample reached
    superseded: Path | None = None  # the finished shard of other settings this run moved aside (kept, not deleted)
    reused_from: Path | None = None  # an earlier finished file of these very settings that seeded this run

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def generation_fingerprint(samples: Sequence[Sample], config: GenerationConfig) -> str:
    """What a shard's rows are made of: the prompts themselves and the generation identity.

    A journal or Parquet file with another fingerprint is never resumed from.
    """
    return stable_hash({"prompts": [[s.id, s.messages] for s in samples], "generation": config.identity()})


def generate_shard(
    config: GenerationConfig,
    samples: Sequence[Sample],
    journal_path: Path,
    parquet_path: Path,
    *,
    log: Callable[[str], None] = print,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    canary_prompt: str = DEFAULT_CANARY_PROMPT,
    canary_max_tokens: int = DEFAULT_CANARY_MAX_TOKENS,
    canary_client: CanaryClient | None = None,
) -> ShardOutcome:
    """Pre-flight, then generate every sample of a shard not yet durable, then write the shard's Parquet.

    Raises PreflightError before anything is written when the server is unfit,
    and ServerUnavailableError (journal kept) when the server goes away mid-shard.
    """
    return asyncio.run(
        _generate_shard(
            config, samples, Path(journal_path), Path(parquet_path), log, progress_interval_s, canary_prompt, canary_max_tokens, canary_client
        )
    )


async def _generate_shard(
    config: GenerationConfig,
    samples: Sequence[Sample],
    journal_path: Path,
    parquet_path: Path,
    log: Callable[[str], None],
    progress_interval_s: float,
    canary_prompt: str,
    canary_max_tokens: int,
    canary_client: CanaryClient | None = None,
) -> ShardOutcome:
    ids = [s.id for s in samples]
    duplicated = [i for i, n in Counter(ids).items() if n > 1]
    if duplicated:
        raise ValueError(f"{len(duplicated)} sample ids occur more than once in the shard (first: {duplicated[:5]}); ids must be unique")
    async with GenerationClient(config, log=log) as client:
        report = await client.preflight(canary_prompt, canary_max_tokens, canary_client)
        log(
            f"pre-flight ok: {', '.join(report.servers)} serve {config.model!r} (max_model_len {report.max_model_len}); "
            f"canary reasoning in message.{report.canary_reasoning_field}"
        )

        fingerprint = generation_fingerprint(samples, config)
        journal = ShardJournal(journal_path, fingerprint)
        rows = journal.load()
        if journal.set_aside:
            log(f"journal {journal_path.name} was written for other prompts or sampling; moved aside to {journal.set_aside.name}")
        seed: list[dict[str, Any]] = []
        reused_from = None
        finished_fingerprint = parquet_fingerprint(parquet_path)
        if finished_fingerprint not in (None, fingerprint):
            log(
                f"{parquet_path.name} was generated with other settings ({_settings_change(parquet_generation(parquet_path), config.settings())}); "
                f"it stays in place until this run finishes, then is kept as {SUPERSEDED_NOTE}"
            )
        if not rows:
            # Re-materialising a finished shard with unchanged inputs (or inputs that come back to those of a
            # kept one): every row is seeded into the journal, so the attempts of rows sent again count on.
            kept = superseded_path(parquet_path, fingerprint)
            source = parquet_path if finished_fingerprint == fingerprint else (kept if kept.is_file() else None)
            if source is not None:
                seed = pl.read_parquet(source).to_dicts()
                rows = {r["id"]: r for r in seed}
                if source == kept:
                    reused_from = kept
                    log(f"reusing {kept.parent.name}/{kept.name}: generated earlier with these very prompts and settings")
        plan = _plan_resend(samples, rows, config)
        if rows:
            log(plan.line(len(samples), config.max_attempts_per_sample))
        pending = plan.pending

        run = _ShardRun(client, journal, rows, pending, len(samples), plan.reused, report.max_model_len, config, log)
        journal.open(seed)
        started = time.perf_counter()
        try:
            await run.execute(progress_interval_s)
        finally:
            journal.close()  # everything finished is durable, also when the run fails
        wall_s = time.perf_counter() - started
        log(run.progress(wall_s).line())

    superseded = keep_superseded(parquet_path, fingerprint, config.settings())
    if superseded is not None:
        log(f"kept the earlier generation of this shard (other settings) as {superseded.parent.name}/{superseded.name}, with its settings in {superseded.with_suffix('.json').name}")
    frame = journal.finalize(parquet_path, ids, rows, ROW_SCHEMA, generation=config.settings())
    return ShardOutcome(
        frame, report, plan.reused, len(pending), wall_s, run.output_tokens, journal.set_aside,
        {client._shown[s]: n for s, n in client.failed_attempts.items()}, client.failovers,
        resent=dict(plan.reasons), attempts_exhausted=plan.exhausted, superseded=superseded, reused_from=reused_from,
    )  # fmt: skip


SUPERSEDED_NOTE = "superseded/<shard>.<fingerprint>.parquet (nothing is deleted)"


@dataclass
class _ResendPlan:
    """What a run of a shard sends, given the rows already durable."""

    pending: list[Sample]
    reused: int  # durable rows kept as they are, good ones
    reasons: Counter[str]  # why durable rows are sent again: "error: <kind>" or a content-failure reason
    exhausted: list[str]  # content failures kept as they are: the sample used its attempts

    def line(self, total: int, max_attempts: int) -> str:
        text = f"resuming: {self.reused} of {total} rows already durable and usable; {len(self.pending)} to send"
        if self.reasons:
            text += f" (sent again: {dict(sorted(self.reasons.items()))})"
        if self.exhausted:
            text += (
                f"; {len(self.exhausted)} rows kept as they are after {max_attempts} attempts each (e.g. {self.exhausted[:3]}): "
                "raise vllm_server.max_attempts_per_sample to send them again"
            )
        return text


def _plan_resend(samples: Sequence[Sample], rows: Mapping[str, Mapping[str, Any]], config: GenerationConfig) -> _ResendPlan:
    """Which samples to send: those without a row, error rows, and content failures with attempts left."""
    failures = content_failures((rows[s.id] for s in samples if s.id in rows), config.allow_truncated)
    plan = _ResendPlan(pending=[], reused=0, reasons=Counter(), exhausted=[])
    for sample in samples:
        row = rows.get(sample.id)
        if row is None:
            plan.pending.append(sample)
        elif row.get("error") is not None:
            plan.pending.append(sample)
            plan.reasons[f"error: {str(row['error']).split(':', 1)[0]}"] += 1
        elif sample.id in failures:
            if (row.get("attempts") or 0) < config.max_attempts_per_sample:
                plan.pending.append(sample)
                plan.reasons[failures[sample.id]] += 1
            else:
                plan.exhausted.append(sample.id)
        else:
            plan.reused += 1
    return plan


def _settings_change(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    """What differs between two generation settings, for the log: ``temperature 0.7 -> 0.71``."""
    if old is None:
        return "settings not recorded in the file"
    keys = sorted(set(old) | set(new), key=str)
    changes = [f"{k} {old.get(k, 'unset')} -> {new.get(k, 'unset')}" for k in keys if old.get(k) != new.get(k)]
    return ", ".join(changes) or "same settings, other prompts"


class _ShardRun:
    """The workers of one shard: ``concurrency`` coroutines that share the list of pending samples."""

    def __init__(self, client, journal, rows, pending, total, reused, max_model_len, config, log):
        self.client: GenerationClient = client
        self.journal: ShardJournal = journal
        self.rows: dict[str, dict[str, Any]] = rows
        self.pending: list[Sample] = pending
        self.total, self.reused = total, reused
        self.max_model_len: int | None = max_model_len
        self.config: GenerationConfig = config
        self.log = log
        self.finished = self.errors = self.output_tokens = 0
        self.consecutive_failures = 0
        self.abort: str | None = None
        self.started = time.perf_counter()

    async def execute(self, progress_interval_s: float) -> None:
        queue = iter(self.pending)
        self.started = time.perf_counter()
        ticker = asyncio.create_task(self._report_every(progress_interval_s))
        workers = [asyncio.create_task(self._work(queue)) for _ in range(min(self.config.concurrency, len(self.pending)))]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for worker in workers:  # one failed (e.g. the disk): stop the others before the session closes
                worker.cancel()
            raise
        finally:
            ticker.cancel()
        if self.abort:
            raise ServerUnavailableError(self.abort)

    async def _work(self, queue) -> None:
        for sample in queue:  # a shared iterator: each sample goes to exactly one worker
            if self.abort:
                return
            prior = (self.rows.get(sample.id) or {}).get("attempts") or 0
            may_be_too_long = self.max_model_len is not None and prompt_tokens_upper_bound(sample.messages) >= self.max_model_len
            row = await (self._checked(sample, prior) if may_be_too_long else self.client.complete(sample, prior_attempts=prior))
            exhausted = row.pop("_retries_exhausted", False)
            self.rows[sample.id] = row
            self.journal.append(row)
            self.finished += 1
            self.output_tokens += row["completion_tokens"] or 0
            if row["error"]:
                self.errors += 1
            self.consecutive_failures = self.consecutive_failures + 1 if exhausted else 0
            if self.consecutive_failures >= self.config.max_consecutive_failures and not self.abort:
                self.abort = (
                    f"{self.consecutive_failures} samples in a row failed after {self.config.max_retries} retries "
                    f"(last: {row['error']}); the server looks unavailable. The journal keeps the "
                    f"{self.reused + self.finished - self.errors} finished rows: rerun the shard to resume."
                )

    async def _checked(self, sample: Sample, prior: int) -> dict[str, Any]:
        """A prompt that might not fit: count it exactly; settle it without a generation request if it does not fit."""
        assert self.max_model_len is not None
        count = await self.client.prompt_tokens(sample.messages, sample.id)
        if count is None:  # no /tokenize (not vLLM), or it timed out: let the server judge
            return await self.client.complete(sample, prior_attempts=prior)
        if count >= self.max_model_len:
            return self.client._error_row(sample, f"{PROMPT_TOO_LONG}: {count} prompt tokens >= max_model_len {self.max_model_len}; not sent", "", prior, 0.0)
        return await self.client.complete(sample, max_tokens=min(self.config.max_tokens, self.max_model_len - count), prior_attempts=prior)

    def progress(self, now: float | None = None) -> Progress:
        elapsed = (time.perf_counter() - self.started) if now is None else now
        left = len(self.pending) - self.finished
        rate = self.finished / elapsed if elapsed > 0 else 0.0
        return Progress(
            done=self.reused + self.finished,
            total=self.total,
            errors=self.errors,
            output_tokens_per_s=self.output_tokens / elapsed if elapsed > 0 else 0.0,
            elapsed_s=elapsed,
            eta_s=left / rate if rate > 0 else (0.0 if left == 0 else None),
        )

    async def _report_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.log(self.progress().line())


# --------------------------------------------------------------- reporting
def shard_summary(frame: pl.DataFrame) -> dict[str, Any]:
    """The figures of a finished shard (Dagster-free; the asset turns them into metadata)."""
    errors = frame.filter(pl.col("error").is_not_null())
    too_long = errors.filter(pl.col("error").str.starts_with(f"{PROMPT_TOO_LONG}:"))
    ok = frame.filter(pl.col("error").is_null())
    no_reasoning = ok.filter(pl.col("reasoning").fill_null("").str.strip_chars() == "")
    latency = ok["latency_s"]
    return {
        "rows": frame.height,
        "errors": errors.height,
        "request_errors": errors.height - too_long.height,  # requests that failed (prompts too long were never sent)
        "prompts_too_long": too_long.height,
        "prompts_too_long_ids": too_long["id"].head(10).to_list(),
        "answered_rows": ok.height,
        "errors_by_kind": dict(Counter(e.split(":", 1)[0] for e in errors["error"].to_list())),
        "error_examples": [f"{r['id']}: {r['error'][:160]}" for r in errors.head(10).iter_rows(named=True)],
        "rows_without_reasoning": no_reasoning.height,
        "rows_without_reasoning_ids": no_reasoning["id"].to_list(),
        "finish_reasons": dict(Counter(str(r) for r in ok["finish_reason"].to_list())),
        "reasoning_fields": dict(Counter(ok["reasoning_field"].to_list())),
        # Answered rows that carry the server's generated ids (validation checks the supervised tokens against them).
        "rows_with_token_ids": ok.filter(pl.col("output_token_ids").is_not_null()).height if "output_token_ids" in ok.columns else 0,
        "completion_tokens": int(ok["completion_tokens"].fill_null(0).sum()),
        "latency_p50_s": float(latency.quantile(0.5, "nearest")) if ok.height else None,
        "latency_p95_s": float(latency.quantile(0.95, "nearest")) if ok.height else None,
    }


def completion_length_histogram(lengths: Sequence[int], bins: int = 12, width: int = 30) -> str:
    """Completion lengths as a markdown histogram, with the median and maximum under it."""
    values = [v for v in lengths if v is not None]
    table = markdown_histogram(values, label="completion tokens", empty="_no completions_", bins=bins, bar_width=width)
    if not values:
        return table
    return table + f"\n\n{len(values)} completions; median {sorted(values)[len(values) // 2]}, max {max(values)} tokens."


# ------------------------------------------------------------------ helpers
def _retryable_status(status: int) -> bool:
    return status in (408, 429) or 500 <= status < 600


def _error_message(payload: bytes) -> str:
    """The server's error message (OpenAI error JSON), else the start of the body."""
    try:
        body = json.loads(payload)
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
        if message:
            return str(message)[:300]
    except (ValueError, AttributeError):
        pass
    return _excerpt(payload)


def _excerpt(payload: bytes, limit: int = 120) -> str:
    return repr(payload[:limit].decode("utf-8", errors="replace"))


def _describe(exc: BaseException) -> str:
    """An exception as a row's error or a log line shows it: a message that quotes a URL loses its credentials."""
    text = redact_credentials(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _header_value(sample_id: str) -> str:
    return urllib.parse.quote(sample_id, safe="")


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")
