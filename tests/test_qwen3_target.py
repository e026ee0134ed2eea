"""The Qwen3-architecture built-in target: reproducible, Qwen3's markup in which the model opens its own
think block, and served in reasoning format by real vLLM with its ``qwen3`` reasoning parser."""

from __future__ import annotations

import dataclasses
import json

import pytest

from eagle3_assets.core.validation.chat_rendering import ChatRenderer
from eagle3_assets.core.target.description import default_aux_layer_ids
from eagle3_assets.demo.prompt_set import training_traces
from eagle3_assets.demo.qwen3_target import (
    IM_END,
    THINK_CLOSE,
    THINK_OPEN,
    Qwen3TargetSpec,
    build_qwen3_target,
    response_text,
)
from tests.test_tiny_target import (
    assert_built_as_recorded,
    assert_fields_rebuild_what_the_model_wrote,
    assert_same_seed_builds_the_same,
    complete_reasoning_answers,
)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_same_seed_builds_the_same_qwen3_target(tmp_path):
    assert_same_seed_builds_the_same(build_qwen3_target, dataclasses.replace(Qwen3TargetSpec(), train_steps=4), tmp_path)


def test_the_qwen3_target_does_what_was_recorded(qwen3_target):
    assert_built_as_recorded("qwen3", qwen3_target)


def test_config_is_a_qwen3_with_grouped_query_attention(qwen3_target):
    config = json.loads((qwen3_target / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["num_attention_heads"] > config["num_key_value_heads"]  # GQA
    assert config["head_dim"] == 64  # vLLM's CPU attention crashes with 16
    tok = load_tokenizer(qwen3_target)
    assert config["eos_token_id"] == tok.convert_tokens_to_ids(IM_END) == tok.eos_token_id  # stops at end of turn
    # 6 layers: vLLM's default ids (2, 3, 3) repeat, so the platform picks three distinct ones.
    assert config["num_hidden_layers"] == 6
    ids = default_aux_layer_ids(config["num_hidden_layers"])
    assert len(set(ids)) == 3 and all(0 < i <= 6 for i in ids), ids


def test_qwen3_model_writes_its_own_think_block(qwen3_target):
    tok = load_tokenizer(qwen3_target)
    for marker in (THINK_OPEN, THINK_CLOSE):
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, marker
        assert marker not in tok.all_special_tokens
        assert tok.decode(ids, skip_special_tokens=True) == marker  # the reasoning parser sees it in the text
    messages = [{"role": "user", "content": "What is 3 plus 4?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    history = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "7.", "reasoning_content": "3 and 4 make 7."}], tokenize=False
    )
    assert history.endswith("<|im_start|>assistant\n<think>\n3 and 4 make 7.\n</think>\n\n7.<|im_end|>\n")

    renderer = ChatRenderer(tok)
    assert (renderer.think_open, renderer.think_close, renderer.end_of_turn) == (THINK_OPEN, THINK_CLOSE, IM_END)
    assert not renderer.template_opens_think_block()
    question, reasoning, answer = training_traces()[1]
    # What vLLM's qwen3 parser returns for the text the model was trained to write (see the served test).
    trace = renderer.render([{"role": "user", "content": question}], f"\n{reasoning}\n", f"\n\n{answer}")
    assert trace.completion_text == response_text(reasoning, answer)
    supervised = [i for i, m in zip(trace.input_ids, trace.loss_mask) if m]
    assert supervised[0] == tok.convert_tokens_to_ids(THINK_OPEN) and supervised[-1] == tok.convert_tokens_to_ids(IM_END)


@pytest.mark.vllm
def test_vllm_serves_the_qwen3_target_in_reasoning_format(qwen3_vllm_server, qwen3_target):
    complete = complete_reasoning_answers(qwen3_vllm_server, "qwen3 target", timeout_s=600)

    # The qwen3 parser dropped the <think> the model wrote and split at </think>: neither marker is left
    # in either field, and the platform rebuilds from the two fields the token sequence the model wrote.
    assert_fields_rebuild_what_the_model_wrote(ChatRenderer(load_tokenizer(qwen3_target)), complete, "qwen3 target")
