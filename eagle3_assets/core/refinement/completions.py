"""Completions served with a draft, kept with what a replay needs: their token ids and the server's per-step counts.

vLLM (0.32) returns, asked with ``return_token_ids``, the prompt's token ids
(``prompt_token_ids``) and the choice's (``token_ids``, the stop token
included): the ids the target saw and sampled, with no detokenise-retokenise
round trip. Started with ``--per-request-spec-decode-metrics detailed``, each
response also carries its verify steps' accepted and drafted counts
(:class:`~eagle3_assets.core.evaluation.spread.PromptAcceptance`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_assets.core.evaluation.output_position import RequestSteps
from eagle3_assets.core.evaluation.spread import PromptAcceptance
from eagle3_assets.core.generation.openai_client import async_openai_client


@dataclass(frozen=True)
class ServedCompletion:
    """One request served with a draft: the ids the target saw and wrote, and the server's count of its steps."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    acceptance: PromptAcceptance | None  # None: the server returned no per-request counts

    @property
    def input_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]

    @property
    def loss_mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)

    def steps(self) -> RequestSteps | None:
        return self.acceptance.steps(len(self.completion_ids)) if self.acceptance else None

    @classmethod
    def from_response(cls, response) -> ServedCompletion:
        """From a chat completion (an ``openai`` SDK object) asked with ``return_token_ids``."""
        prompt = (getattr(response, "model_extra", None) or {}).get("prompt_token_ids")
        completion = (getattr(response.choices[0], "model_extra", None) or {}).get("token_ids")
        if prompt is None or completion is None:
            raise ValueError("the response has no prompt_token_ids / token_ids: a vLLM that ignores return_token_ids")
        if len(completion) != int(response.usage.completion_tokens):
            raise ValueError(f"{len(completion)} token ids for {response.usage.completion_tokens} completion tokens")
        return cls(tuple(int(i) for i in prompt), tuple(int(i) for i in completion), PromptAcceptance.from_response(response))


def serve_completions(
    base_url: str, model: str, conversations: Sequence[list[dict]], max_tokens: int, concurrency: int = 8
) -> list[ServedCompletion | None]:
    """Each conversation once, greedy, ``concurrency`` in flight, in order (None: the request failed; no retries)."""
    import openai

    async def send_all() -> list[ServedCompletion | None]:
        gate = asyncio.Semaphore(concurrency)
        async with async_openai_client(base_url, connect_timeout_s=10, read_timeout_s=1800, max_retries=0) as client:

            async def one(messages: list[dict]) -> ServedCompletion | None:
                async with gate:
                    try:
                        response = await client.chat.completions.create(
                            model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True}
                        )
                    except openai.APIError:
                        return None
                    return ServedCompletion.from_response(response)

            return await asyncio.gather(*(one(m) for m in conversations))

    return asyncio.run(send_all())
