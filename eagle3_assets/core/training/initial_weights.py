"""The draft's initial weights: from scratch, or an existing draft with its ``lm_head`` rows remapped by target id."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eagle3_assets.core.draft.forms import AUTO, DEEPSEEK_MLA, FormChoice, choose_draft_form, draft_config_for_target, form_of, new_draft
from eagle3_assets.core.draft.model import DraftConfig, Eagle3Draft, norm_flags_of
from eagle3_assets.core.draft.export import draft_config_from_hf, read_draft_dir
from eagle3_assets.core.draft.model_mla import DEFAULT_QK_ROPE_HEAD_DIM, MLADraftConfig
from eagle3_assets.core.target.description import text_config, vllm_default_aux_layer_ids
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import HiddenStateIndex
from eagle3_assets.core.draft.vocab import VocabMapping


@dataclass
class InitReport:
    source: str  # "scratch" or the fine-tuned directory
    lm_head_rows_kept: int = 0
    lm_head_rows_new: int = 0
    notes: list[str] = field(default_factory=list)
    # Fine-tuning: the norm flags set that the starting draft lacked, their weights started at 1 (identity scale).
    norms_added: list[str] = field(default_factory=list)


def initial_draft(config: TrainConfig, index: HiddenStateIndex, mapping: VocabMapping, target: dict) -> tuple[Eagle3Draft, InitReport]:
    """A fresh draft whose embedding is the target's, or an existing draft adapted to the new vocabulary map."""
    target_config = json.loads((Path(config.target_path) / "config.json").read_text())
    torch.manual_seed(config.seed)
    if config.init_from is None:
        # The stage resolves 'auto' before training (and records why); a direct call resolves it here.
        form = config.draft_form if config.draft_form != AUTO else choose_draft_form(AUTO, target_config).form
        draft_config = draft_config_for_target(form, target_config, mapping.draft_vocab_size, index.aux_layer_ids, **draft_shape(config, form))
        draft = new_draft(draft_config)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(target["embed"])
            if config.head_from_target:
                # The draft's head starts as the target's own (final norm, lm_head rows of the draft
                # vocabulary): the draft then only has to learn to produce the target's final state.
                # On a tiny target this gave a clearly longer acceptance after the same training.
                draft.norm.weight.copy_(target["norm"])
                draft.lm_head.weight.copy_(target["lm_head"][mapping.draft_to_target])
        draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
        return draft, InitReport(source="scratch")
    draft, report = _fine_tune_start(Path(config.init_from), index, mapping, target, config)
    if config.draft_form not in (AUTO, draft.form):
        raise ValueError(f"cannot fine-tune {config.init_from}: it is a {draft.form!r}-form draft, draft_form says {config.draft_form!r}")
    return draft, report


def norm_settings(config: TrainConfig, form: str) -> dict[str, bool]:
    """The norm flags set for a draft of ``form``; one its vLLM class does not read is refused, not ignored."""
    own = (MLADraftConfig if form == DEEPSEEK_MLA else DraftConfig).norm_flags
    foreign = sorted(flag for flag in DraftConfig.norm_flags if getattr(config, flag) and flag not in own)
    if foreign:
        raise ValueError(f"{foreign} do not apply to a {form!r}-form draft: vLLM's class of that form does not read them")
    return {flag: bool(getattr(config, flag)) for flag in own}


def draft_shape(config: TrainConfig, form: str) -> dict[str, int | bool | None]:
    """The training settings that shape a draft of ``form`` (its norm flags too); a setting of the other form is refused, not ignored."""
    llama = {
        "num_key_value_heads": config.draft_num_key_value_heads,
        "head_dim": config.draft_head_dim,
        "sliding_window": config.draft_sliding_window,
    }
    mla = {"q_lora_rank": config.draft_q_lora_rank, "kv_lora_rank": config.draft_kv_lora_rank}
    own, other = (mla, llama) if form == DEEPSEEK_MLA else (llama, mla)
    foreign = sorted(f"draft_{k}" for k, v in other.items() if v is not None)
    if foreign:
        raise ValueError(f"{foreign} do not apply to a {form!r}-form draft")
    shape = {"intermediate_size": config.draft_intermediate_size, "num_attention_heads": config.draft_num_attention_heads, **own}
    return {**shape, **norm_settings(config, form)}


