"""A refinement round's training run (issue 42 item 4): from the current draft, on-policy shards mixed with a share of the
supervised ones, the loss and the share in the run's fingerprint. Seconds: the tiny target's cached states, no vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_assets.core.refinement.training import round_training_config
from eagle3_assets.core.storage.shard_paths import RESULT_FILE
from eagle3_assets.core.training.checkpoints import export_trained_draft, run_fingerprint
from eagle3_assets.core.training.data import index_hidden_states, load_batch, mixed_index
from eagle3_assets.core.training.launch import run_training
from tests.demo_hidden_states import cached_demo_hidden_states
from tests.test_training import small_config

SAMPLES_PER_SHARD = 24


@pytest.fixture(scope="module")
def shards(tiny_target) -> list[Path]:
    """Shard 0 stands for the round's on-policy samples, shard 1 for the supervised ones (the training tests' cache)."""
    return cached_demo_hidden_states(tiny_target, shards=2, count=SAMPLES_PER_SHARD)


@pytest.fixture(scope="module")
def current_draft(shards, tiny_target, tmp_path_factory) -> Path:
    """A supervised draft, one epoch on the supervised shard, exported as vLLM serves it: what the round starts from."""
    root = tmp_path_factory.mktemp("supervised")
    result = run_training(small_config([shards[1]], tiny_target, root, epochs=1))
    return export_trained_draft(result["checkpoint"], tiny_target, root / "draft")


def test_mixed_index_keeps_every_on_policy_sample_and_draws_the_share_of_the_supervised_ones(shards):
    """Fails if the draw takes from all samples (on-policy ones dropped), ignores the share, or is not the seed's."""
    on_policy = {s.sample_id for s in index_hidden_states([shards[0]]).samples}
    for share, drawn in ((0.0, 0), (0.5, SAMPLES_PER_SHARD // 2), (1.0, SAMPLES_PER_SHARD)):
        index = mixed_index([shards[0]], [shards[1]], share, seed=7)
        from_on_policy = [s for s in index.samples if Path(s.file).parent == shards[0]]
        assert {s.sample_id for s in from_on_policy} == on_policy and len(from_on_policy) == SAMPLES_PER_SHARD
        assert len(index.samples) - len(from_on_policy) == drawn
        assert index.mix == {"on_policy_samples": SAMPLES_PER_SHARD, "supervised_samples": drawn, "supervised_available": SAMPLES_PER_SHARD, "supervised_share": share}
    again, other_seed = mixed_index([shards[0]], [shards[1]], 0.5, seed=7), mixed_index([shards[0]], [shards[1]], 0.5, seed=8)
    assert again.fingerprint == mixed_index([shards[0]], [shards[1]], 0.5, seed=7).fingerprint
    assert [s.sample_id for s in again.samples] != [s.sample_id for s in other_seed.samples] and again.fingerprint != other_seed.fingerprint


def test_the_loss_and_the_share_each_change_the_runs_fingerprint(shards, tiny_target, current_draft, tmp_path):
    """Through the settings alone (one index for all) and through the index alone (the draw): fails if ``loss`` or
    ``supervised_share`` joins ``TrainConfig._NOT_IN_FINGERPRINT``, or if ``mixed_index``'s fingerprint leaves out the draw."""
    recipe = small_config([shards[1]], tiny_target, tmp_path)

    def round_config(share: float, loss: str):
        return round_training_config(recipe, current_draft, [shards[0]], [shards[1]], share, loss=loss)

    index = mixed_index([shards[0]], [shards[1]], 0.5, seed=recipe.seed)
    base = run_fingerprint(round_config(0.5, "opd"), index)
    assert run_fingerprint(round_config(0.5, "opd"), index) == base
    assert run_fingerprint(round_config(0.5, "kl"), index) != base
    assert run_fingerprint(round_config(0.25, "opd"), index) != base
    assert mixed_index([shards[0]], [shards[1]], 0.25, seed=recipe.seed).fingerprint != index.fingerprint


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_0_1_is_refused_naming_the_setting(shards, tiny_target, current_draft, tmp_path, share):
    """Fails if TrainConfig.validate stops checking supervised_share's range."""
    recipe = small_config([shards[1]], tiny_target, tmp_path)
    with pytest.raises(ValueError, match=r"supervised_share .* outside \[0, 1\]"):
        round_training_config(recipe, current_draft, [shards[0]], [shards[1]], share)
    with pytest.raises(ValueError, match="supervised_share 0.5 with no supervised_dirs"):
        round_training_config(recipe, current_draft, [shards[0]], [], 0.5)


def test_a_round_trains_from_the_current_draft_on_its_mix_and_is_judged_against_it(shards, tiny_target, current_draft, tmp_path):
    """Fails if the round starts from scratch (``init_from`` not set to the current draft: the evaluation's ``'starting'``
    baseline would then be the untrained draft), or trains on the on-policy shards alone."""
    from eagle3_assets.defs.draft_evaluation import resolve_baseline

    config = round_training_config(small_config([shards[1]], tiny_target, tmp_path, epochs=1), current_draft, [shards[0]], [shards[1]], 0.5)
    result = run_training(config)
    assert result["init"]["source"] == str(current_draft)
    assert result["source"]["samples"] == SAMPLES_PER_SHARD + SAMPLES_PER_SHARD // 2
    assert result["source"]["mix"]["supervised_samples"] == SAMPLES_PER_SHARD // 2
    state = json.loads((Path(result["checkpoint"]) / "state.json").read_text())
    assert state["config"]["loss"] == "opd" and state["config"]["supervised_share"] == 0.5
    assert resolve_baseline("starting", Path(config.training_dir) / RESULT_FILE) == str(current_draft)


def anchored_copy(shard: Path, root: Path) -> tuple[Path, dict]:
    """A copy of ``shard`` with anchors for its first two samples: every third chain's step 1 rejected, the rest unserved."""
    import shutil

    from eagle3_assets.core.refinement.anchors import REJECTED, write_anchors

    copy = root / shard.name
    shutil.copytree(shard, copy)
    meta = json.loads((copy / "metadata.json").read_text())
    masks = {}
    for n, (sample_id, tokens) in enumerate(list(zip(meta["sample_ids"], meta["num_tokens"]))[:2]):
        mask = torch.zeros(tokens, 3, dtype=torch.int8)
        mask[n::3, 1] = REJECTED
        masks[sample_id] = mask
    write_anchors(copy, masks)
    return copy, masks


def test_the_batches_carry_each_samples_anchors_on_its_own_positions_padded_and_packed(shards, tmp_path):
    """Fails if a packed batch's anchors are not in its samples' order, if a padded row's anchors are padded at the
    front, or if a sample without anchors gets another's (it must read zeros)."""
    copy, masks = anchored_copy(shards[0], tmp_path)
    index = index_hidden_states([copy])
    first, second, plain = index.samples[0], index.samples[1], index.samples[2]
    assert first.anchors_file and plain.anchors_file  # the shard has anchors; the third sample has none in it
    batch = load_batch([plain, second, first], max_seq_len=400)
    lengths = [min(s.length, 400) for s in (plain, second, first)]
    assert len(set(lengths)) > 1 and batch.anchors.shape == (3, max(lengths), 3)  # padded rows
    assert not batch.anchors[0].any()
    assert torch.equal(batch.anchors[1, : lengths[1]], masks[second.sample_id][: lengths[1]])
    assert torch.equal(batch.anchors[2, : lengths[2]], masks[first.sample_id][: lengths[2]])
    packed = load_batch([plain, second, first], max_seq_len=400, packed=True)
    expected = torch.cat([torch.zeros(lengths[0], 3, dtype=torch.int8), masks[second.sample_id][: lengths[1]], masks[first.sample_id][: lengths[2]]])
    assert torch.equal(packed.anchors[0], expected)
    assert load_batch([s for s in index_hidden_states([shards[0]]).samples[:2]], max_seq_len=40).anchors is None


def test_an_anchored_round_trains_with_its_anchors_in_the_fingerprint_and_is_refused_without_any(shards, tiny_target, current_draft, tmp_path):
    """Fails if the anchors file is left out of the states' fingerprint (a round re-anchored would resume the old one's
    checkpoints), or if ``opd_anchored`` trains on shards without anchors (it would be plain forward KL)."""
    from eagle3_assets.core.refinement.anchors import write_anchors

    recipe = small_config([shards[1]], tiny_target, tmp_path, epochs=1)
    refused = round_training_config(recipe, current_draft, [shards[0]], [shards[1]], 0.5, loss="opd_anchored")
    with pytest.raises(ValueError, match="no hidden-state shard has anchors"):
        run_training(refused)
    copy, masks = anchored_copy(shards[0], tmp_path / "on_policy")
    config = round_training_config(recipe, current_draft, [copy], [shards[1]], 0.5, loss="opd_anchored")
    result = run_training(config)
    assert result["init"]["source"] == str(current_draft) and json.loads((Path(result["checkpoint"]) / "state.json").read_text())["config"]["loss"] == "opd_anchored"
    before = mixed_index([copy], [shards[1]], 0.5, seed=config.seed)
    write_anchors(copy, {sample_id: mask.roll(1, 0) for sample_id, mask in masks.items()})
    after = mixed_index([copy], [shards[1]], 0.5, seed=config.seed)
    assert run_fingerprint(config, after) != run_fingerprint(config, before) == result["fingerprint"]
