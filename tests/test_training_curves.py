"""The training loop's TensorBoard curves, read back with TensorBoard's own reader.

A real (small) training run on the tiny target's demo hidden states writes its event file under
``<training_dir>/tensorboard``; TensorBoard's ``EventAccumulator`` (what ``tensorboard --logdir`` serves) reads it,
and every step's scalars are the loop's own figures (its history) at that step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_assets.core.storage.shard_paths import HISTORY_FILE
from eagle3_assets.core.training.launch import run_training
from eagle3_assets.core.training.tensorboard_log import TENSORBOARD_DIR
from tests.test_training import hidden_states, small_config  # noqa: F401 - hidden_states: the module's fixture

REPO = Path(__file__).resolve().parents[1]


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every step, no sampling
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_each_steps_loss_accuracy_by_position_lr_throughput_and_memory_reach_tensorboard(hidden_states, tiny_target, tmp_path):  # noqa: F811
    """Mutations: write position 1's accuracy under every position -> accuracy/position_2 differs from the history;
    drop ``curves.step`` from the loop (or ``open_curves`` returning None) -> no event file; write the scalars every
    ``log_every`` steps only -> steps missing."""
    config = small_config(hidden_states, tiny_target, tmp_path, epochs=1, ttt_steps=3, log_every=4)
    run_training(config)
    recorded = json.loads((Path(config.training_dir) / HISTORY_FILE).read_text())["history"]
    history = {record["step"]: record for record in recorded}
    log_dir = Path(config.training_dir) / TENSORBOARD_DIR
    assert list(log_dir.glob("events.out.tfevents.*")), f"no event file under {log_dir}"
    scalars = read_scalars(log_dir)

    steps = sorted(history)
    assert len(steps) >= 4, "enough steps that a per-step curve and a per-log_every one differ"
    assert set(scalars["train/loss"]) == set(steps)  # every step, not every log_every
    for step in steps:
        record = history[step]
        assert scalars["train/loss"][step] == pytest.approx(record["loss"], rel=1e-6)
        assert scalars["train/learning_rate"][step] == pytest.approx(record["lr"], rel=1e-6)
        for position in (1, 2, 3):
            assert scalars[f"accuracy/position_{position}"][step] == pytest.approx(record["accuracy"][position - 1], abs=1e-6)
            assert scalars[f"loss/position_{position}"][step] == pytest.approx(record["step_losses"][position - 1], rel=1e-5)
        assert scalars["throughput/tokens_per_s"][step] > 0
        assert scalars["memory/peak_gib"][step] > 0
    # The positions are told apart (a later position predicts from the draft's own guesses: it is not position 1's).
    assert any(history[s]["accuracy"][0] != history[s]["accuracy"][2] for s in steps)
    # The learning rate follows the schedule (warm-up, then decay): the curve is not one value.
    assert len({round(scalars["train/learning_rate"][s], 12) for s in steps}) > 1


def test_the_loop_does_not_import_tensorboard_when_it_is_not_installed(tmp_path):
    training_dir = tmp_path / "training"
    """Without the extra nothing changes: the training modules import without tensorboard, and no writer is opened.

    Mutation: import ``torch.utils.tensorboard`` at the top of tensorboard_log.py -> the blocked import fails."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorboard' or name.startswith('tensorboard.'):\n"
        "            raise ImportError('blocked: tensorboard is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import importlib.util\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'tensorboard' else _find(name, *a)\n"
        "import eagle3_assets.core.training.loop, torch\n"
        "from eagle3_assets.core.training.tensorboard_log import open_curves\n"
        f"assert open_curves({str(training_dir)!r}, torch.device('cpu'), 0, 0) is None\n"
        "assert not any(m == 'tensorboard' or m.startswith('tensorboard.') for m in sys.modules)\n"
    )
    prelude = "import importlib.util\n_find = importlib.util.find_spec\n"
    done = subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not training_dir.exists()
