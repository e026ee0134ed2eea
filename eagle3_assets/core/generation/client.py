"""The generation client: one aiohttp session over every server, with retries, failover and a pre-flight.

Why a hand-written aiohttp client for the samples and not the ``openai`` SDK:
the SDK, on its default transport and on its aiohttp one alike, becomes the
bottleneck at the concurrency a GPU server needs: against an instant stub it
answers a small fraction of what plain aiohttp does (``bench/generation.py``
prints both figures; docs/performance.md). The pre-flight's single canary request does go through
the SDK (:mod:`.openai_client`). The wire format is exactly OpenAI's chat
completions either way (:mod:`.completions`), so any server that speaks it works.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from eagle3_assets.core.generation.completions import (
    CANARY_ID,
    CONNECTION_ERROR,
    HTTP_ERROR,
    MALFORMED_RESPONSE,
    READ_TIMEOUT,
    SAMPLE_ID_HEADER,
    Sample,
    body_excerpt,
    describe_error,
    parse_completion,
    retryable_status,
    sample_id_header_value,
    server_error_message,
)
from eagle3_assets.core.generation.config import GenerationConfig
from eagle3_assets.core.generation.openai_client import async_openai_client
from eagle3_assets.core.generation.redaction import redact_credentials
from eagle3_assets.core.generation.response_rules import NO_REASONING_DIAGNOSIS

if TYPE_CHECKING:
    import openai

# Makes the pre-flight's canary client for a server's base URL (credentials included; the caller closes it).
CanaryClient = Callable[[str], "openai.AsyncOpenAI"]

_JSON = json.JSONEncoder(ensure_ascii=False)  # one encoder for every request body, not one per call
DEFAULT_CANARY_PROMPT = "What is 17 + 25? Think it through step by step, then give the answer."
DEFAULT_CANARY_MAX_TOKENS = 512
# A server that refused a connection gets no new request for this long while another server is up,
# then one request at a time until one is answered (a circuit breaker's half-open state). Without it
# a dead server, having nothing in flight, is the "fewest in flight" choice for every new request:
# each sample would pay a failed attempt and a backoff before its retry went elsewhere.
SERVER_DOWN_COOLDOWN_S = 10.0


class PreflightError(RuntimeError):
    """The server is not fit for the run; raised before any sample is sent."""


@dataclass
class PreflightReport:
    servers: list[str]
    max_model_len: int | None  # the smallest over the servers
    models: dict[str, dict[str, Any]]  # per server: the /v1/models entry of the model
    canary_reasoning_field: str
    canary_reasoning: str


@dataclass
class AttemptTally:
    """What failover cost the samples of one shard: failed attempts per server (connection errors, retryable
    statuses) and retries that went to another server than the attempt that failed. A run generates several
    shards at once over one client, so each shard keeps its own."""

    failed_attempts: Counter[str] = field(default_factory=Counter)
    failovers: int = 0


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
                f"server {self._shown[server]} unreachable ({describe_error(exc)}): new requests go to {', '.join(others)} "
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
                raise PreflightError(f"vLLM server {shown}: /health answered HTTP {status}: {body_excerpt(body)}")
            status, body = await self._get(server, "/v1/models")
            if status in (401, 403):
                raise PreflightError(f"vLLM server {shown}: /v1/models answered HTTP {status}: the API key is missing or wrong (set VLLM_API_KEY)")
            if status != 200:
                raise PreflightError(f"vLLM server {shown}: /v1/models answered HTTP {status}: {body_excerpt(body)}")
            try:
                listed = {m["id"]: m for m in json.loads(body)["data"]}
            except (ValueError, KeyError, TypeError):
                raise PreflightError(f"vLLM server {shown}: /v1/models did not return a model list: {body_excerpt(body)}") from None
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
            return {"error": f"{HTTP_ERROR} {exc.status_code}: {server_error_message(exc.response.content)}"}
        except openai.APITimeoutError:
            return {"error": f"{READ_TIMEOUT}: no response within {self.config.read_timeout_s:g}s"}
        except openai.APIConnectionError as exc:
            return {"error": f"{CONNECTION_ERROR}: {describe_error(exc.__cause__ or exc)}"}
        try:
            return {**parse_completion(json.loads(payload)), "error": None}
        except ValueError as exc:  # JSONDecodeError is a ValueError
            return {"error": f"{MALFORMED_RESPONSE}: {exc}; body starts {body_excerpt(payload)}"}

    async def _get(self, server: str, path: str) -> tuple[int, bytes]:
        try:
            async with self.session.get(server + path, timeout=aiohttp.ClientTimeout(total=60, sock_connect=self.config.connect_timeout_s)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PreflightError(f"vLLM server {self._shown[server]}: {path} did not answer: {describe_error(exc)}") from None

    async def prompt_tokens(self, messages: Sequence[Mapping[str, str]], sample_id: str) -> int | None:
        """The prompt's exact token count from vLLM's ``/tokenize`` (None: no such endpoint, or no answer within ``tokenize_timeout_s``)."""
        server = self._pick_server()
        body = {"model": self.config.model, "messages": list(messages), "add_generation_prompt": True}
        body.update({k: v for k, v in self.config.extra_body.items() if k == "chat_template_kwargs"})
        timeout = aiohttp.ClientTimeout(total=self.config.tokenize_timeout_s, sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.post(
                server + "/tokenize", json=body, headers={SAMPLE_ID_HEADER: sample_id_header_value(sample_id)}, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    return None
                count = (await resp.json(content_type=None)).get("count")
                return count if isinstance(count, int) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None

    # ------------------------------------------------------------ one sample
    async def complete(
        self, sample: Sample, max_tokens: int | None = None, server: str | None = None, prior_attempts: int = 0, tally: AttemptTally | None = None
    ) -> dict[str, Any]:
        """One row for ``sample``: the response, or the error it ended in after the retries the error allows.

        ``prior_attempts`` are the requests earlier runs sent for the sample:
        the row's ``attempts`` counts on from them. With a fixed ``seed`` the
        request of a sample sent again uses ``seed + prior_attempts``: the same
        seed would bring back the same rejected response.

        The row carries ``_retries_exhausted`` (dropped before it is journaled)
        so that the caller can tell a server that is gone from a bad sample.
        Failed attempts and failovers are counted into ``tally`` (the sample's shard's).
        """
        tally = tally if tally is not None else AttemptTally()
        fields = dict(self._fields)
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if prior_attempts and isinstance(fields.get("seed"), int):
            fields["seed"] += prior_attempts
        fields["messages"] = sample.messages
        body = _JSON.encode(fields).encode()
        headers = {SAMPLE_ID_HEADER: sample_id_header_value(sample.id)}
        sent, chosen = 0, ""
        while True:
            sent += 1
            attempts = prior_attempts + sent
            failed = chosen
            chosen = server or self._pick_server(avoid=failed or None)
            if failed and chosen != failed:
                tally.failovers += 1
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
                status, payload, error = None, b"", f"{CONNECTION_ERROR}: {describe_error(exc)}"
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
                    return self._error_row(sample, f"{MALFORMED_RESPONSE}: {exc}; body starts {body_excerpt(payload)}", chosen, attempts, latency)
                return {"id": sample.id, **parsed, "latency_s": latency, "server": self._shown[chosen], "model": self.config.model, "attempts": attempts, "error": None}
            if status is not None:
                error = f"{HTTP_ERROR} {status}: {server_error_message(payload)}"
                if not retryable_status(status):
                    return self._error_row(sample, error, chosen, attempts, latency)
            tally.failed_attempts[self._shown[chosen]] += 1
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
