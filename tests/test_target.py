"""The target as one coherent thing: overrides keep it, the pre-flight judges it, every stage checks it is the same.

The tiny demo target stands for the user's own; variants of it (a copy with a
remote-code tokenizer, a copy whose config differs, a copy with a 2,048-token
context) are the other models a user may point the platform at.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance, RunConfig, materialize

from eagle3_assets.core.target.head import HeadWeightNames
from eagle3_assets.core.target.identity import config_hash
from eagle3_assets.core.target.tokenizer import load_tokenizer
from eagle3_assets.core.target.description import TargetDescription, TargetError, default_aux_layer_ids
from eagle3_assets.core.target.preflight import TargetSettings, preflight_problems
from eagle3_assets.core.serving.profile import ServingProfile, vllm_launch
from eagle3_assets.glue.partitions import register_shards
from resources.target_model import TargetModel

SHARD = "shard-00000"


def variant(tiny_target: Path, where: Path, **config_changes) -> Path:
    """A copy of the tiny target with ``config_changes`` in its config.json (another model, as far as identity goes)."""
    shutil.copytree(tiny_target, where)
    config = json.loads((where / "config.json").read_text())
    config.update(config_changes)
    (where / "config.json").write_text(json.dumps(config, indent=2))
    return where


def with_remote_code_tokenizer(tiny_target: Path, where: Path) -> Path:
    """A copy whose tokenizer class lives in the model directory (``auto_map``), as Kimi-K2's does."""
    variant(tiny_target, where)
    (where / "tokenization_remote.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass RemoteTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((where / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="RemoteTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_remote.RemoteTokenizer"]})
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


OVERRIDE_ONE_FIELD = """
from dagster import asset, materialize
from eagle3_assets.definitions import default_resources
from resources.target_model import TargetModel

seen = {}

@asset
def probe(target_model: TargetModel):
    seen.update(path=target_model.path, trust_remote_code=target_model.trust_remote_code, ids=target_model.aux_layer_ids)

materialize([probe], resources={"target_model": default_resources()["target_model"]},
            run_config={"resources": {"target_model": {"config": {"aux_layer_ids": [1, 3, 5]}}}})
print(seen)
"""


def test_a_launchpad_override_of_one_field_keeps_the_target_from_the_environment(tmp_path):
    """The story's silent swap: overriding aux_layer_ids used to reset the path to the demo's model."""
    env = {**os.environ, "EAGLE3_TARGET_MODEL": "/models/kimi-k2.5", "EAGLE3_TRUST_REMOTE_CODE": "1", "DAGSTER_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", OVERRIDE_ONE_FIELD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert seen == {"path": "/models/kimi-k2.5", "trust_remote_code": True, "ids": [1, 3, 5]}


def test_default_layer_ids_are_vllms_when_distinct_and_never_repeat():
    assert default_aux_layer_ids(61) == [2, 30, 58]  # Kimi-K2 / DeepSeek-V3: vLLM's own default
    assert default_aux_layer_ids(7) == [2, 3, 4]
    for layers in range(3, 64):
        ids = default_aux_layer_ids(layers)
        assert len(set(ids)) == 3 and all(0 < i <= layers for i in ids), (layers, ids)


def test_the_layer_ids_are_checked_in_one_place_whoever_is_handed_them(tmp_path):
    """The resource, the pre-flight and the extraction backends all refuse bad ids with the one check's words."""
    from eagle3_assets.core.extraction.traces import ExtractionInputError, validate_layer_ids

    config = {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 320, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": config}))  # a multimodal wrapper's nesting
    described = TargetDescription.read(tmp_path)
    assert described == TargetDescription(str(tmp_path), 6, 64, 320, 2048, tuple(default_aux_layer_ids(6)))
    assert TargetModel(path=str(tmp_path)).layer_ids() == default_aux_layer_ids(6)

    for ids, problem in (([2, 3, 3], "repeated id"), ([0, 2, 4], "each must be in 1..6"), ([2, 4], "exactly three ids")):
        with pytest.raises(TargetError) as caught:
            TargetDescription.read(tmp_path, ids)
        message = str(caught.value)
        assert problem in message and "EAGLE3_AUX_LAYER_IDS" in message, message
        with pytest.raises(TargetError, match=problem):
            TargetModel(path=str(tmp_path), aux_layer_ids=ids).layer_ids()
        with pytest.raises(ExtractionInputError) as extraction:
            validate_layer_ids(ids, 6)
        assert str(extraction.value) == message
        # the pre-flight goes on to the tokenizer (none here) but names the ids first, in the same words
        assert preflight_problems(TargetSettings(str(tmp_path), aux_layer_ids=tuple(ids)), max_tokens=256, eval_max_tokens=128)[0] == message


def test_the_preflight_passes_the_demo_target(tiny_target):
    assert preflight_problems(TargetSettings(str(tiny_target)), max_tokens=256, eval_max_tokens=128) == []


def test_the_preflight_refuses_repeated_ids_a_short_context_and_remote_code_without_opt_in(tiny_target, tmp_path):
    repeated = preflight_problems(TargetSettings(str(tiny_target), aux_layer_ids=(2, 3, 3)), max_tokens=256, eval_max_tokens=128)
    assert len(repeated) == 1 and "repeated id" in repeated[0] and "target_model.aux_layer_ids" in repeated[0]

    short = preflight_problems(TargetSettings(str(tiny_target)), max_tokens=8192, eval_max_tokens=128)
    assert len(short) == 1 and "vllm_server.max_tokens=8192" in short[0] and "4096-token context" in short[0]

    remote = with_remote_code_tokenizer(tiny_target, tmp_path / "remote")
    refused = preflight_problems(TargetSettings(str(remote)), max_tokens=256, eval_max_tokens=128)
    assert len(refused) == 1 and "remote code" in refused[0] and "target_model.trust_remote_code" in refused[0]
    with pytest.raises(TargetError, match="EAGLE3_TRUST_REMOTE_CODE"):
        load_tokenizer(remote)
    assert preflight_problems(TargetSettings(str(remote), trust_remote_code=True), max_tokens=256, eval_max_tokens=128) == []


def generate_one_shard(tmp_path: Path, vllm_server, target_model: TargetModel):
    """``prompts`` and ``raw_responses`` of one shard of four short questions: (the run's result, its instance)."""
    from eagle3_assets.defs.prompts import prompts
    from eagle3_assets.defs.raw_responses import raw_responses
    from resources.prompt_dataset import PromptDataset

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} + {i}?"}) + "\n" for i in range(4)))
    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    resources = {
        "prompt_dataset": PromptDataset(source=str(source), shard_size=4, holdout_share=0.0),
        "vllm_server": vllm_server,
        "target_model": target_model,
    }
    return materialize([prompts, raw_responses], partition_key=SHARD, resources=resources, instance=instance, raise_on_error=False), instance


def test_the_target_preflight_stops_generation_before_any_request(tiny_target, tmp_path, data_dir):
    """Repeated ids used to be refused only at extraction, after generation and validation; now nothing is sent."""
    from resources.vllm_server import VLLMServerResource

    # Nothing listens there: the pre-flight must fail before the client is even opened.
    server = VLLMServerResource(base_urls=["http://127.0.0.1:9"], served_model_name="m", max_tokens=256)
    result, _ = generate_one_shard(tmp_path, server, TargetModel(path=str(tiny_target), aux_layer_ids=[2, 3, 3]))
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = failure.step_failure_data.error.to_string()
    assert "target pre-flight failed, nothing was sent" in text and "repeated id" in text and "EAGLE3_AUX_LAYER_IDS" in text
    assert not (data_dir / "raw_responses" / f"{SHARD}.journal.jsonl").exists()


def test_max_tokens_defaults_to_what_a_short_context_leaves_instead_of_refusing(tiny_target, tmp_path, data_dir):
    """A 2,048-token target with defaults only: the target pre-flight used to refuse every shard ("max_tokens=8192
    leaves under 256 tokens for the prompt"); now max_tokens is what the context leaves beside the shard's prompts."""
    from eagle3_assets.core.target.preflight import DEFAULT_MAX_TOKENS, MIN_PROMPT_ROOM, completion_budget
    from resources.vllm_server import VLLMServerResource

    assert completion_budget(262144, [900, 4000]) == DEFAULT_MAX_TOKENS  # the story's target: 8,192
    assert completion_budget(2048, [40, 60]) == 2048 - MIN_PROMPT_ROOM
    assert completion_budget(2048, [700]) == 2048 - 700
    assert completion_budget(2048, [1900]) == 1024  # one outlier prompt does not shrink every answer below half the context
    short = variant(tiny_target, tmp_path / "short", max_position_embeddings=2048)
    # max_tokens left unset; nothing listens at this URL, so the run stops at the server, after the target pre-flight.
    server = VLLMServerResource(base_urls=["http://127.0.0.1:9"], served_model_name="m", max_retries=0)
    assert server.max_tokens is None
    result, instance = generate_one_shard(tmp_path, server, TargetModel(path=str(short)))
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert "target pre-flight failed" not in failure.step_failure_data.error.to_string()
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    expected = 2048 - MIN_PROMPT_ROOM  # the shard's questions are far shorter than the prompt room
    assert any(f"vllm_server.max_tokens unset: {expected} (2048-token context" in line for line in logs), logs
    assert any(line.endswith(f"in flight across the shards, max_tokens {expected}") for line in logs), logs  # what the requests carry


def test_hidden_states_refuses_another_model_than_the_one_that_rendered_the_traces(tiny_target, tmp_path, data_dir):
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
    from resources.gpu_host import GPUHost
    from tests.extraction_helpers import recorded_checks, write_validated_traces

    write_validated_traces(data_dir, SHARD, tiny_target, count=6)  # rendered by the tiny target
    other = variant(tiny_target, tmp_path / "other", rms_norm_eps=1e-6)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    result = materialize(
        [hidden_states],
        partition_key=SHARD,
        resources={"target_model": TargetModel(path=str(other)), "gpu_host": GPUHost()},
        instance=instance,
        run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1)}),
        raise_on_error=False,
    )
    assert not result.success
    checks = recorded_checks(instance, result.run_id)
    assert not checks["target_matches_traces"].passed
    description = checks["target_matches_traces"].description
    assert str(other) in description and config_hash(tiny_target) in description
    assert not list((data_dir / "hidden_states" / SHARD).glob("part-*.safetensors"))  # no GPU time spent on the wrong model


