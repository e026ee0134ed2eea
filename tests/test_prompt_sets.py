"""The held-out sets draft_evaluation scores beside the standard one (issue #32, deliverable 4): built from held-out
prompts only, the long-context set filling the evaluation's context in the target's own tokens, the perturbed set in
another layout than the training one, and a user's set refused where it is not held out."""

from __future__ import annotations

import json

import polars as pl
import pytest
from dagster import DagsterInstance, materialize

from eagle3_assets.core.evaluation import prompt_sets as sets
from eagle3_assets.core.evaluation.acceptance import PassResult, load_conversations
from eagle3_assets.core.prompts.heldout import question_text
from eagle3_assets.core.serving.profile import ServingProfile, vllm_launch
from eagle3_assets.core.storage.shard_paths import training_shards
from eagle3_assets.glue.partitions import register_shards
from resources.prompt_dataset import PromptDataset
from resources.target_model import TargetModel

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture
def held_out_and_training(tmp_path, data_dir):
    """A real prompts split (the prompts asset over 200 questions): the held-out set as draft_evaluation resolves it,
    and every training question."""
    from eagle3_assets.defs.draft_evaluation import resolve_eval_prompts
    from eagle3_assets.defs.prompts import prompts

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "question": f"Question {i}: what is {i} times {i % 7 + 2}?"}) + "\n" for i in range(200)))
    dataset = PromptDataset(source=str(source), holdout_share=0.2)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    for key in dataset.shard_keys():
        assert materialize([prompts], partition_key=key, resources={"prompt_dataset": dataset}, instance=instance).success
    training = pl.concat([pl.read_parquet(p, columns=["messages"]) for p in training_shards(data_dir / "prompts")])
    ids, conversations = load_conversations(resolve_eval_prompts("", TargetModel(path=str(tmp_path / "my-target")), limit=64))
    return ids, conversations, [question_text(m) for m in training["messages"].to_list()]


def tiny_max_model_len(tiny_target) -> int:
    return int(vllm_launch(ServingProfile(), tiny_target).engine_args["max_model_len"])


def test_no_training_prompt_reaches_any_set(held_out_and_training, tokenizer, tiny_target):
    ids, conversations, training_questions = held_out_and_training
    assert len(ids) >= 16 and training_questions
    built = sets.build_sets(
        list(sets.BUILTIN_SETS), ids, conversations, tokenizer=tokenizer, max_model_len=tiny_max_model_len(tiny_target), max_tokens=MAX_TOKENS
    )
    assert [s.name for s in built] == ["long_context", "template_perturbation"]
    held_questions = {question_text(c) for c in conversations}
    for prompt_set in built:
        assert len(prompt_set.conversations) == len(conversations)
        assert {question_text(c) for c in prompt_set.conversations} == held_questions
        text = "\n".join(m["content"] for c in prompt_set.conversations for m in c)
        # Not a training question anywhere: neither asked nor among the long-context notes.
        assert not [q for q in training_questions if q in text], prompt_set.name
    # The guard can fail: a set that carries a training question is refused.
    long = built[0]
    leaked = sets.PromptSet(long.name, long.ids, [[{"role": "system", "content": sets.NOTES_HEADER + training_questions[0]}, *long.conversations[0][1:]]], "")
    with pytest.raises(ValueError, match="no held-out question"):
        sets.check_built_from(leaked, conversations)
    asked = sets.PromptSet("x", ["a"], [[{"role": "user", "content": training_questions[0]}]], "")
    with pytest.raises(ValueError, match="not one of the held-out set's"):
        sets.check_built_from(asked, conversations)


def test_the_sets_are_the_same_each_time(held_out_and_training, tokenizer, tiny_target):
    ids, conversations, _ = held_out_and_training
    build = lambda: sets.build_sets(list(sets.BUILTIN_SETS), ids, conversations, tokenizer=tokenizer, max_model_len=tiny_max_model_len(tiny_target), max_tokens=MAX_TOKENS)  # noqa: E731
    assert [s.conversations for s in build()] == [s.conversations for s in build()]


def test_the_long_context_set_fills_the_evaluations_context(held_out_and_training, tokenizer, tiny_target):
    ids, conversations, _ = held_out_and_training
    max_model_len = tiny_max_model_len(tiny_target)
    assert max_model_len == 4096  # the tiny target's own context: what evaluation starts it with
    long = sets.long_context_set(ids, conversations, tokenizer, max_model_len, MAX_TOKENS, fill=0.8)
    budget = int((max_model_len - MAX_TOKENS) * 0.8)
    lengths = [sets.rendered_length(tokenizer, c) for c in long.conversations]
    assert lengths == long.prompt_tokens
    assert all(budget - 8 <= n <= budget for n in lengths), (budget, lengths)  # most of the context, and a completion fits
    standard = [sets.rendered_length(tokenizer, c) for c in conversations]
    assert max(standard) < 100 < min(lengths)
    assert f"{min(lengths)}-{max(lengths)} prompt tokens" in long.how and "max_model_len 4096" in long.how
    with pytest.raises(ValueError, match="leaves no room"):
        sets.long_context_budget(128, 128, 0.8)


