"""The long-trace target's task families, prompt set and format check (the target itself: :mod:`.long_target`).

Apart from the model so that :mod:`.build_check` can read the conversations the target's greedy outputs are
recorded on without importing the module that builds it.
"""

from __future__ import annotations

import random

MAX_COMPLETION_TOKENS = 8192  # the user's cap: the longest trace with its answer stays under it

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


def _countdown(left: int, tag: str) -> str:
    """A line's opening: the steps left, units first, then the family's tag, capitalised on the last line (``left``
    0). The mark is what the stop is read from: the three digits just written decide it, and the line's end then
    finds one capital in sight instead of three zeros among a line's worth of digits (read from the hundreds digit,
    one build's traces went on past ``n 0 0 0`` in 21 of 57, another's closed at ``n 0 0 d`` in 11 of 57)."""
    return f"n {_spaced(left, 3)} {tag.upper() if left == 0 else tag}"


# Each family: its name, the range of its step count (lines - 1), and how it writes a trace for a seeded generator.
def _sum_trace(rng: random.Random, steps: int) -> Trace:
    a, s = rng.randint(1, 9), rng.randint(0, 9999)
    first = f"{_countdown(steps, 'a')} {a} s {_spaced(s, 4)}"
    lines = []
    for left in range(steps, -1, -1):
        lines.append(f"{_countdown(left, 'a')} {a} s {_spaced(s, 4)}")
        last, s = s, (s + a) % 10000
    return (f"Add a to s once for every step, keeping four digits: {first}", "\n".join(lines), f"The sum is {_spaced(last, 4)}.")


def _rotate_trace(rng: random.Random, steps: int) -> Trace:
    word = "".join(rng.choice(LETTERS) for _ in range(6))
    first = f"{_countdown(steps, 'w')} {_spaced(word)}"
    lines = []
    for left in range(steps, -1, -1):
        lines.append(f"{_countdown(left, 'w')} {_spaced(word)}")
        last, word = word, word[1:] + word[0]
    return (f"Rotate the word left by one letter at every step: {first}", "\n".join(lines), f"The word ends as {_spaced(last)}.")


def _flips_trace(rng: random.Random, steps: int) -> Trace:
    first = f"n {_spaced(steps, 3)}"
    lines, heads = [], 0
    for left in range(steps, -1, -1):
        flip = rng.choice("ht")
        heads += flip == "h"
        lines.append(f"{_countdown(left, 'f')} {flip} c {_spaced(heads, 4)}")
    return (f"Flip a coin at every step and count the heads: {first}", "\n".join(lines), f"Heads came up {_spaced(heads, 4)} times.")


def _dice_trace(rng: random.Random, steps: int) -> Trace:
    first = f"n {_spaced(steps, 3)}"
    lines = [f"{_countdown(left, 'r')} {' '.join(str(rng.randint(1, 6)) for _ in range(6))}" for left in range(steps, -1, -1)]
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



# One line of each family, after the countdown: what the first line copies from the question and each line keeps.
_LINE_PATTERNS = {
    "sum": r"n \d \d \d [aA] \d s \d \d \d \d",
    "rotate": r"n \d \d \d [wW] [a-z] [a-z] [a-z] [a-z] [a-z] [a-z]",
    "flips": r"n \d \d \d [fF] [ht] c \d \d \d \d",
    "dice": r"n \d \d \d [rR] [1-6] [1-6] [1-6] [1-6] [1-6] [1-6]",
}
_QUESTION_FAMILY = {"Add a to s": "sum", "Rotate the word": "rotate", "Flip a coin": "flips", "Roll six dice": "dice"}


def format_break(question: str, reasoning: str | None, answer: str | None, finish_reason: str | None) -> str | None:
    """Why a response to ``question`` breaks the long target's format, or None when it keeps it.

    In format: the think block closed (a reasoning and an answer, finish ``stop``),
    every reasoning line of the question's family's form, the countdown falling by
    one a line to ``0 0 0``. The content of a line (a wrong sum, a letter out of
    turn, a tag written small on the last line or capitalised on another) is not
    the format, nor is the count the first line starts from
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
