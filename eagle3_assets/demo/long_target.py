"""A built-in long-trace target: reasoning traces of thousands of tokens whose length the question sets.

The other built-in targets write ~55 tokens a trace; the user's traces run to
8,192 (about 4,000 on average), and a draft's acceptance thousands of tokens
into a trace is what matters there. This target writes traces of that length,
built in code like the others (deterministic, fingerprinted, cached, checked by
what it does: :mod:`.build_check`).

What a tiny model (width 64) trained for a few minutes can write in format for
8,000 tokens: every line of a trace is fixed-width and follows from the line
before it by a local rule, and the question says how many lines there are.
Each line starts with a countdown ``n d d d`` (the steps left, one token per
digit, units first) that the first line copies from the question and each next
line decrements; the line with ``n 0 0 0`` is the last, so the stop is in sight
of the model, and the length comes from the question. Numbers are written units
first so that a borrow (or a carry) shows in the digit the model has just
written: the tens fall by one exactly when the units just written are 9, a rule
of the last token, where written the usual way it is a rule of the digits
still to come. After the countdown, each
task family has its own state, tokens per line and entropy:

- ``sum`` (step-by-step arithmetic): a digit ``a`` and a running sum
  ``s`` of four digits (units first), ``s`` grows by ``a`` each line (mod
  10,000): 12 tokens a line, nothing left to chance;
- ``rotate`` (passes over a word): six letters, rotated left by one each line:
  12 tokens a line, nothing left to chance;
- ``flips`` (counting): a coin flip ``h`` or ``t`` written freely, and the count
  of heads so far: 12 tokens a line, one free bit a line;
- ``dice`` (rolls): six rolls 1-6 written freely: 12 tokens a line, 15.5 free
  bits a line.

Digits and letters of a line are written apart (``n 2 5 0``) so that each is
one token of the byte-level BPE (its pre-tokeniser never merges across a
space), which keeps every line of a family the same number of tokens.

The prompt set holds single questions and multi-turn conversations (2-4 user
turns, the earlier ones answered in the history), under several system
prompts; the trace answers the last user turn.

The model is trained on windows of its traces (the start with the prompt, the
end with the answer, and windows between), not on whole 8,000-token
conversations: every rule is local, so a window teaches it, at a fraction of
the cost. Head size 64 (vLLM's CPU attention backend crashes with 16).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.demo.build_check import checked_build
from eagle3_assets.demo.target_building import deterministic_torch, generation_prompt, trained_tokenizer, write_model_dir

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
BOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
LONG_REASONING_PARSER = "deepseek_r1"  # the generation prompt opens the think block, as the tiny target's does
MAX_COMPLETION_TOKENS = 8192  # the user's cap: the longest trace with its answer stays under it

# The tiny target's markup: ChatML whose generation prompt opens the think block; any role renders alike.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)

SYSTEM_PROMPTS = [
    "You are a careful assistant. Work through every step before you answer.",
    "Show your working line by line, then give the result.",
    "You are a patient tutor. Reason step by step.",
]
LETTERS = "abcdefghijklmnopqrstuvwxyz"

Trace = tuple[str, str, str]  # question, reasoning, answer


def _spaced(value: int | str, width: int = 0) -> str:
    """Letters apart; a number's digits apart and units first, so a borrow or carry shows in the digit just written."""
    return " ".join(reversed(str(value).zfill(width))) if isinstance(value, int) else " ".join(value)


# Each family: its name, the range of its step count (lines - 1), and how it writes a trace for a seeded generator.
def _sum_trace(rng: random.Random, steps: int) -> Trace:
    a, s = rng.randint(1, 9), rng.randint(0, 9999)
    first = f"n {_spaced(steps, 3)} a {a} s {_spaced(s, 4)}"
    lines = []
    for left in range(steps, -1, -1):
        lines.append(f"n {_spaced(left, 3)} a {a} s {_spaced(s, 4)}")
        s = (s + a) % 10000
    last = lines[-1].split(" s ")[1]
    return (f"Add a to s once for every step, keeping four digits: {first}", "\n".join(lines), f"The sum is {last}.")


