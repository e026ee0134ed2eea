"""Render a prompt and the target's response back into the exact token sequence the target saw and wrote.

The draft must learn the target's *own* output, thinking tokens included, so a
trace is rebuilt the way it was produced rather than the way a chat template
would re-render history:

- the prompt is the target's chat template applied with
  ``add_generation_prompt=True`` and tokenised without extra special tokens,
  which is what vLLM's chat endpoint does;
- the completion is the text the target generated after that prompt. vLLM's
  reasoning parsers split it verbatim at the end-of-think marker (dropping a
  leading start marker the model wrote itself), so it is rebuilt as
  ``[<think>] + reasoning + </think> + content + <end of turn>``. The start
  marker belongs to the completion only when the template's generation prompt
  did not already open the think block (the tiny target's does, as do
  DeepSeek-R1 and Qwen3 style templates); the end-of-turn token is there only
  when the generation stopped on it (not for a truncated row).

``loss_mask`` is 1 over every completion token and 0 over the prompt (system,
user and earlier assistant turns, template headers). The completion is
tokenised on its own, as the target produced it after the prompt, so the mask
boundary never falls inside a token. Re-tokenising the text gives the
canonical BPE split of what the target wrote. That is only a reconstruction:
where the server returns its own ids (vLLM's ``return_token_ids``, kept in
``raw_responses``), validation requires the rendered ids to equal them token by
token (:meth:`ChatRenderer.token_difference`), so a trace whose text fields do
not reassemble into what the target generated (a ``</think>`` it never wrote, a
sampled split BPE would not make) is rejected rather than taught to the draft.

Dagster-free on purpose: the validation asset and the tests use it directly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_assets.core.storage.files import stable_hash

# Think-marker pairs used by public reasoning models, most common first. The
# target's own pair is the first whose two strings are tokens of its
# vocabulary or appear in its chat template; an explicit override wins.
KNOWN_THINK_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("◁think▷", "◁/think▷"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
    ("<thinking>", "</thinking>"),
)

# A character no prompt or template produces, to find where an assistant turn's
# content ends in a rendered template (Unicode private use area).
_SENTINEL = "\ue000"


class RenderingError(ValueError):
    """The target's tokenizer or template does not give what rendering needs."""


@dataclass(frozen=True)
class RenderedTrace:
    prompt_text: str
    completion_text: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 over completion tokens, 0 over prompt tokens

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def prompt_ids(self) -> list[int]:
        """The unsupervised head: the prompt as the template renders it."""
        return self.input_ids[: self.num_tokens - sum(self.loss_mask)]

    @property
    def completion_ids(self) -> list[int]:
        """The supervised tail: what the target is taken to have generated."""
        return self.input_ids[self.num_tokens - sum(self.loss_mask) :]


def _added_token_strings(tokenizer) -> set[str]:
    added = set(tokenizer.get_added_vocab())
    added.update(str(t) for t in getattr(tokenizer, "all_special_tokens", []) or [])
    return added


def detect_think_markers(tokenizer, think_open: str | None = None, think_close: str | None = None) -> tuple[str, str]:
    """The target's think markers: the override when given, else a known pair found in its vocabulary or template."""
    if think_open and think_close:
        return think_open, think_close
    if think_open or think_close:
        raise RenderingError("think marker override needs both think_open and think_close")
    added = _added_token_strings(tokenizer)
    vocab = tokenizer.get_vocab()
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    for pair in KNOWN_THINK_MARKERS:
        if all(marker in added or marker in vocab for marker in pair) or all(marker in template for marker in pair):
            return pair
    raise RenderingError(
        "cannot find the target's think markers in its tokenizer or chat template "
        f"(tried {', '.join(a for a, _ in KNOWN_THINK_MARKERS)}); set think_open and think_close explicitly"
    )


def detect_end_of_turn(tokenizer, end_of_turn: str | None = None) -> str:
    """The token that ends an assistant turn: the override, else what the template writes after an answer, else eos.

    Rendering a one-exchange conversation and reading the added token right after
    the assistant's content finds e.g. ``<|im_end|>`` (ChatML) or ``<|eot_id|>``
    (Llama 3), which is the token generation stops on even where eos differs.
    """
    if end_of_turn:
        return end_of_turn
    added = sorted(_added_token_strings(tokenizer), key=len, reverse=True)
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
    except Exception:  # templates that refuse a finished conversation: fall back to eos
        text = None
    if isinstance(text, str) and _SENTINEL in text:
        tail = text[text.rindex(_SENTINEL) + 1 :]
        for token in added:
            if token and tail.startswith(token):
                return token
    if tokenizer.eos_token:
        return str(tokenizer.eos_token)
    raise RenderingError("the target's tokenizer has no eos token and its template shows no end-of-turn token; set end_of_turn")


