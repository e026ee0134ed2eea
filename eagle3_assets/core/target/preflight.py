"""The target pre-flight: what stops a target from going through the whole graph, found before generation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_assets.core.generation.config import DEFAULT_MAX_TOKENS
from eagle3_assets.core.target.description import TargetDescription, TargetError, context_length, read_config
from eagle3_assets.core.target.tokenizer import load_tokenizer

# Room a prompt needs beside the completion in the target's context (a chat template adds tokens too).
MIN_PROMPT_ROOM = 256


def completion_budget(context: int | None, prompt_tokens: Sequence[int], cap: int = DEFAULT_MAX_TOKENS) -> int:
    """``max_tokens`` when none is set: what the target's context leaves beside the longest prompt, at most ``cap``.

    The prompt's room is the longest of ``prompt_tokens`` (rendered with the chat template), at least
    :data:`MIN_PROMPT_ROOM` and at most half the context: one outlier prompt does not shrink every answer (vLLM
    itself gives such a prompt what its context leaves, and one that does not fit at all is settled unsent).
    """
    if not context:
        return cap
    room = min(max(max(prompt_tokens, default=0), MIN_PROMPT_ROOM), context // 2)
    return max(1, min(cap, context - room))


@dataclass(frozen=True)
class TargetSettings:
    """Everything the stages will ask of the target, as configured (the resource builds one)."""

    path: str
    trust_remote_code: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    think_open: str | None = None
    think_close: str | None = None
    end_of_turn: str | None = None


def preflight_problems(settings: TargetSettings, *, max_tokens: int, eval_max_tokens: int) -> list[str]:
    """What stops this target from going through the whole graph, each with the setting to change; [] when fit.

    Run before generation, so that a setting only a later stage reads (the layer
    ids, the think markers, remote code) fails in seconds, not after hours of
    generation and validation.
    """
    from eagle3_assets.core.validation.chat_rendering import ChatRenderer, RenderingError

    problems: list[str] = []
    try:
        config = read_config(settings.path)
    except TargetError as exc:
        return [str(exc)]
    try:
        TargetDescription.from_config(settings.path, config, settings.aux_layer_ids)
    except TargetError as exc:  # the layer ids do not fit this target
        problems.append(str(exc))
    context = context_length(config)
    if context is not None and max_tokens + MIN_PROMPT_ROOM > context:
        problems.append(
            f"vllm_server.max_tokens={max_tokens} leaves under {MIN_PROMPT_ROOM} tokens for the prompt in the target's "
            f"{context}-token context (max_position_embeddings): lower vllm_server.max_tokens"
        )
    if context is not None and eval_max_tokens + MIN_PROMPT_ROOM > context:
        problems.append(
            f"draft_evaluation max_tokens={eval_max_tokens} leaves under {MIN_PROMPT_ROOM} tokens for the prompt in the "
            f"target's {context}-token context: lower draft_evaluation's max_tokens"
        )
    try:
        tokenizer = load_tokenizer(settings.path, settings.trust_remote_code)
    except TargetError as exc:
        return problems + [str(exc)]
    except Exception as exc:  # noqa: BLE001  any failure to load is the finding itself
        return problems + [f"target model {settings.path}: the tokenizer does not load: {type(exc).__name__}: {exc}"]
    try:
        renderer = ChatRenderer(tokenizer, settings.think_open, settings.think_close, settings.end_of_turn)
        messages, reasoning, answer = [{"role": "user", "content": "What is 2 + 2?"}], "Two and two make four.", "4"
        trace = renderer.render(messages, reasoning, answer)
        mask_problem = renderer.supervised_text_problem(trace.input_ids, trace.loss_mask, messages, reasoning, answer)
    except RenderingError as exc:
        problems.append(f"target model {settings.path}: {exc} (target_model.think_open / think_close / end_of_turn)")
    except Exception as exc:  # noqa: BLE001  a template that raises is the finding
        problems.append(f"target model {settings.path}: its chat template does not render a reasoning trace: {type(exc).__name__}: {exc}")
    else:
        if mask_problem:
            problems.append(f"target model {settings.path}: a rendered reasoning trace does not tokenise back to itself: {mask_problem}")
    return problems


# -- serving the target with vLLM (evaluation, the export's load gate) --------------------
