"""The vLLM server (or any OpenAI-compatible one) that regenerates the reasoning traces.

In production it is a long-running service on the GPU host; the platform only
talks to it over HTTP. Every field is a knob in the UI's launchpad; the
defaults come from the environment (:meth:`VLLMServerResource.from_env`):

- ``EAGLE3_VLLM_URLS``: comma-separated base URLs (default ``http://127.0.0.1:8000``);
  requests are spread over them, fewest in flight first;
- ``EAGLE3_SERVED_MODEL``: the served model name; unset, the one model the servers list at ``/v1/models``;
- ``VLLM_API_KEY``: the API key, passed as a Dagster ``EnvVar`` so that the
  value is never shown in the launchpad, the logs or the metadata.

Credentials in a URL of ``EAGLE3_VLLM_URLS`` (``http://user:token@host:8000``,
for a proxy in front of vLLM) stay in the environment: ``base_urls`` holds the
URLs without them (that is what Dagster stores with every run and shows in the
launchpad), and :meth:`VLLMServerResource.request_urls` puts them back for the
requests only. A URL typed with credentials into run config works too, but
Dagster then stores it with the run: the asset warns.

In a notebook (or any script), the resource gives a configured ``openai``
client of the first server (or of the one named): base URL ``<server>/v1``, the
API key of ``VLLM_API_KEY`` (or a placeholder the server ignores when it has no
key), this resource's connect and read timeouts and ``max_retries``::

    from resources.vllm_server import VLLMServerResource

    server = VLLMServerResource.from_env()  # or VLLMServerResource(base_urls=["http://gpu-host:8000"])
    with server.get_client() as client:
        reply = client.chat.completions.create(
            model=server.model_name(), messages=[{"role": "user", "content": "What is 17 + 25?"}], max_tokens=256
        )
    # vLLM's reasoning parser puts the thinking beside the answer (older vLLM: reasoning_content).
    print(reply.choices[0].message.model_extra.get("reasoning"), reply.choices[0].message.content)

``get_async_client()`` is the asyncio twin (``async with server.get_async_client() as client``).
The generation pre-flight's canary goes through it; the generation itself uses
its own aiohttp client, which ``bench/generation.py`` measures faster than the
SDK at the concurrency a GPU server needs.

The Dagster pool :data:`GENERATION_POOL` holds generation steps: with its limit
at 1 (the default), a backfill of many shards generates one shard at a time, so
in-flight requests stay at ``concurrency`` instead of shards x concurrency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dagster import ConfigurableResource, DagsterInstance, EnvVar
from pydantic import Field

from eagle3_assets.core.settings import environment as env_vars
from eagle3_assets.core.generation.client import DEFAULT_CANARY_MAX_TOKENS, DEFAULT_CANARY_PROMPT
from eagle3_assets.core.generation.config import DEFAULT_MAX_TOKENS, DEFAULT_PROGRESS_INTERVAL_S, GenerationConfig, GenerationSettings, Sampling
from eagle3_assets.core.settings.job_schema import values_of
from eagle3_assets.core.generation.openai_client import async_openai_client, openai_client
from eagle3_assets.core.generation.redaction import has_credentials, redact_url
from resources.pools import ensure_pool_limit

if TYPE_CHECKING:
    import openai

URLS_ENV = env_vars.VLLM_URLS.name
MODEL_ENV = env_vars.SERVED_MODEL.name
API_KEY_ENV = env_vars.VLLM_API_KEY.name

GENERATION_POOL = "vllm_generation"


def urls_from_env() -> list[str]:
    """``EAGLE3_VLLM_URLS`` as given, credentials included: for requests only, never for config or display."""
    return env_vars.VLLM_URLS.get()


def shown_urls_from_env() -> list[str]:
    """``EAGLE3_VLLM_URLS`` without credentials: what config, the launchpad and the instance's records hold."""
    return [redact_url(u) for u in urls_from_env()]


def with_env_credentials(url: str) -> str:
    """``url`` with the credentials ``EAGLE3_VLLM_URLS`` gives for it (matched by the URL without them), else as it is."""
    if has_credentials(url):
        return url
    secret = {redact_url(u).rstrip("/"): u for u in urls_from_env() if has_credentials(u)}
    return secret.get(url.rstrip("/"), url)


def served_model_from_env() -> str:
    """``EAGLE3_SERVED_MODEL``, or empty: the one model the servers list (:meth:`VLLMServerResource.model_name`)."""
    return env_vars.SERVED_MODEL.get() or ""