class ChatRenderer:
    """Renders (prompt, reasoning, answer) into the target's chat template and tokenises it with a loss mask."""

    def __init__(self, tokenizer, think_open: str | None = None, think_close: str | None = None, end_of_turn: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise RenderingError("the target's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.think_open, self.think_close = detect_think_markers(tokenizer, think_open, think_close)
        self.end_of_turn = detect_end_of_turn(tokenizer, end_of_turn)

    # -- text -------------------------------------------------------------

    def prompt_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if not messages:
            raise RenderingError("a prompt needs at least one message")
        return self.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False)

    def prompt_opens_think_block(self, prompt_text: str) -> bool:
        """Whether the generation prompt already holds the start marker (so the target wrote only what follows)."""
        return prompt_text.rstrip().endswith(self.think_open)

    def completion_text(self, reasoning: str, content: str, *, think_opened_by_prompt: bool, finished: bool = True) -> str:
        """What the target wrote after the prompt, rebuilt from the reasoning parser's two fields."""
        start = "" if think_opened_by_prompt else self.think_open
        end = self.end_of_turn if finished else ""
        return f"{start}{reasoning}{self.think_close}{content}{end}"

    def template_opens_think_block(self) -> bool:
        """Whether this template's generation prompt opens the think block (for a one-question prompt)."""
        return self.prompt_opens_think_block(self.prompt_text([{"role": "user", "content": "hi"}]))

    # -- tokens -----------------------------------------------------------

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def render_batch(self, rows: Sequence[tuple[Sequence[Mapping[str, Any]], str, str, bool]]) -> list[RenderedTrace]:
        """Render ``(messages, reasoning, content, finished)`` rows, tokenising the batch in one call."""
        prompts = [self.prompt_text(messages) for messages, _, _, _ in rows]
        completions = [
            self.completion_text(reasoning, content, think_opened_by_prompt=self.prompt_opens_think_block(prompt), finished=finished)
            for prompt, (_, reasoning, content, finished) in zip(prompts, rows)
        ]
        traces = []
        for prompt, completion, prompt_ids, completion_ids in zip(prompts, completions, self._encode(prompts), self._encode(completions)):
            traces.append(
                RenderedTrace(
                    prompt_text=prompt,
                    completion_text=completion,
                    input_ids=list(prompt_ids) + list(completion_ids),
                    loss_mask=[0] * len(prompt_ids) + [1] * len(completion_ids),
                )
            )
        return traces

    def render(self, messages: Sequence[Mapping[str, Any]], reasoning: str, content: str, *, finished: bool = True) -> RenderedTrace:
        return self.render_batch([(messages, reasoning, content, finished)])[0]

    # -- the inverse, for the alignment gate --------------------------------

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def supervised_text_problem(
        self,
        input_ids: Sequence[int],
        loss_mask: Sequence[int],
        messages: Sequence[Mapping[str, Any]],
        reasoning: str,
        content: str,
        *,
        finished: bool = True,
    ) -> str | None:
        """Why a row's mask does not cover exactly the target's output, or None when it does.

        The prompt is rendered again from ``messages``: the ids must start with
        it and supervision must start right after it. The supervised tokens must
        then decode to the completion rebuilt from ``reasoning`` and
        ``content``. A mask shifted against the ids, cut short, or spilling into
        the prompt fails one of these; the decode alone cannot tell a start
        marker the prompt wrote from one the target wrote, the boundary can.
        """
        if len(input_ids) != len(loss_mask):
            return f"input_ids has {len(input_ids)} tokens but loss_mask {len(loss_mask)}"
        if any(m not in (0, 1) for m in loss_mask):
            return "loss_mask holds values other than 0 and 1"
        positions = [i for i, m in enumerate(loss_mask) if m]
        if not positions:
            return "no supervised token"
        first, last = positions[0], positions[-1]
        if last - first + 1 != len(positions):
            return "supervised tokens are not one contiguous span"
        prompt = self.prompt_text(messages)
        prompt_ids = self._encode([prompt])[0]
        if list(input_ids[: len(prompt_ids)]) != list(prompt_ids):
            return "input_ids do not start with the rendered prompt"
        if first != len(prompt_ids):
            return f"supervision starts at token {first} but the prompt ends at token {len(prompt_ids)}"
        expected = self.completion_text(
            reasoning, content, think_opened_by_prompt=self.prompt_opens_think_block(prompt), finished=finished
        )
        decoded = self.decode(input_ids[first : last + 1])
        if decoded != expected:
            return f"supervised tokens decode to {_excerpt(decoded)} instead of {_excerpt(expected)}"
        return None

    def token_difference(self, ours: Sequence[int], server: Sequence[int], what: str) -> str | None:
        """Where ``ours`` first departs from the server's ``server`` ids, both tokens shown; None when they are equal.

        ``what`` names the sequence (``prompt``, ``completion``) in the text, e.g.
        ``completion token 17 of 40 (ours: 41): server 12 '.' , ours 7 '</think>'``.
        """
        ours, server = list(ours), list(server)
        if ours == server:
            return None
        position = next((i for i, (a, b) in enumerate(zip(ours, server)) if a != b), min(len(ours), len(server)))
        return (
            f"{what} token {position} of {len(server)} (ours: {len(ours)}): "
            f"server {self._token_at(server, position)}, ours {self._token_at(ours, position)}"
        )

    def _token_at(self, ids: Sequence[int], position: int) -> str:
        if position >= len(ids):
            return "<none: sequence ended>"
        try:
            text = repr(self.decode([ids[position]]))
        except Exception:  # an id outside the vocabulary: the id alone says enough
            text = "<not in the vocabulary>"
        return f"{ids[position]} {text}"

    def fingerprint(self) -> str:
        """Identifies everything that decides the rendered ids, for the data version."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        vocab_digest = (
            hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]
            if backend is not None
            else stable_hash(sorted(self.tokenizer.get_vocab().items()))
        )
        return stable_hash(
            {
                "chat_template": self.tokenizer.chat_template,
                "think": [self.think_open, self.think_close],
                "end_of_turn": self.end_of_turn,
                "vocab": vocab_digest,
                "format": 1,
            }
        )


def _excerpt(text: str, width: int = 60) -> str:
    if len(text) <= 2 * width:
        return repr(text)
    return f"{text[:width]!r}...{text[-width:]!r}"
