"""What a generation run is told: the servers, the model, sampling, timeouts and the retry policy."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict

from eagle3_assets.core.settings.job_schema import JobSchema, given, setting
from eagle3_assets.core.generation.redaction import has_credentials, redact_url
from eagle3_assets.core.generation.response_rules import DEFAULT_MAX_ATTEMPTS_PER_SAMPLE

# The story's completion limit: long reasoning fits in it; the default where the target's context has room for it
# (:func:`eagle3_assets.core.target.preflight.completion_budget`).
DEFAULT_MAX_TOKENS = 8192
DEFAULT_PROGRESS_INTERVAL_S = 5.0  # seconds between progress lines in a generation run's log


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
    concurrency: int = setting(
        128, "requests in flight per run, across all the shards of the run (the server's --max-num-seqs is the natural value)", gt=0
    )
    max_tokens: int | None = setting(
        None,
        f"completion token limit per request, reasoning included; unset: what the target's context leaves for the shard's "
        f"prompts, at most {DEFAULT_MAX_TOKENS:,}",
        gt=0,
    )
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
    # Resolved by the resource (vllm_server.max_tokens, else what the target's context leaves): always a number here.
    max_tokens: int = setting(DEFAULT_MAX_TOKENS, "completion token limit per request, reasoning included", gt=0)
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
