"""The training schedule follows the data when it is not set, and says when the data cannot make a useful draft."""

from __future__ import annotations

import pytest

from eagle3_assets.core.training.schedule import MIN_OPTIMIZER_STEPS, fit_schedule, fitted_batch_tokens, fitted_learning_rate


def packed_steps(total_tokens: int):
    return lambda batch_tokens: max(1, total_tokens // batch_tokens)


def test_small_data_gets_small_batches_and_enough_steps():
    """The first try of issue 15: 82k tokens made 60 optimizer steps with the published recipe."""
    schedule = fit_schedule(total_tokens=82_000, supervised_tokens=60_000, hidden_size=256, steps_per_epoch_for=packed_steps(82_000))
    assert schedule.batch_tokens == 1024 and schedule.optimizer_steps >= MIN_OPTIMIZER_STEPS
    assert set(schedule.fitted) == {"batch_tokens", "epochs", "learning_rate"} and not schedule.warnings


def test_the_storys_data_keeps_the_published_recipe():
    tokens = 40_000_000  # 10,000 traces of a few thousand tokens
    schedule = fit_schedule(total_tokens=tokens, supervised_tokens=30_000_000, hidden_size=7168, steps_per_epoch_for=packed_steps(tokens // 8), world_size=8)
    assert (schedule.batch_tokens, schedule.epochs, schedule.learning_rate) == (16384, 10, pytest.approx(1e-4))


def test_settings_given_are_kept_and_too_few_steps_warn_before_training():
    schedule = fit_schedule(
        total_tokens=82_000, supervised_tokens=60_000, hidden_size=256, steps_per_epoch_for=packed_steps(82_000),
        batch_tokens=16384, epochs=10, learning_rate=1e-4,
    )  # fmt: skip
    assert schedule.fitted == () and schedule.optimizer_steps == 50
    (warning,) = schedule.warnings
    assert "50 optimizer steps" in warning and "leave epochs and batch_tokens unset" in warning


def test_too_little_supervision_is_said_before_training():
    schedule = fit_schedule(total_tokens=6_000, supervised_tokens=4_000, hidden_size=64, steps_per_epoch_for=packed_steps(6_000))
    assert any("4000 supervised tokens" in w and "too few for a useful draft" in w for w in schedule.warnings)


def test_fitted_values_stay_in_their_ranges():
    assert fitted_batch_tokens(10**9) == 16384 and fitted_batch_tokens(100) == 1024
    assert fitted_learning_rate(7168, 16384) == pytest.approx(1e-4)
    assert fitted_learning_rate(64, 1024) > fitted_learning_rate(256, 1024) > fitted_learning_rate(4096, 1024)
    assert 3e-5 <= fitted_learning_rate(16, 1024) <= 3e-3
