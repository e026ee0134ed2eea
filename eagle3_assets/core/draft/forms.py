"""Which EAGLE-3 draft architecture ("form") to train for a target on a host, and why.

Two forms, each one of vLLM's own EAGLE-3 model classes:

- ``llama``: ``LlamaForCausalLMEagle3`` (:mod:`eagle3_assets.core.draft.model`),
  what published drafts use, Kimi-K2's included;
- ``deepseek_mla``: ``Eagle3DeepseekV2ForCausalLM``
  (:mod:`eagle3_assets.core.draft.model_mla`), attention in DeepSeek's latent
  form, with latent ranks of its own (the target's by default).

A draft is served in the target's engine and shares its KV-cache blocks, so
vLLM needs one block size that both the target's attention backend and the
draft's take. :func:`choose_draft_form` asks the host's vLLM which backends it
selects for latent (MLA) and for standard attention and which block sizes each
declares (:mod:`eagle3_assets.core.serving.vllm_platform`): ``auto`` takes the Llama
form unless the draft's backend could not share the target's blocks (an MLA
target on a CPU without AMX: CPU_MLA takes blocks of exactly 16, CPU_ATTN
multiples of 32), and then the MLA form. An explicit form that this host's
vLLM could not serve is refused before training, with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.core.draft.model import DraftConfig, Eagle3Draft
from eagle3_assets.core.draft.model_mla import Eagle3MLADraft, MLADraftConfig
from eagle3_assets.core.target.description import text_config
from eagle3_assets.core.target.serving import uses_mla

LLAMA, DEEPSEEK_MLA, AUTO = "llama", "deepseek_mla", "auto"
FORMS = (LLAMA, DEEPSEEK_MLA)
DRAFT_FORM_CHOICES = (AUTO, *FORMS)
DRAFT_FORM_SETTING = "draft_checkpoint's draft_form"

CONFIG_CLASSES: dict[str, type] = {LLAMA: DraftConfig, DEEPSEEK_MLA: MLADraftConfig}
MODEL_CLASSES: dict[str, type[Eagle3Draft]] = {LLAMA: Eagle3Draft, DEEPSEEK_MLA: Eagle3MLADraft}

AnyDraftConfig = DraftConfig | MLADraftConfig


class DraftFormError(ValueError):
    """This draft form cannot be served beside this target by this host's vLLM; the message says why and what to set."""


def form_of(config: AnyDraftConfig) -> str:
    return DEEPSEEK_MLA if isinstance(config, MLADraftConfig) else LLAMA


def new_draft(config: AnyDraftConfig) -> Eagle3Draft:
    """A draft of the form its config describes, randomly initialised."""
    return MODEL_CLASSES[form_of(config)](config)


def draft_config_from_dict(raw: dict[str, Any]) -> AnyDraftConfig:
    """A draft config saved as ``asdict(config)`` (a training checkpoint's ``state.json``): its fields say its form."""
    cls = MLADraftConfig if "kv_lora_rank" in raw else DraftConfig
    return cls(**{**raw, "aux_layer_ids": tuple(raw["aux_layer_ids"])})


def draft_config_for_target(
    form: str, target_config: dict, draft_vocab_size: int, aux_layer_ids: list[int], **shape: int | None
) -> AnyDraftConfig:
    """The form's one-layer draft shaped after the target; ``shape``: the form's overrides (None: the target's)."""
    if form not in FORMS:
        raise DraftFormError(f"draft form {form!r}: one of {FORMS} (or {AUTO!r} before it is chosen)")
    return CONFIG_CLASSES[form].for_target(target_config, draft_vocab_size, aux_layer_ids, **{k: v for k, v in shape.items() if v is not None})


@dataclass(frozen=True)
class FormChoice:
    """The form a draft is trained in, why, and the vLLM facts that decided it (recorded in the asset's metadata)."""

    form: str
    requested: str
    reason: str
    facts: dict = field(default_factory=dict)

    def as_metadata(self) -> dict:
        return {"draft_form": self.form, "draft_form_requested": self.requested, "draft_form_reason": self.reason, "vllm_facts": self.facts}