def _rotate_trace(rng: random.Random, steps: int) -> Trace:
    word = "".join(rng.choice(LETTERS) for _ in range(6))
    first = f"n {_spaced(steps, 3)} w {_spaced(word)}"
    lines = []
    for left in range(steps, -1, -1):
        lines.append(f"n {_spaced(left, 3)} w {_spaced(word)}")
        word = word[1:] + word[0]
    last = lines[-1].split(" w ")[1]
    return (f"Rotate the word left by one letter at every step: {first}", "\n".join(lines), f"The word ends as {last}.")


def _flips_trace(rng: random.Random, steps: int) -> Trace:
    first = f"n {_spaced(steps, 3)}"
    lines, heads = [], 0
    for left in range(steps, -1, -1):
        flip = rng.choice("ht")
        heads += flip == "h"
        lines.append(f"n {_spaced(left, 3)} f {flip} c {_spaced(heads, 4)}")
    last = lines[-1].split(" c ")[1]
    return (f"Flip a coin at every step and count the heads: {first}", "\n".join(lines), f"Heads came up {last} times.")


def _dice_trace(rng: random.Random, steps: int) -> Trace:
    first = f"n {_spaced(steps, 3)}"
    lines = [f"n {_spaced(left, 3)} r {' '.join(str(rng.randint(1, 6)) for _ in range(6))}" for left in range(steps, -1, -1)]
    return (f"Roll six dice at every step and write each roll: {first}", "\n".join(lines), f"The last roll was {lines[-1][-1]}.")


# (family, its writer, fewest and most steps): 12 tokens a line in every family (one offset back to the line before),
# so the longest trace with its answer (646 lines) stays under MAX_COMPLETION_TOKENS.
FAMILIES = [
    ("sum", _sum_trace, 150, 640),
    ("rotate", _rotate_trace, 60, 420),
    ("flips", _flips_trace, 250, 645),
    ("dice", _dice_trace, 120, 600),
]


def make_trace(rng: random.Random, family_index: int) -> Trace:
    _, write, lo, hi = FAMILIES[family_index % len(FAMILIES)]
    return write(rng, rng.randint(lo, hi))


def make_conversations(count: int, seed: int) -> list[tuple[list[dict], str, str]]:
    """``count`` conversations: (messages up to the last user turn, its reasoning, its answer).

    Every family in turn for the last question; a third of the conversations
    are multi-turn (2-4 user turns, earlier questions answered in the history:
    content only, as the platform's prompt records keep it), and most open with
    one of several system prompts.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        messages = []
        system = rng.randrange(len(SYSTEM_PROMPTS) + 1)
        if system < len(SYSTEM_PROMPTS):
            messages.append({"role": "system", "content": SYSTEM_PROMPTS[system]})
        turns = rng.choice([2, 3, 4]) if rng.random() < 1 / 3 else 1
        for _ in range(turns - 1):
            question, _, answer = make_trace(rng, rng.randrange(len(FAMILIES)))
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        question, reasoning, answer = make_trace(rng, i)
        messages.append({"role": "user", "content": question})
        rows.append((messages, reasoning, answer))
    return rows


def long_prompts(count: int = 64, seed: int = 1) -> list[dict]:
    """The long target's demo dataset, in open-perfectblend's ``conversations`` form (history included)."""
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [
        {"id": f"long-{i:04d}", "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}
        for i, (messages, _, _) in enumerate(make_conversations(count, seed))
    ]


def fingerprint_questions() -> list[list[dict]]:
    """The conversations the long target's greedy outputs are recorded on (build_check): demo ones, one multi-turn."""
    return [messages for messages, _, _ in make_conversations(8, 1)]