def test_serving_follows_the_target(tiny_target, tmp_path):
    """The serving profile's launch reads the target: its dtype, its context, remote code as set."""
    launch = vllm_launch(ServingProfile(), tiny_target, on_cpu=True).engine_args
    assert (launch["max_model_len"], launch["dtype"], launch["trust_remote_code"]) == (4096, "float32", False)
    assert "compilation_config" not in launch  # only an MLA target on a CPU host needs vLLM's PyTorch rotary
    short = variant(tiny_target, tmp_path / "short", max_position_embeddings=2048)
    assert vllm_launch(ServingProfile(trust_remote_code=True), short, on_cpu=True).engine_args["max_model_len"] == 2048
    with pytest.raises(TargetError, match="exceeds the target's 2048-token context"):
        vllm_launch(ServingProfile(max_model_len=4096), short, on_cpu=True)
    bf16 = variant(tiny_target, tmp_path / "bf16", dtype="bfloat16")
    assert vllm_launch(ServingProfile(), bf16, on_cpu=True).engine_args["dtype"] == "auto"  # never cast a half-precision or quantised checkpoint


def materialised_prompts(source: Path, questions: list[str], data_dir: Path, holdout_share: float) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``prompts`` over a dataset of ``questions`` (ids q0, q1, ...) in shards of 100: (training rows, held-out rows)."""
    from eagle3_assets.defs.prompts import prompts
    from resources.prompt_dataset import PromptDataset

    source.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(questions)))
    dataset = PromptDataset(source=str(source), shard_size=100, holdout_share=holdout_share)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    for key in dataset.shard_keys():
        assert materialize([prompts], partition_key=key, resources={"prompt_dataset": dataset}, instance=instance).success
    training = pl.concat([pl.read_parquet(data_dir / "prompts" / f"{k}.parquet") for k in dataset.shard_keys()])
    held = pl.concat([pl.read_parquet(data_dir / "prompts" / f"{k}.heldout.parquet") for k in dataset.shard_keys()])
    return training, held


def eval_prompt_lines(source: str, target: TargetModel, limit: int) -> list[dict]:
    from eagle3_assets.defs.draft_evaluation import resolve_eval_prompts

    return [json.loads(line) for line in Path(resolve_eval_prompts(source, target, limit=limit)).read_text().splitlines()]


def test_held_out_prompts_come_from_the_users_dataset_and_never_reach_training(tmp_path, data_dir):
    from eagle3_assets.defs.draft_evaluation import resolve_eval_prompts, training_overlap

    source = tmp_path / "prompts.jsonl"
    training, held = materialised_prompts(source, [f"Question number {i}?" for i in range(200)], data_dir, holdout_share=0.1)
    assert 5 <= held.height <= 40 and training.height + held.height == 200
    assert not set(held["id"]) & set(training["id"])

    user_target = TargetModel(path=str(tmp_path / "my-target"))
    lines = eval_prompt_lines("", user_target, limit=8)
    assert [r["id"] for r in lines] == held["id"].head(8).to_list()
    assert training_overlap([r["id"] for r in lines], [r["messages"] for r in lines], data_dir / "prompts") == []
    assert user_target.builtin_eval_prompts() is None  # a user's target brings no held-out set of its own
    assert resolve_eval_prompts(str(source), user_target, limit=8) == str(source)  # a set named is the one used


def test_a_question_repeated_under_other_ids_is_held_out_with_all_its_copies_or_none(tmp_path, data_dir):
    """Repeats are common in real prompt sets (and in the built-in one): by id, one copy was trained on while
    another was held out, and draft_evaluation refused the held-out set on every rerun."""
    from eagle3_assets.defs.draft_evaluation import training_overlap

    # 40 questions, each five times under different ids, across two shards
    training, held = materialised_prompts(tmp_path / "prompts.jsonl", [f"Question number {i % 40}?" for i in range(200)], data_dir, 0.2)
    held_questions = {m[-1]["content"] for m in held["messages"].to_list()}
    assert held_questions and held.height == 5 * len(held_questions)  # every copy of a held-out question
    assert not held_questions & {m[-1]["content"] for m in training["messages"].to_list()}
    lines = eval_prompt_lines("", TargetModel(path=str(tmp_path / "my-target")), limit=64)
    assert training_overlap([r["id"] for r in lines], [r["messages"] for r in lines], data_dir / "prompts") == []


@pytest.mark.vllm
def test_evaluation_runs_on_a_target_with_a_2048_token_context(tiny_target, tmp_path):
    """The launcher's old 4,096 default made vLLM refuse such a target; the context now comes from the target."""
    from eagle3_assets.core.evaluation.acceptance import evaluate
    from tests.test_export import exported_random_draft

    short = variant(tiny_target, tmp_path / "short", max_position_embeddings=2048)
    draft = exported_random_draft(short, tmp_path / "draft")
    questions = [[{"role": "user", "content": f"What is {i} plus {i + 3}?"}] for i in range(4)]
    k = 3
    (result,) = evaluate(
        short, {"untrained": draft}, questions, num_speculative_tokens=k, max_tokens=32, include_reference=False, server_log_dir=tmp_path,
        profile=ServingProfile(),
    ).values()
    assert result.failed == 0 and result.drafts and result.output_tokens > len(questions)
    # The server's spec-decode counters against the tokens the client received (usage.completion_tokens): after each
    # prompt's first token (from the prefill), every verification step emits 1 + its accepted tokens; a request that
    # ends mid-step (max_tokens, end of turn) drops at most k of them. Counters read wrong (another series, another
    # server's, not summed) miss this band; an acceptance length is only as good as them.
    emitted_after_prefill = result.output_tokens - result.prompts
    assert emitted_after_prefill <= result.drafts + result.accepted <= emitted_after_prefill + k * result.prompts, result
    assert result.mean_acceptance_length == pytest.approx(1 + result.accepted / result.drafts)


