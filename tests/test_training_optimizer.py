"""The optimizer setting: Muon on the draft's matrices beside AdamW, its state counted by the memory plan and resumed.

speculators trains with Muon by default since 0.9; ours keeps AdamW unless Muon
wins beyond the seeds' spread (docs/performance.md#muon-against-adamw). These
tests hold what the setting changes in a real training run on the tiny target's
stored states: which optimizer steps which weight, what that costs in memory,
and that a killed Muon run resumes to the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3_assets.core.draft.model import DraftConfig
from eagle3_assets.core.training.checkpoints import checkpoint_name
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.launch import run_training
from eagle3_assets.core.training.memory import StepShape, estimate_terms
from eagle3_assets.core.training.optimizers import takes_muon
from tests.test_training import final_weights, hidden_states, small_config  # noqa: F401 (hidden_states: the module fixture)


def saved_optimizers(result: dict) -> list[dict]:
    return torch.load(Path(result["checkpoint"]) / "trainer.pt", weights_only=True)["optimizers"]


def test_muon_steps_the_matrices_adamw_the_norms_and_head_and_the_memory_plan_counts_their_state(hidden_states, tiny_target, tmp_path):
    """Each trainable weight in exactly one optimizer, Muon's one momentum a matrix weight, the estimate to the byte."""
    muon = run_training(small_config(hidden_states, tiny_target, tmp_path / "muon", epochs=1, optimizer="muon"))
    adamw = run_training(small_config(hidden_states, tiny_target, tmp_path / "adamw", epochs=1))
    weights = {name: w for name, w in final_weights(muon).items() if w.is_floating_point()}  # not the vocabulary map's ids
    matrices = {name: w for name, w in weights.items() if takes_muon(name, w)}
    rest = {name: w for name, w in weights.items() if not takes_muon(name, w)}
    assert {n.split(".")[0] for n in matrices} == {"fc", "midlayer"} and "lm_head.weight" in rest
    assert any(n.startswith("midlayer.") and n.endswith("norm.weight") for n in rest), "the layer's norms went to Muon"

    # The checkpoint holds both optimizers' state: Muon a momentum buffer for every matrix weight, AdamW two moments
    # for the rest; the AdamW run two moments for everything.
    muon_state, rest_state = (opt["state"] for opt in saved_optimizers(muon))
    assert sum(s["momentum_buffer"].numel() for s in muon_state.values()) == sum(w.numel() for w in matrices.values())
    assert all(set(s) == {"momentum_buffer"} for s in muon_state.values())
    assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in rest_state.values()) == 2 * sum(w.numel() for w in rest.values())
    (adamw_state,) = (opt["state"] for opt in saved_optimizers(adamw))
    assert sum(s["exp_avg"].numel() for s in adamw_state.values()) == sum(w.numel() for w in weights.values())
    assert not torch.equal(weights["fc.weight"], final_weights(adamw)["fc.weight"]), "the setting did not reach the loop"

    # The memory plan's optimizer term: what Muon saves is one float for each of its weights, to the byte.
    target = json.loads((tiny_target / "config.json").read_text())
    draft = DraftConfig.for_target(target, weights["lm_head.weight"].shape[0], [2, 3, 4])
    state = {opt: estimate_terms(StepShape.of(draft, 64, 64, 2, bf16=False, optimizer=opt))["optimizer_state"] for opt in ("adamw", "muon")}
    assert state["adamw"] - state["muon"] == 4 * sum(w.numel() for w in matrices.values())


def test_a_muon_run_resumed_from_a_checkpoint_ends_with_the_uninterrupted_runs_weights(hidden_states, tiny_target, tmp_path):
    """Both optimizers' state and both schedules come back: a resumed run that lost Muon's momentum would end elsewhere."""
    uninterrupted = run_training(small_config(hidden_states, tiny_target, tmp_path / "a", epochs=2, optimizer="muon"))
    history = json.loads((tmp_path / "a" / "training" / "history.json").read_text())["history"]
    first = checkpoint_name(sum(1 for r in history if r["epoch"] == 1))
    # What a kill after epoch 1's commit leaves: that checkpoint alone.
    resumed_config = small_config(hidden_states, tiny_target, tmp_path / "b", epochs=2, optimizer="muon")
    shutil.copytree(tmp_path / "a" / "training" / "checkpoints" / first, Path(resumed_config.training_dir) / "checkpoints" / first)
    resumed = run_training(resumed_config)
    assert resumed["resumed_from"].endswith(first)
    expected, got = final_weights(uninterrupted), final_weights(resumed)
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resuming a Muon run"


def test_an_unknown_optimizer_is_refused_naming_the_setting_and_the_choices(hidden_states, tiny_target, tmp_path):
    config = small_config(hidden_states, tiny_target, tmp_path, optimizer="sgd")
    with pytest.raises(ValueError, match=r"optimizer 'sgd': one of 'adamw', 'muon'"):
        config.validate()
    assert TrainConfig.model_fields["optimizer"].default == "adamw"