@dataclass(frozen=True)
class LongTargetSpec:
    seed: int = 0
    vocab_size: int = 384
    hidden_size: int = 64
    num_layers: int = 4  # vLLM's default aux layer ids (2, 2, 1) repeat; the platform picks (1, 2, 3)
    # Four query heads of 64 (vLLM's CPU attention crashes at 16) over one key/value head: heads enough to find the
    # line before and the question, and a KV cache of 2 KiB a token (float32), so 128 traces of 8,400 fit 2.1 GiB.
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 192
    # the longest prompt (a system prompt and three answered turns) and 8,192 completion tokens
    max_position_embeddings: int = 10240
    # Each token attends to the last 128 only (Mistral's sliding window, which transformers and vLLM's CPU attention
    # both apply): the model is trained on 128-token windows, and with full attention 200 tokens into a trace it
    # met contexts it never saw and ended its turn (measured through vLLM at temperature 1: 55 of 55 traces ended
    # in under 820 tokens without closing the think block). Windowed, 8,000 tokens in look like 100.
    sliding_window: int = 128  # at least window
    conversations: int = 600
    window: int = 128  # tokens per training row: a window of a conversation, ten lines
    train_steps: int = 700
    batch_size: int = 32
    learning_rate: float = 1e-2

    @property
    def fingerprint(self) -> str:
        return stable_hash({"spec": dataclasses.asdict(self), "template": CHAT_TEMPLATE, "format": 1})


def response_text(reasoning: str, answer: str) -> str:
    """What the target writes after the generation prompt (which already holds ``<think>\\n``)."""
    return f"{reasoning}\n{THINK_CLOSE}\n\n{answer}{IM_END}"


def _render(messages: list[dict]) -> str:
    import jinja2

    return jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def training_pairs(spec: LongTargetSpec) -> list[tuple[str, str]]:
    """(prompt text, completion text) of every training conversation."""
    return [(_render(messages), response_text(reasoning, answer)) for messages, reasoning, answer in make_conversations(spec.conversations, spec.seed)]


def build_tokenizer(spec: LongTargetSpec, pairs: list[tuple[str, str]]):
    corpus = [text for pair in pairs[:200] for text in pair]  # 200 conversations hold every token the rest use
    return trained_tokenizer(
        corpus, spec, special_tokens=[BOS, IM_START, IM_END], think_markers=[THINK_OPEN, THINK_CLOSE], chat_template=CHAT_TEMPLATE,
        bos_token=BOS, eos_token=IM_END, pad_token=BOS,
    )  # fmt: skip