def test_the_perturbed_set_is_another_layout_of_the_same_questions(held_out_and_training, tokenizer):
    ids, conversations, _ = held_out_and_training
    perturbed = sets.template_perturbation_set(ids, conversations)
    rendered = lambda c: tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)  # noqa: E731
    for original, changed in zip(conversations, perturbed.conversations):
        assert question_text(changed) == question_text(original)
        assert rendered(changed) != rendered(original)  # the demo's prompts carry no system prompt; each perturbed one does
        assert changed[0]["role"] == "system" and changed[0]["content"] in sets.PERTURBED_SYSTEM_PROMPTS
    layouts = {tuple(m["role"] for m in c) for c in perturbed.conversations}
    assert layouts == {("system", "user"), ("system", "user", "assistant", "user")}
    assert {c[0]["content"] for c in perturbed.conversations} == set(sets.PERTURBED_SYSTEM_PROMPTS)


def test_a_user_set_is_refused_unless_held_out_and_named_apart(held_out_and_training, tmp_path, data_dir):
    from eagle3_assets.defs.draft_evaluation import check_prompt_sets

    ids, conversations, training_questions = held_out_and_training
    mine = tmp_path / "bench.jsonl"
    mine.write_text("".join(json.dumps({"id": f"b{i}", "messages": c}) + "\n" for i, c in enumerate(conversations[:4])))
    check_prompt_sets(["long_context"], {"bench": str(mine)}, data_dir / "prompts")  # held out: accepted
    leaky = tmp_path / "leaky.jsonl"
    leaky.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": training_questions[3]}]}) + "\n")
    with pytest.raises(ValueError, match=r"user_prompt_sets 'leaky' .* is not held out: 1 prompts"):
        check_prompt_sets([], {"leaky": str(leaky)}, data_dir / "prompts")
    with pytest.raises(ValueError, match="built-in set's name"):
        check_prompt_sets([], {"standard": str(mine)}, data_dir / "prompts")
    with pytest.raises(ValueError, match=r"prompt_sets \['longcontext'\]"):
        check_prompt_sets(["longcontext"], {}, data_dir / "prompts")


def test_each_set_reaches_the_report_with_its_spread(tmp_path):
    from eagle3_assets.core.evaluation.job import EvaluationJob
    from eagle3_assets.stages.evaluate_draft import held_out_sets, set_metadata, set_report

    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Is {i} odd?"}]}) + "\n" for i in range(4)))
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"id": "m0", "messages": [{"role": "user", "content": "Name a prime."}]}) + "\n")
    job = EvaluationJob(
        target_dir=str(tmp_path), serving=ServingProfile(), draft_dir=str(tmp_path), eval_prompts=str(prompts),
        report_path=str(tmp_path / "report.json"), prompt_sets=["template_perturbation"], user_prompt_sets={"mine": str(mine)},
    )  # fmt: skip
    ids, conversations = load_conversations(str(prompts))
    built = held_out_sets(job, ids, conversations)  # no long_context: no tokenizer needed
    assert [(s.name, len(s.conversations)) for s in built] == [("standard", 4), ("template_perturbation", 4), ("mine", 1)]

    def served(label, lengths):
        result = PassResult(label, 4, 0, 40, 1.0, 2.0, [0.6, 0.4], 10, 10)
        for s in built:
            result.per_set[s.name] = PassResult(label, len(lengths), 0, 40, 1.0, sum(lengths) / len(lengths), [0.5, 0.3], 10, 10, lengths)
        return result

    by_set = set_report(built, {"trained": served("trained", [1.5, 2.5, 3.5]), "baseline": served("baseline", [1.0, 1.0, 1.2])})
    assert [e["name"] for e in by_set] == ["standard", "template_perturbation", "mine"]
    assert by_set[2]["source"] == str(mine) and by_set[2]["prompts"] == 1
    spread = by_set[0]["results"]["trained"]["spread_over_prompts"]
    assert (spread["min"], spread["median"], spread["max"]) == (1.5, 2.5, 3.5)
    metadata = set_metadata(by_set)
    table = metadata["acceptance_by_prompt_set"]["raw_value"]
    assert "| mine | 1 | 2.500 | 1.067 | 0.50 0.30 | 1.50 / 1.50 / 2.50 / 3.50 / 3.50 |" in table
    assert "judged on the standard set" in table
    assert [f["set"] for f in metadata["prompt_sets"]["raw_value"]] == ["standard", "template_perturbation", "mine"]
