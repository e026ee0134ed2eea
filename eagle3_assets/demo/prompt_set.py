"""Built-in prompts and the reasoning traces the tiny target is taught to write.

Questions come from a handful of templates filled from a seeded generator, so
the set is varied but reproducible. Each question has a templated reasoning
trace and a short answer: the tiny target is trained on these so that it
answers like a reasoning model (think, close the think block, answer, stop).
The held-out evaluation set uses operands the training prompts never use.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from eagle3_assets.core.storage.files import write_bytes_atomic

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
ANIMALS = ["cat", "dog", "horse", "owl", "fox", "bear", "whale", "hen"]
WORDS = ["apple", "river", "stone", "cloud", "garden", "planet", "window", "silver", "candle", "forest"]

Trace = tuple[str, str, str]  # question, reasoning, answer


def _addition(rng: random.Random, lo: int, hi: int) -> Trace:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return (
        f"What is {a} plus {b}?",
        f"I need to add {a} and {b}. {a} plus {b} is {a + b}. Checking: {a + b} minus {b} is {a}. So the sum is {a + b}.",
        f"The answer is {a + b}.",
    )


def _subtraction(rng: random.Random, lo: int, hi: int) -> Trace:
    a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)), reverse=True)
    return (
        f"What is {a} minus {b}?",
        f"I need to subtract {b} from {a}. {a} minus {b} is {a - b}. Checking: {a - b} plus {b} is {a}. So the difference is {a - b}.",
        f"The answer is {a - b}.",
    )


def _comparison(rng: random.Random, lo: int, hi: int) -> Trace:
    a, b = rng.sample(range(lo, hi + 1), 2)
    big, small = max(a, b), min(a, b)
    return (
        f"Which is larger, {a} or {b}?",
        f"I need to compare {a} and {b}. {big} is more than {small}. So the larger number is {big}.",
        f"The larger number is {big}.",
    )


def _parity(rng: random.Random, lo: int, hi: int) -> Trace:
    n = rng.randint(lo, hi)
    kind = "even" if n % 2 == 0 else "odd"
    return (
        f"Is {n} even or odd?",
        f"I need to check if {n} divides by 2. The last digit of {n} is {n % 10}. So {n} is {kind}.",
        f"{n} is {kind}.",
    )


def _colour_of(rng: random.Random, lo: int, hi: int) -> Trace:
    animal, colour = rng.choice(ANIMALS), rng.choice(COLOURS)
    n = rng.randint(lo, hi)
    return (
        f"I have {n} {colour} {animal}s. What colour are my {animal}s?",
        f"The question says there are {n} {animal}s and they are {colour}. The colour is given directly. So the colour is {colour}.",
        f"Your {animal}s are {colour}.",
    )


def _word_length(rng: random.Random, lo: int, hi: int) -> Trace:
    word = rng.choice(WORDS)
    letters = ", ".join(word)
    return (
        f"How many letters are in the word {word}?",
        f"I need to count the letters of {word}. The letters are {letters}. That is {len(word)} letters.",
        f"The word {word} has {len(word)} letters.",
    )


TEMPLATES: list[Callable[[random.Random, int, int], Trace]] = [
    _addition,
    _subtraction,
    _comparison,
    _parity,
    _colour_of,
    _word_length,
]


def make_traces(count: int, seed: int, lo: int = 1, hi: int = 99) -> list[Trace]:
    rng = random.Random(seed)
    return [TEMPLATES[i % len(TEMPLATES)](rng, lo, hi) for i in range(count)]


def training_traces(seed: int = 0) -> list[Trace]:
    """What the tiny target learns from (operands 1..99)."""
    return make_traces(1200, seed)


def demo_prompts(count: int = 320, seed: int = 1) -> list[dict]:
    """The demo dataset, in open-perfectblend's ``conversations`` form."""
    return [
        {"id": f"demo-{i:04d}", "conversations": [{"from": "human", "value": question}]}
        for i, (question, _, _) in enumerate(make_traces(count, seed))
    ]


def eval_prompts(count: int = 32, seed: int = 2) -> list[dict]:
    """Held out: operands 100..199, and no question that also occurs in the demo prompts."""
    seen = {row["conversations"][0]["value"] for row in demo_prompts()}
    fresh = [q for q, _, _ in make_traces(count * 4, seed, lo=100, hi=199) if q not in seen]
    return [{"id": f"eval-{i:04d}", "question": question} for i, question in enumerate(fresh[:count])]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    write_bytes_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path