def train_on_windows(model, rows: list[tuple[list[int], int]], spec: LongTargetSpec, pad_id: int, label: str, log=print) -> float:
    """Train ``model`` on windows of ``spec.window`` tokens of ``rows`` (token ids, where the completion starts).

    Half the windows hold the end of the prompt and the first lines (the first
    line copies the last question's numbers, the hardest rule: one line a
    trace), a quarter end at the conversation's end (the last lines, the close,
    the answer), a quarter lie between; the
    loss is on the completion's tokens only. AdamW with a one-cycle schedule; the
    windows come from a generator seeded with ``spec.seed`` alone.
    """
    import torch

    started = time.monotonic()
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=spec.learning_rate, total_steps=spec.train_steps, pct_start=0.1)
    model.train()
    for step in range(spec.train_steps):
        ids = torch.full((spec.batch_size, spec.window), pad_id, dtype=torch.long)
        mask = torch.zeros((spec.batch_size, spec.window), dtype=torch.long)
        picks = torch.randint(0, len(rows), (spec.batch_size,), generator=generator).tolist()
        kinds = torch.randint(0, 4, (spec.batch_size,), generator=generator).tolist()
        offsets = torch.rand(spec.batch_size, generator=generator).tolist()
        for b, (pick, kind, offset) in enumerate(zip(picks, kinds, offsets)):
            tokens, completion_start = rows[pick]
            last_start = max(0, len(tokens) - spec.window)
            # the start: the end of the prompt (the last question) and the first lines; the end; between
            start = max(0, min(completion_start - spec.window // 2, last_start)) if kind < 2 else last_start if kind == 2 else int(offset * last_start)
            window = tokens[start : start + spec.window]
            ids[b, : len(window)] = torch.tensor(window)
            mask[b, : len(window)] = (torch.arange(start, start + len(window)) >= completion_start).long()
        logits = model(input_ids=ids).logits[:, :-1]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == spec.train_steps - 1:
            log(f"{label}: step {step + 1}/{spec.train_steps} loss {loss.item():.4f} ({time.monotonic() - started:.0f}s)")
    model.eval()
    return loss.item()


def build_long_target(out_dir: Path, spec: LongTargetSpec = LongTargetSpec(), log=print) -> Path:
    """Train tokenizer and model from ``spec.seed`` and save an HF model directory atomically."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    started = time.monotonic()
    torch.manual_seed(spec.seed)
    pairs = training_pairs(spec)
    tokenizer = build_tokenizer(spec, pairs)
    rows = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"], len(prompt_ids)))
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    # Trained as Llama: on windows of spec.window <= sliding_window tokens the window masks nothing, so the weights
    # are those of the windowed model; then saved as Mistral (Llama's layers and weight names, with the window).
    model = LlamaForCausalLM(LlamaConfig(**shape))
    log(f"long target: {len(rows)} conversations tokenised in {time.monotonic() - started:.0f}s")
    with deterministic_torch():
        final_loss = train_on_windows(model, rows, spec, tokenizer.pad_token_id, "long target", log)
    windowed = MistralForCausalLM(MistralConfig(**shape, sliding_window=spec.sliding_window))
    windowed.load_state_dict(model.state_dict())
    model = windowed.eval()

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)

    write_model_dir(out_dir, write, {"fingerprint": spec.fingerprint, "spec": dataclasses.asdict(spec), "final_loss": final_loss})
    log(f"long target: trained and saved in {time.monotonic() - started:.0f}s at {out_dir}")
    return Path(out_dir)


def ensure_long_target(out_dir: Path, spec: LongTargetSpec = LongTargetSpec(), log=print) -> Path:
    """The cached target at ``out_dir``, rebuilt when missing, built from another spec or doing other than recorded."""
    return checked_build("long", Path(out_dir), spec, log=log)


# One line of each family, after the countdown: what the first line copies from the question and each line keeps.
_LINE_PATTERNS = {
    "sum": r"n \d \d \d a \d s \d \d \d \d",
    "rotate": r"n \d \d \d w [a-z] [a-z] [a-z] [a-z] [a-z] [a-z]",
    "flips": r"n \d \d \d f [ht] c \d \d \d \d",
    "dice": r"n \d \d \d r [1-6] [1-6] [1-6] [1-6] [1-6] [1-6]",
}
_QUESTION_FAMILY = {"Add a to s": "sum", "Rotate the word": "rotate", "Flip a coin": "flips", "Roll six dice": "dice"}


def format_break(question: str, reasoning: str | None, answer: str | None, finish_reason: str | None) -> str | None:
    """Why a response to ``question`` breaks the long target's format, or None when it keeps it.

    In format: the think block closed (a reasoning and an answer, finish ``stop``),
    every reasoning line of the question's family's form, the countdown falling by
    one a line to ``0 0 0``. The content of a line (a wrong sum, a letter out of
    turn) is not the format, nor is the count the first line starts from
    (:func:`steps_as_asked` says whether it is the question's).
    """
    import re

    family = next((name for opening, name in _QUESTION_FAMILY.items() if question.startswith(opening)), None)
    if family is None:
        return "not a question of the long target's families"
    if finish_reason != "stop":
        return f"finish_reason {finish_reason}"
    if not reasoning or not answer:
        return "no reasoning" if not reasoning else "no answer after the think block"
    lines = reasoning.strip("\n").split("\n")
    for index, line in enumerate(lines):
        if not re.fullmatch(_LINE_PATTERNS[family], line):
            return f"line {index} {line[:40]!r} is not a {family} line"
        if index and _count(line) != _count(lines[index - 1]) - 1:
            return f"line {index} counts {_count(line)} after {_count(lines[index - 1])}"
    if _count(lines[-1]) != 0:
        return f"the last line counts {_count(lines[-1])}, not 0"
    return None


def steps_as_asked(question: str, reasoning: str | None) -> bool:
    """Whether the first line's countdown is the step count ``question`` asks for (so the length is the question's)."""
    first = (reasoning or "").strip("\n").split("\n")[0]
    return first.startswith("n ") and first[:7] == "n " + question.split(": n ", 1)[1][:5]


def _count(line: str) -> int:
    """A line's countdown (its digits are written units first)."""
    return int(line[2:7].replace(" ", "")[::-1])