@pytest.mark.parametrize("fixture", ["tiny_target", "kimi_target", "qwen3_target"])
def test_the_target_head_gives_the_targets_own_logits_from_pre_and_post_norm_states(fixture, request):
    """One head for every stage: the final norm and lm_head, read by name, reproduce transformers' own forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_assets.core.target.head import TargetHead, head_weight_names

    path = request.getfixturevalue(fixture)
    assert head_weight_names(path) == HeadWeightNames("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    # float32 throughout: a bf16 checkpoint (Kimi) is upcast exactly as the head reads it
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    states = {}
    hook = model.model.norm.register_forward_hook(lambda module, args, out: states.update(pre=args[0][0], post=out[0]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    hook.remove()
    head = TargetHead.from_checkpoint(path)
    assert head.eps == model.config.rms_norm_eps
    torch.testing.assert_close(head.logits(states["pre"], "pre_norm"), logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.logits(states["post"], "post_norm"), logits, rtol=1e-4, atol=1e-4)
    draft_to_target = torch.arange(0, model.config.vocab_size, 3)
    restricted, top = head.draft_logits(states["pre"], "pre_norm", draft_to_target, chunk=5)
    assert torch.equal(top, logits.argmax(-1))
    torch.testing.assert_close(restricted, logits[:, draft_to_target], rtol=1e-4, atol=1e-4)


def test_the_head_weights_are_found_by_name_in_a_wrapped_checkpoint(tmp_path):
    """Kimi-K2.5 prefixes the language model's names, and a vision tower brings norms of its own."""
    from eagle3_assets.core.target.head import HeadWeightNames, head_weight_names

    wrapped = [
        "vision_tower.norm.weight",
        "mm_projector.pre_norm.weight",
        "language_model.model.layers.0.self_attn.q_norm.weight",
        "language_model.model.norm.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
    ]
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": False}}))
    expected = HeadWeightNames("language_model.model.embed_tokens.weight", "language_model.model.norm.weight", "language_model.lm_head.weight")
    assert head_weight_names(tmp_path, wrapped) == expected
    untied_without_head = wrapped[:-1]
    with pytest.raises(TargetError, match="cannot find its lm_head"):
        head_weight_names(tmp_path, untied_without_head)
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert head_weight_names(tmp_path, untied_without_head).lm_head == "language_model.model.embed_tokens.weight"
