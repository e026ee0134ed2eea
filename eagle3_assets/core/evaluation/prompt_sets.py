"""The held-out sets ``draft_evaluation`` scores beside the standard one, built from the held-out prompts only.

EAGLE 3.1 claims its gain where a draft trained on one layout of short prompts
meets something else: long contexts and other chat templates. Two sets are
built from the standard (held-out) set, deterministically, so the same draft
and the same held-out prompts always give the same set:

- ``long_context``: each held-out question after a long system prompt of
  reference notes made of the *other* held-out questions (cycled from the next
  one), cut with the target's own tokenizer so that the rendered prompt fills
  ``fill`` of what the evaluation's ``max_model_len`` leaves beside its
  ``max_tokens``. No training text can enter: the notes are held-out questions.
- ``template_perturbation``: each held-out conversation (the same questions)
  under another system prompt, and for half of them another turn layout (an
  opening exchange before the question), in place of the training layout the
  traces used (the prompt's own messages). The variants are taken in turn by
  the prompt's position, so every variant occurs.

A user set is a file of prompts (any form the prompts asset reads, e.g. a public
benchmark's prompts in JSONL/Parquet with ``messages``) named in the run config;
``draft_evaluation`` refuses it, like the standard set, where a prompt also
occurs in a training shard. :func:`check_built_from` is the proof for the built
sets: every question they ask and every note they carry is a question of the
standard set, which the asset has checked against the training shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from eagle3_assets.core.prompts.heldout import question_text

STANDARD = "standard"
LONG_CONTEXT = "long_context"
TEMPLATE_PERTURBATION = "template_perturbation"
BUILTIN_SETS = (LONG_CONTEXT, TEMPLATE_PERTURBATION)

# System prompts unlike any a prompt set of the platform carries; the training layout is the prompt's own messages.
PERTURBED_SYSTEM_PROMPTS = (
    "You are a careful assistant. Think the problem through before you answer, and state the final answer plainly.",
    "SYSTEM NOTICE: responses are reviewed for accuracy. Answer in full sentences; show each step of your reasoning.",
    "Du bist ein hilfsbereiter Assistent. Answer in the language of the question, concisely and correctly.",
)
# A turn layout other than the single question: an opening exchange before it.
OPENING_EXCHANGE = (
    {"role": "user", "content": "Hello! I have a question for you, is that all right?"},
    {"role": "assistant", "content": "Of course. Go ahead and ask."},
)
NOTES_HEADER = "Reference notes for this conversation (questions other users asked; consult them if they help):\n\n"


@dataclass(frozen=True)
class PromptSet:
    """One held-out set: its prompts, and how it was built (the report records both)."""

    name: str
    ids: list[str]
    conversations: list[list[dict]]
    how: str
    source: str = ""
    prompt_tokens: list[int] = field(default_factory=list)  # rendered length per prompt, where counted

    def describe(self) -> dict:
        described = {"name": self.name, "prompts": len(self.conversations), "how": self.how, "source": self.source}
        if self.prompt_tokens:
            described["prompt_tokens"] = {"min": min(self.prompt_tokens), "max": max(self.prompt_tokens)}
        return described


def _without_system(conversation: list[dict]) -> list[dict]:
    return [dict(m) for m in conversation if m.get("role") != "system"]


def template_perturbation_set(ids: Sequence[str], conversations: Sequence[list[dict]]) -> PromptSet:
    """The same held-out questions under other system prompts and, for half of them, an opening exchange."""
    variants = [(system, opening) for opening in (False, True) for system in PERTURBED_SYSTEM_PROMPTS]
    perturbed = []
    for index, conversation in enumerate(conversations):
        system, opening = variants[index % len(variants)]
        turns = [{"role": "system", "content": system}] + ([dict(m) for m in OPENING_EXCHANGE] if opening else [])
        perturbed.append(turns + _without_system(conversation))
    how = (
        f"the standard set's {len(conversations)} conversations, their system prompt replaced by one of "
        f"{len(PERTURBED_SYSTEM_PROMPTS)} others and, for half of them, an opening user/assistant exchange "
        f"before the question (the {len(variants)} variants in turn, by position)"
    )
    return PromptSet(TEMPLATE_PERTURBATION, [f"{i}:perturbed" for i in ids], perturbed, how)


def rendered_length(tokenizer, conversation: list[dict]) -> int:
    """Tokens of ``conversation`` as vLLM's chat endpoint renders it (the target's chat template, generation prompt added)."""
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):  # a BatchEncoding in newer transformers
        rendered = rendered["input_ids"]
    return len(rendered)


def long_context_budget(max_model_len: int, max_tokens: int, fill: float) -> int:
    """Prompt tokens a long-context prompt is cut to: ``fill`` of the context left beside the completion."""
    room = max_model_len - max_tokens
    if room <= 0:
        raise ValueError(f"the evaluation's max_tokens {max_tokens} leaves no room for a prompt in max_model_len {max_model_len}")
    return int(room * fill)


def long_context_set(
    ids: Sequence[str], conversations: Sequence[list[dict]], tokenizer, max_model_len: int, max_tokens: int, fill: float = 0.8
) -> PromptSet:
    """Each held-out question after a system prompt of the other held-out questions, filling ``fill`` of the context.

    The notes are cut in tokens of the target's tokenizer; decoding a cut and rendering it again can shift a token
    or two, so the cut is corrected until the rendered prompt is within the budget.
    """
    budget = long_context_budget(max_model_len, max_tokens, fill)
    questions = [question_text(c) for c in conversations]
    built, lengths = [], []
    for index, conversation in enumerate(conversations):
        turns = _without_system(conversation)
        base = rendered_length(tokenizer, [{"role": "system", "content": NOTES_HEADER}] + turns)
        if base >= budget:
            raise ValueError(f"held-out prompt {ids[index]} alone takes {base} tokens, more than the long-context budget {budget}")
        others = [questions[(index + step) % len(questions)] for step in range(1, len(questions))] or [questions[index]]
        note_tokens: list[int] = []
        step = 0
        while len(note_tokens) < budget - base:  # cycle the other questions until the notes are long enough
            note_tokens += tokenizer.encode(others[step % len(others)] + "\n\n", add_special_tokens=False)
            step += 1
        keep = budget - base
        for _ in range(8):
            notes = tokenizer.decode(note_tokens[:keep], skip_special_tokens=True)
            candidate = [{"role": "system", "content": NOTES_HEADER + notes}] + turns
            length = rendered_length(tokenizer, candidate)
            if length <= budget:
                break
            keep -= length - budget
        else:
            raise ValueError(f"held-out prompt {ids[index]}: the long-context notes could not be cut to {budget} tokens")
        built.append(candidate)
        lengths.append(length)
    how = (
        f"each of the standard set's {len(conversations)} questions after a system prompt of reference notes made of the "
        f"other held-out questions, cut with the target's tokenizer to {fill:.0%} of the {max_model_len - max_tokens} tokens "
        f"max_model_len {max_model_len} leaves beside max_tokens {max_tokens} ({min(lengths)}-{max(lengths)} prompt tokens)"
    )
    return PromptSet(LONG_CONTEXT, [f"{i}:long" for i in ids], built, how, prompt_tokens=lengths)


def check_built_from(built: PromptSet, standard_conversations: Sequence[list[dict]]) -> None:
    """Refuse a built set that asks a question, or carries a note, that is not a question of the standard set."""
    questions = {question_text(c) for c in standard_conversations}
    corpus = "\n\n".join(sorted(questions))
    for prompt_id, conversation in zip(built.ids, built.conversations):
        if question_text(conversation) not in questions:
            raise ValueError(f"prompt set {built.name}, prompt {prompt_id}: its question is not one of the held-out set's")
        for message in conversation:
            content = message["content"]
            if message["role"] == "system" and content.startswith(NOTES_HEADER):
                # Every piece of the notes is held-out text; the last one may be cut inside a character.
                pieces = [p for p in content[len(NOTES_HEADER):].split("\n\n") if p]
                pieces[-1:] = [pieces[-1].rstrip("\ufffd")] if pieces else []
                stray = next((p for p in pieces if p not in corpus), None)
                if stray is not None:
                    raise ValueError(f"prompt set {built.name}, prompt {prompt_id}: its notes hold text that is no held-out question: {stray[:60]!r}")


def build_sets(
    names: Sequence[str], ids: Sequence[str], conversations: Sequence[list[dict]], *, tokenizer=None,
    max_model_len: int = 0, max_tokens: int = 0, fill: float = 0.8,
) -> list[PromptSet]:  # fmt: skip
    """The built-in sets ``names`` (of :data:`BUILTIN_SETS`), each from the standard set only, checked to be."""
    unknown = [n for n in names if n not in BUILTIN_SETS]
    if unknown:
        raise ValueError(f"prompt sets {unknown}: the built-in sets are {list(BUILTIN_SETS)} (a file of your own goes in user_prompt_sets)")
    built = []
    for name in names:
        if name == LONG_CONTEXT:
            built.append(long_context_set(ids, conversations, tokenizer, max_model_len, max_tokens, fill))
        else:
            built.append(template_perturbation_set(ids, conversations))
        check_built_from(built[-1], conversations)
    return built


def standard_set(ids: Sequence[str], conversations: Sequence[list[dict]], source: str) -> PromptSet:
    return PromptSet(STANDARD, list(ids), list(conversations), "the held-out prompts as given (the checks are judged on this set)", source)


def user_set(name: str, source: str) -> PromptSet:
    from eagle3_assets.core.evaluation.acceptance import load_conversations

    ids, conversations = load_conversations(source)
    return PromptSet(name, ids, conversations, "the user's own prompts file, as given (checked against the training shards)", source)


def render_set_table(by_set: Sequence[dict]) -> str:
    """Per set: prompts, mean acceptance length of the trained draft and the baseline, per position, spread over prompts."""
    rows = [
        "| set | prompts | trained | baseline | trained per position | spread over prompts (min / p10 / median / p90 / max) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for entry in by_set:
        trained, baseline = entry["results"]["trained"], entry["results"].get("baseline")  # none with baseline: none
        positions = " ".join(f"{r:.2f}" for r in trained["acceptance_rate_per_position"] or [])
        s = trained.get("spread_over_prompts") or {}
        spread_cell = " / ".join(f"{s[k]:.2f}" for k in ("min", "p10", "median", "p90", "max")) if s else ""
        baseline_cell = f"{baseline['mean_acceptance_length']:.3f}" if baseline else "not served"
        rows.append(
            f"| {entry['name']} | {entry['prompts']} | {trained['mean_acceptance_length']:.3f} | "
            f"{baseline_cell} | {positions} | {spread_cell} |"
        )
    return "\n".join(rows)
