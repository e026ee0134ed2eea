"""How fast each stage goes, for the capacity plan's hours: a rate measured on the shards done, configured, or estimated.

A :class:`Rate` is tokens per second with where the figure comes from (or, when
unknown, what would tell it): generation's output tokens/s of the whole server,
extraction's and training's tokens/s per GPU. The training's epochs, when none
are set, are those its schedule fits to the run's tokens. Dagster-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_assets.core.training.schedule import fit_schedule


@dataclass(frozen=True)
class Rate:
    """Tokens per second of a stage on one of its GPUs' worth of work, and where the figure comes from."""

    tokens_per_s: float | None
    source: str

    def hours(self, tokens: float) -> float | None:
        return tokens / self.tokens_per_s / 3600 if self.tokens_per_s else None


def measured_rate(samples: Sequence[tuple[float, float]], what: str) -> Rate | None:
    """The rate over ``(tokens, seconds)`` measured per shard: all tokens over all seconds; None without a sample."""
    samples = [(t, s) for t, s in samples if t > 0 and s > 0]
    if not samples:
        return None
    tokens, seconds = sum(t for t, _ in samples), sum(s for _, s in samples)
    return Rate(tokens / seconds, f"measured on {len(samples)} shard(s) of {what}")


def first_rate(*rates: Rate | None, missing: str) -> Rate:
    """The first rate known, in order of preference; else an unknown one that says what would give it."""
    for rate in rates:
        if rate is not None and rate.tokens_per_s:
            return rate
    return Rate(None, missing)


def training_epochs(tokens: int, hidden_size: int, gpus: int) -> int:
    """The epochs the training's schedule fits to ``tokens`` when none are set (core/training/schedule.py)."""
    if tokens <= 0:
        return 0
    return fit_schedule(
        total_tokens=tokens, supervised_tokens=tokens, hidden_size=hidden_size, world_size=gpus,
        steps_per_epoch_for=lambda batch: math.ceil(tokens / max(1, gpus) / batch),
    ).epochs  # fmt: skip


def estimated_training_rate(step_flops_per_token: float, device_tflops: float, share: float) -> Rate:
    """Tokens/s from the step's FLOPs per token and a device's matrix-product rate at a share of it."""
    rate = share * device_tflops * 1e12 / step_flops_per_token
    return Rate(rate, f"estimated: {step_flops_per_token / 1e9:.1f} GFLOP per token at {share:.2f} of {device_tflops:g} TFLOP/s")
