"""The training schedule, fitted to the data when it is not set: batch size, epochs, learning rate.

Published EAGLE-3 recipes (AdamW at 1e-4, 16k-token batches, ~10 epochs) are
written for millions of supervised tokens and a draft as wide as a large
target. Applied to a first try with a few hundred traces, they make a few
dozen optimizer steps and a draft that accepts nothing (seen: 60 steps on 82k
tokens, acceptance 1.37 where the same trainer reached 3.52 with a schedule
fitted to the data). So each of these settings, when left unset, follows the
data:

- ``batch_tokens``: at most 16,384, and small enough that an epoch has at
  least :data:`MIN_MICRO_BATCHES_PER_EPOCH` micro-batches (never below 1,024);
- ``epochs``: at least 10, more when that is needed for
  :data:`MIN_OPTIMIZER_STEPS` steps (at most :data:`MAX_EPOCHS`: beyond that a
  small dataset is memorised, not learnt);
- ``learning_rate``: 1e-4 for a draft as wide as the published ones (hidden
  4,096 and up) at their batch; for a narrower draft higher in proportion
  (``4096 / H``, as wider layers take smaller steps), for a smaller batch
  lower by the square root of the ratio (Adam's rule), within [3e-5, 3e-3].

:func:`fit_schedule` also says, before training, when the data cannot make a
useful draft. Dagster-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_BATCH_TOKENS = 16384
MIN_BATCH_TOKENS = 1024
MIN_MICRO_BATCHES_PER_EPOCH = 64
DEFAULT_EPOCHS = 10
MIN_OPTIMIZER_STEPS = 400
MAX_EPOCHS = 40
REFERENCE_LR, REFERENCE_HIDDEN, REFERENCE_BATCH = 1e-4, 4096, 16384
LR_RANGE = (3e-5, 3e-3)
# Below this many supervised tokens a draft has too little of the target's output to learn from: the
# published drafts train on tens of millions; a few thousand tokens make a draft that accepts ~nothing.
MIN_USEFUL_SUPERVISED_TOKENS = 10_000


@dataclass(frozen=True)
class Schedule:
    batch_tokens: int
    epochs: int
    learning_rate: float
    steps_per_epoch: int
    optimizer_steps: int
    supervised_tokens: int
    fitted: tuple[str, ...]  # which settings were fitted to the data (the others were set)
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        fitted = f" (fitted: {', '.join(self.fitted)})" if self.fitted else ""
        return (
            f"{self.optimizer_steps} optimizer steps = {self.epochs} epochs x {self.steps_per_epoch} steps of "
            f"{self.batch_tokens} tokens, learning rate {self.learning_rate:.2e}, {self.supervised_tokens} supervised tokens{fitted}"
        )


def fitted_batch_tokens(tokens_per_process: int) -> int:
    """The largest power of two up to 16,384 that still gives an epoch 64 micro-batches (at least 1,024)."""
    target = max(1, tokens_per_process // MIN_MICRO_BATCHES_PER_EPOCH)
    power = 2 ** int(math.log2(target)) if target >= 1 else 1
    return max(MIN_BATCH_TOKENS, min(MAX_BATCH_TOKENS, power))


def fitted_learning_rate(hidden_size: int, batch_tokens: int, steps_per_update: int = 1) -> float:
    """1e-4 for a published-size draft and batch; higher for a narrower draft, lower for a smaller batch, never above 1e-4 x width."""
    width = REFERENCE_HIDDEN / max(1, min(hidden_size, REFERENCE_HIDDEN))
    batch = math.sqrt(min(1.0, batch_tokens * steps_per_update / REFERENCE_BATCH))
    low, high = LR_RANGE
    return float(min(high, max(low, REFERENCE_LR * width * batch)))


def fit_schedule(
    *,
    total_tokens: int,
    supervised_tokens: int,
    hidden_size: int,
    steps_per_epoch_for,
    world_size: int = 1,
    grad_accumulation: int = 1,
    batch_tokens: int | None = None,
    epochs: int | None = None,
    learning_rate: float | None = None,
) -> Schedule:
    """The schedule: each setting as given, or fitted to the data when None.

    ``steps_per_epoch_for(batch_tokens)`` counts an epoch's optimizer steps for a
    batch size (the trainer's own packing decides, with its padding).
    """
    fitted = []
    if batch_tokens is None:
        batch_tokens = fitted_batch_tokens(total_tokens // max(1, world_size))
        fitted.append("batch_tokens")
    steps_per_epoch = max(1, int(steps_per_epoch_for(batch_tokens)))
    if epochs is None:
        epochs = min(MAX_EPOCHS, max(DEFAULT_EPOCHS, math.ceil(MIN_OPTIMIZER_STEPS / steps_per_epoch)))
        fitted.append("epochs")
    if learning_rate is None:
        learning_rate = fitted_learning_rate(hidden_size, batch_tokens * world_size, grad_accumulation)
        fitted.append("learning_rate")
    steps = epochs * steps_per_epoch
    warnings = []
    if supervised_tokens < MIN_USEFUL_SUPERVISED_TOKENS:
        warnings.append(
            f"only {supervised_tokens} supervised tokens: too few for a useful draft (expect acceptance near 1.0); "
            f"materialise more shards (at least {MIN_USEFUL_SUPERVISED_TOKENS} supervised tokens, millions for a production draft)"
        )
    if steps < MIN_OPTIMIZER_STEPS:
        warnings.append(
            f"{steps} optimizer steps (epochs {epochs} x {steps_per_epoch} steps of {batch_tokens} tokens) is below "
            f"{MIN_OPTIMIZER_STEPS}: the draft will be undertrained; leave epochs and batch_tokens unset to fit them, "
            "or lower batch_tokens / raise epochs"
        )
    return Schedule(batch_tokens, epochs, learning_rate, steps_per_epoch, steps, supervised_tokens, tuple(fitted), warnings)


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    """The learning-rate factor at each optimizer step: linear warm-up, then cosine decay to ``min_lr_ratio``."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