def choose_draft_form(
    requested: str,
    target_config: dict,
    *,
    init_from_form: str | None = None,
    mla_latent_head_size: int | None = None,
    facts=None,
) -> FormChoice:
    """The form to train: ``requested`` when this host's vLLM can serve it beside the target, ``auto`` resolved.

    ``init_from_form``: the form of the draft fine-tuning starts from (a draft
    keeps its form). ``mla_latent_head_size``: the MLA form's ``kv_lora_rank +
    qk_rope_head_dim``, checked against the head sizes the MLA backend takes.
    ``facts``: the host's :class:`~eagle3_assets.core.serving.vllm_platform.ServingFacts`
    (read from vLLM when not given, and only when the choice depends on them).
    """
    if requested not in DRAFT_FORM_CHOICES:
        raise DraftFormError(f"{DRAFT_FORM_SETTING} {requested!r}: one of {DRAFT_FORM_CHOICES}")
    if init_from_form is not None:
        if requested not in (AUTO, init_from_form):
            raise DraftFormError(
                f"{DRAFT_FORM_SETTING} {requested!r}, but init_from is a {init_from_form!r}-form draft and fine-tuning keeps "
                f"its form: set draft_form to {init_from_form!r} or 'auto'"
            )
        requested_form = init_from_form
    else:
        requested_form = requested
    target_mla = uses_mla(target_config)
    if requested_form == AUTO and not target_mla:
        return FormChoice(LLAMA, requested, "the target uses standard attention: the Llama form, as published drafts are")
    if requested_form == LLAMA and not target_mla:
        return FormChoice(LLAMA, requested, "'llama' as configured; the draft's attention is the target's kind")
    if facts is None:  # only now: reading them imports vLLM
        from eagle3_assets.core.serving.vllm_platform import host_serving_facts

        facts = host_serving_facts()
    target_kind = "mla" if target_mla else "standard"

    def problem(form: str) -> str | None:
        why = facts.shared_block_problem(target_kind, "mla" if form == DEEPSEEK_MLA else "standard")
        if why is None and form == DEEPSEEK_MLA:
            size = mla_latent_head_size or (_latent_head(target_config) if target_mla else None)
            why = facts.mla_head_problem(size) if size else None
        return why

    if requested_form == AUTO:  # an MLA target
        llama_problem = problem(LLAMA)
        if llama_problem is None:
            return FormChoice(LLAMA, requested, f"this host's vLLM serves a Llama-form draft beside this MLA target ({facts.summary()})", facts.as_dict())
        mla_problem = problem(DEEPSEEK_MLA)
        if mla_problem is not None:
            raise DraftFormError(
                f"neither draft form can be served beside this target by this host's vLLM: Llama form: {llama_problem}; "
                f"MLA form: {mla_problem}"
            )
        reason = f"the Llama form cannot be served here: {llama_problem}; the MLA form shares the target's attention backend"
        return FormChoice(DEEPSEEK_MLA, requested, reason, facts.as_dict())
    why = problem(requested_form)
    if why is not None:
        other = DEEPSEEK_MLA if requested_form == LLAMA else LLAMA
        raise DraftFormError(
            f"a {requested_form!r}-form draft cannot be served beside this {'MLA' if target_mla else 'standard-attention'} target by "
            f"this host's vLLM: {why}. Set {DRAFT_FORM_SETTING} to 'auto' (or {other!r}), or train on a host whose vLLM serves it"
        )
    reason = f"{requested_form!r} as configured; this host's vLLM serves it beside the target ({facts.summary()})"
    return FormChoice(requested_form, requested, reason, facts.as_dict())


def _latent_head(target_config: dict) -> int:
    text = text_config(target_config)
    return int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