class VLLMServerResource(Sampling, GenerationSettings, ConfigurableResource):
    """Where and how to generate: servers, model, sampling, timeouts, retries, concurrency.

    The settings are :class:`~eagle3_assets.core.generation.config.GenerationSettings` and
    :class:`~eagle3_assets.core.generation.config.Sampling` themselves (their one default, description and limits);
    this class adds where the servers are and the pre-flight's knobs.
    """

    # The environment's values are also the schema's defaults (read when the code location loads):
    # run config for this resource replaces the values given in Python as a whole, so a launchpad
    # override of one field (max_tokens, say) would otherwise send the run to the class defaults.
    base_urls: list[str] = Field(
        default=shown_urls_from_env(),
        description=f"base URLs of the servers (no /v1); requests are spread over them. Credentials for a URL go into ${URLS_ENV}, not here",
    )
    served_model_name: str = Field(
        default=served_model_from_env(),
        description="the model name the server serves (vLLM's --served-model-name); empty: the one model the first server lists at /v1/models",
    )
    canary_prompt: str = Field(default=DEFAULT_CANARY_PROMPT, description="pre-flight request whose response must carry reasoning")
    canary_max_tokens: int = Field(default=DEFAULT_CANARY_MAX_TOKENS, gt=0, description="completion token limit of the pre-flight request")
    progress_interval_s: float = Field(default=DEFAULT_PROGRESS_INTERVAL_S, gt=0, description="seconds between progress lines in the run log")

    @classmethod
    def from_env(cls, **overrides: Any) -> VLLMServerResource:
        """The deployment's defaults: ``EAGLE3_VLLM_URLS``, ``EAGLE3_SERVED_MODEL``, ``VLLM_API_KEY``."""
        fields: dict[str, Any] = {"base_urls": shown_urls_from_env(), "served_model_name": served_model_from_env()}
        if env_vars.VLLM_API_KEY.is_set():  # an EnvVar of an unset variable fails the run: only pass it when set
            fields["api_key"] = EnvVar(API_KEY_ENV)
        return cls(**{**fields, **overrides})

    def sampling(self) -> dict[str, Any]:
        return Sampling(**values_of(self, Sampling)).request_fields()

    def request_urls(self) -> list[str]:
        """``base_urls`` with the credentials ``EAGLE3_VLLM_URLS`` gives for them (matched by the URL without them)."""
        return [with_env_credentials(u) for u in self.base_urls]

    def credentials_in_config(self) -> bool:
        """Whether run config itself carries URL credentials (Dagster stores run config with the run)."""
        return any(has_credentials(u) for u in self.base_urls)

    def request_api_key(self) -> str | None:
        """The key requests carry; unset in run config (a launchpad override of other fields drops it): the run's own environment."""
        key = self.api_key
        if isinstance(key, EnvVar):  # outside a run (a notebook): only a run resolves it, when it initialises the resource
            key = key.get_value()
        return key or env_vars.VLLM_API_KEY.get()

    def get_client(self, base_url: str | None = None) -> openai.OpenAI:
        """An ``openai.OpenAI`` client of ``base_url`` (default: the first server), configured as this resource is."""
        return openai_client(self._client_url(base_url), self.request_api_key(), **self._client_settings())

    def get_async_client(self, base_url: str | None = None) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client of ``base_url`` (default: the first server), configured as this resource is."""
        return async_openai_client(self._client_url(base_url), self.request_api_key(), **self._client_settings())

    def _client_url(self, base_url: str | None) -> str:
        return self.request_urls()[0] if base_url is None else with_env_credentials(base_url)

    def _client_settings(self) -> dict[str, Any]:
        return {"connect_timeout_s": self.connect_timeout_s, "read_timeout_s": self.read_timeout_s, "max_retries": self.max_retries}

    def model_name(self) -> str:
        """``served_model_name``, or when empty the one model the first server lists (an error naming them when it lists several)."""
        if self.served_model_name:
            return self.served_model_name
        with self.get_client() as client:
            listed = sorted(m.id for m in client.models.list())
        if len(listed) != 1:
            raise ValueError(
                f"vllm_server.served_model_name is empty and {redact_url(self.base_urls[0])} serves {listed}: "
                f"set served_model_name (or ${MODEL_ENV}) to the one to generate with"
            )
        return listed[0]

    def generation_config(self, max_tokens: int | None = None) -> GenerationConfig:
        """The client's settings; ``max_tokens`` where this resource leaves it unset (what the target's context leaves)."""
        return GenerationConfig(
            base_urls=tuple(self.request_urls()),
            model=self.model_name(),
            sampling=self.sampling(),
            # The rest by name: concurrency, timeouts, retries, what a rerun resends.
            **{
                **values_of(self, GenerationSettings), "api_key": self.request_api_key(), "extra_body": dict(self.extra_body),
                "max_tokens": self.max_tokens or max_tokens or DEFAULT_MAX_TOKENS,
            },
        )  # fmt: skip


def ensure_generation_pool_limit(instance: DagsterInstance, limit: int | None = None) -> int:
    """The generation pool's limit (``$EAGLE3_GENERATION_POOL_LIMIT`` or 1) unless one was set by hand; the limit in force."""
    return ensure_pool_limit(instance, GENERATION_POOL, env_vars.GENERATION_POOL_LIMIT, limit)
