"""Held-out prompts that survive real data (issue #26, deliverable 6): with default settings, a 640-prompt dataset
whose questions repeat under other ids holds out enough prompts for a figure, every copy of a question on one side,
and draft_evaluation's guard (no held-out text in any training shard) accepts the set."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
from dagster import DagsterInstance, materialize

from eagle3_assets.core.prompts.heldout import MAX_RAISED_SHARE, plan_holdout, question_text
from eagle3_assets.glue.partitions import register_shards
from resources.prompt_dataset import DEFAULT_HOLDOUT_MIN_PROMPTS, DEFAULT_HOLDOUT_SHARE, PromptDataset
from resources.target_model import TargetModel


def test_the_share_is_kept_when_it_holds_out_enough_and_raised_by_question_when_not():
    questions = [f"Question number {i % 320}?" for i in range(640)]
    enough = plan_holdout(questions, 0.2, 32)
    assert enough.share == 0.2 and enough.held_out_prompts >= 32 and "at least holdout_min_prompts 32" in enough.how
    raised = plan_holdout(questions, 0.01, 32)
    assert raised.share > 0.01 and raised.held_out_prompts == 32 and raised.held_out_questions == 16  # two copies each
    assert "fewer than holdout_min_prompts 32: raised to" in raised.how
    # Where 32 would take more than 10 % of the dataset from training, the share stays and the plan says why.
    small = plan_holdout(questions[:300], 0.01, 32)
    assert small.share == 0.01 and f"more than {MAX_RAISED_SHARE:.0%} of this dataset" in small.how
    assert plan_holdout(questions, 0.0, 32).share == 0.0  # no held-out set asked for: none made


def test_repeated_questions_under_other_ids_evaluate_with_default_settings(tmp_path, data_dir):
    from eagle3_assets.defs.draft_evaluation import resolve_eval_prompts, training_overlap
    from eagle3_assets.core.evaluation.acceptance import load_conversations
    from eagle3_assets.defs.prompts import prompts

    # The story's run: 640 prompts, each question twice under different ids, default holdout settings.
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "question": f"What is {i % 320} times {i % 320 % 7 + 2}?"}) + "\n" for i in range(640)))
    dataset = PromptDataset(source=str(source))
    assert (dataset.holdout_share, dataset.holdout_min_prompts) == (DEFAULT_HOLDOUT_SHARE, DEFAULT_HOLDOUT_MIN_PROMPTS)
    instance = DagsterInstance.ephemeral()
    keys = dataset.shard_keys()
    register_shards(instance, keys)
    results = [materialize([prompts], partition_key=key, resources={"prompt_dataset": dataset}, instance=instance) for key in keys]

    training = pl.concat([pl.read_parquet(data_dir / "prompts" / f"{k}.parquet") for k in keys])
    held = pl.concat([pl.read_parquet(data_dir / "prompts" / f"{k}.heldout.parquet") for k in keys])
    assert training.height + held.height == 640
    assert held.height >= DEFAULT_HOLDOUT_MIN_PROMPTS  # 1 % alone held out a handful
    held_questions = {question_text(m) for m in held["messages"].to_list()}
    assert held.height == 2 * len(held_questions)  # every copy of a held-out question is held out
    assert not held_questions & {question_text(m) for m in training["messages"].to_list()}

    # How it was reached, in every shard's metadata.
    (mat,) = results[0].asset_materializations_for_node("prompts")
    assert mat.metadata["holdout_share_used"].value > DEFAULT_HOLDOUT_SHARE
    assert mat.metadata["dataset_held_out_prompts"].value == held.height
    assert "fewer than holdout_min_prompts 32: raised to" in mat.metadata["holdout_how"].value

    # What draft_evaluation does before it starts its stage, with its default settings: the guard accepts the set.
    eval_prompts = resolve_eval_prompts("", TargetModel(path=str(tmp_path / "my-target")), limit=64)
    ids, conversations = load_conversations(eval_prompts)
    assert len(ids) == held.height and training_overlap(ids, conversations, data_dir / "prompts") == []
    assert Path(eval_prompts).is_file()