def _fine_tune_start(
    path: Path, index: HiddenStateIndex, mapping: VocabMapping, target: dict, config: TrainConfig
) -> tuple[Eagle3Draft, InitReport]:
    hf, tensors = read_draft_dir(path)
    old, layer_ids = draft_config_from_hf(hf, str(path))
    report = InitReport(source=str(path))
    # The starting draft keeps the norms it has; a flag set here that it lacks is added, its norm weights at 1.
    wanted = norm_settings(config, form_of(old))
    report.norms_added = [flag for flag, on in wanted.items() if on and not getattr(old, flag)]
    problems = []
    if old.target_hidden_size != index.hidden_size:
        problems.append(f"it reads target states of width {old.target_hidden_size}, the hidden states have {index.hidden_size}")
    if old.vocab_size != mapping.target_vocab_size:
        problems.append(f"its vocab_size {old.vocab_size} is not the target's {mapping.target_vocab_size}")
    if layer_ids is None:
        default = vllm_default_aux_layer_ids(index.num_layers)
        if default != index.aux_layer_ids:
            problems.append(
                f"its config names no eagle_aux_hidden_state_layer_ids, so vLLM used its default {default}, "
                f"but the hidden states were extracted at {index.aux_layer_ids}"
            )
        report.notes.append(f"config named no layer ids; vLLM's default {default} equals the hidden states'")
    elif list(layer_ids) != index.aux_layer_ids:
        problems.append(f"it was trained on layers {layer_ids}, the hidden states are from {index.aux_layer_ids}")
    if config.draft_sliding_window is not None and not hasattr(old, "sliding_window"):
        problems.append(f"draft_sliding_window applies to a 'llama'-form draft only, it is a {form_of(old)!r}-form one")
    if "embed_tokens.weight" not in tensors and old.hidden_size != index.hidden_size:
        problems.append("it has no embed_tokens and its width differs from the target's, so it cannot share the target's")
    if problems:
        raise ValueError(f"cannot fine-tune {path}: " + "; ".join(problems))

    try:
        # A window set here replaces the starting draft's (the weights do not depend on it); unset, it keeps its own.
        window = {"sliding_window": config.draft_sliding_window} if config.draft_sliding_window is not None else {}
        new_config = replace(
            old, draft_vocab_size=mapping.draft_vocab_size, aux_layer_ids=tuple(index.aux_layer_ids),
            **dict.fromkeys(report.norms_added, True), **window,
        )  # fmt: skip
    except ValueError as exc:  # e.g. fc_norm set for a draft trained with norm_before_fc
        raise ValueError(f"cannot fine-tune {path} with these norm settings: {exc}") from None
    draft = new_draft(new_config)  # of the old draft's form; new lm_head rows keep this random init, new norms weights 1
    own = {k: v for k, v in tensors.items() if k not in ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")}
    added_weights = {name for name in draft.state_dict() if name.startswith(("fc_norm.", "input_norm."))} - set(own)
    missing = sorted(set(draft.state_dict()) - set(own) - {"lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} - added_weights)
    if missing:
        raise ValueError(f"cannot fine-tune {path}: its weights lack {missing}")
    draft.load_state_dict(own, strict=False)
    if report.norms_added:
        had = [flag for flag, on in norm_flags_of(old).items() if on]
        report.notes.append(
            f"norms added at identity (weights 1): {', '.join(report.norms_added)}; the starting draft had "
            f"{', '.join(had) or 'none (plain EAGLE-3)'}"
        )
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(tensors.get("embed_tokens.weight", target["embed"]).float())
        # Rows follow target ids: row i of the new head predicts target id i + d2t_new[i].
        old_targets = torch.arange(old.draft_vocab_size) + tensors.get("d2t", torch.zeros(old.draft_vocab_size, dtype=torch.int64))
        old_row_of_target = torch.full((mapping.target_vocab_size,), -1, dtype=torch.int64)
        old_row_of_target[old_targets] = torch.arange(old.draft_vocab_size)
        old_rows = old_row_of_target[mapping.draft_to_target]
        kept = old_rows >= 0
        draft.lm_head.weight[kept] = tensors["lm_head.weight"].float()[old_rows[kept]]
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    report.lm_head_rows_kept, report.lm_head_rows_new = int(kept.sum()), int((~kept).sum())
    return draft, report


def choose_training_form(train) -> FormChoice:
    """The draft form of a training run (a ``TrainConfig``): :func:`~eagle3_assets.core.draft.forms.choose_draft_form`
    given its setting, its target and the form of its starting draft (read here, beside the fine-tuning code, so
    that ``forms`` need not import ``export``)."""
    target_config = json.loads((Path(train.target_path) / "config.json").read_text())
    init_form = None
    if train.init_from:
        hf, _ = read_draft_dir(Path(train.init_from))
        init_form = form_of(draft_config_from_hf(hf, train.init_from)[0])
    latent = None
    if train.draft_kv_lora_rank:  # the MLA form's own rank beside the target's (or DeepSeek-V3's) rotary width
        text = text_config(target_config)
        latent = int(train.draft_kv_lora_rank) + int(text.get("qk_rope_head_dim") or DEFAULT_QK_ROPE_HEAD_DIM)
    return choose_draft_form(train.draft_form, target_config, init_from_form=init_form, mla_latent_head_size=latent)
