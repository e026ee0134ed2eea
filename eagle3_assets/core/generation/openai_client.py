"""``openai`` SDK clients for an OpenAI-compatible server (vLLM), built one way for every caller.

The SDK serves where requests are few and a typed client helps: the
generation pre-flight's canary, the evaluation passes, a notebook
(:meth:`resources.vllm_server.VLLMServerResource.get_client`). The generation
hot path keeps its own aiohttp client: ``bench/generation.py`` measures the SDK,
even on its aiohttp transport, far below the goal there.

Credentials in a server URL (``http://user:token@host:8000``) go to the SDK's
HTTP client inside ``base_url``, which sends them as Basic authorization in
place of the bearer key; nothing here prints a URL or a key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

# The SDK refuses to build a client without a key; a vLLM started without --api-key ignores the header.
PLACEHOLDER_API_KEY = "EMPTY"


def openai_base_url(server: str) -> str:
    """The SDK's ``base_url`` for a server given with or without ``/v1``."""
    return server.rstrip("/").removesuffix("/v1") + "/v1"


def openai_client_options(
    server: str, api_key: str | None, *, connect_timeout_s: float, read_timeout_s: float, max_retries: int
) -> dict:
    """The keyword arguments of ``openai.OpenAI`` / ``openai.AsyncOpenAI`` for ``server`` (the key among them: never log this)."""
    import openai

    return {
        "base_url": openai_base_url(server),
        "api_key": api_key or PLACEHOLDER_API_KEY,
        # One read timeout for a whole (non-streamed) generation, a short one to connect.
        "timeout": openai.Timeout(read_timeout_s, connect=connect_timeout_s),
        # The SDK retries connection errors, timeouts, 408, 409, 429 and 5xx, with its own backoff.
        "max_retries": max_retries,
    }


def openai_client(
    server: str, api_key: str | None = None, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 1800.0, max_retries: int = 2
) -> openai.OpenAI:
    """A blocking client of ``server``'s ``/v1`` API."""
    import openai

    return openai.OpenAI(**openai_client_options(server, api_key, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, max_retries=max_retries))


def async_openai_client(
    server: str, api_key: str | None = None, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 1800.0, max_retries: int = 2
) -> openai.AsyncOpenAI:
    """An asyncio client of ``server``'s ``/v1`` API (close it: ``async with`` or ``await client.close()``)."""
    import openai

    return openai.AsyncOpenAI(
        **openai_client_options(server, api_key, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, max_retries=max_retries)
    )
