"""Export a trained draft as vLLM's native EAGLE-3 directory, read one back, and check it.

Either form (:mod:`eagle3_assets.core.draft.forms`): vLLM's
``LlamaForCausalLMEagle3`` or its MLA form ``Eagle3DeepseekV2ForCausalLM``,
whose weights have the Llama form's names except for the attention (DeepSeek's
``q_a_proj`` ... ``kv_b_proj``). The directory holds ``config.json`` and ``model.safetensors``. vLLM reads the
draft's architecture and shapes from the config (missing shape fields fall back
to transformers' Llama defaults, which do not fit a draft), the draft
vocabulary from ``draft_vocab_size`` and ``d2t``, and the target layers it must
capture from ``eagle_config.eagle_aux_hidden_state_layer_ids``. That last field
is the dangerous one: without it vLLM silently uses its default layers, and a
draft trained on other layers then proposes garbage (acceptance from ~59 % to
~1 % has been seen). :func:`config_problems` therefore checks every field and
that the ids equal the ones the hidden states were extracted at; whether vLLM
itself serves the directory is :mod:`eagle3_assets.core.draft.load_check`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_assets.core.draft.forms import DEEPSEEK_MLA, LLAMA, AnyDraftConfig, form_of
from eagle3_assets.core.draft.model import DraftConfig, Eagle3Draft, norm_flags_of, rope_theta_of
from eagle3_assets.core.draft.model_mla import MLADraftConfig
from eagle3_assets.core.storage.files import staging_dir
from eagle3_assets.core.storage.shard_paths import DRAFT_CONFIG_FILE

WEIGHTS_FILE = "model.safetensors"
# Each form as vLLM names it. The MLA form's model_type must be deepseek_v2: vLLM rewrites a deepseek_v3
# draft into its multi-token-prediction model, whatever the architecture says.
ARCHITECTURES = {LLAMA: "LlamaForCausalLMEagle3", DEEPSEEK_MLA: "Eagle3DeepseekV2ForCausalLM"}
MODEL_TYPES = {LLAMA: "llama", DEEPSEEK_MLA: "deepseek_v2"}

# Every config field vLLM's EAGLE-3 classes (and the layers they reuse) read, with the type it must have:
# the fields both forms share, then each form's attention fields.
COMMON_FIELDS: dict[str, type | tuple[type, ...]] = {
    "architectures": list,
    "model_type": str,
    "num_hidden_layers": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_attention_heads": int,
    "hidden_act": str,
    "rms_norm_eps": (int, float),
    "rope_theta": (int, float),
    "max_position_embeddings": int,
    "tie_word_embeddings": bool,
    "vocab_size": int,
    "draft_vocab_size": int,
    "target_hidden_size": int,
    "eagle_config": dict,
}
FORM_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    LLAMA: {"num_key_value_heads": int, "head_dim": int},
    DEEPSEEK_MLA: {"q_lora_rank": int, "kv_lora_rank": int, "qk_nope_head_dim": int, "qk_rope_head_dim": int, "v_head_dim": int},
}
REQUIRED_FIELDS = {**COMMON_FIELDS, **FORM_FIELDS[LLAMA]}  # the Llama form's, the default form
NORM_FLAGS = DraftConfig.norm_flags  # optional (absent: off, plain EAGLE-3); the MLA form reads all but norm_before_fc
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draft_hf_config(config: AnyDraftConfig, dtype: str) -> dict:
    """The ``config.json`` of a native EAGLE-3 draft of either form."""
    form = form_of(config)
    common = {
        "architectures": [ARCHITECTURES[form]],
        "model_type": MODEL_TYPES[form],
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        # rope_theta for transformers 4 readers, rope_parameters for transformers 5.
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "dtype": dtype,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # Top-level, where both of vLLM's classes read them (EAGLE 3.1: fc_norm + norm_output); written even when off,
        # so that the file says which variant it is.
        **norm_flags_of(config),
    }
    if form == LLAMA:
        # vLLM's Llama draft windows a layer that layer_types marks sliding (its index counted from the draft's own
        # first layer): written only for a windowed draft, so a full-attention draft's file is as before.
        window = {"sliding_window": config.sliding_window, "layer_types": ["sliding_attention"]} if config.sliding_window else {}
        return {
            **common,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "attention_bias": False,
            "mlp_bias": False,
            **window,
        }
    return {
        **common,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        # No expert fields: vLLM's EAGLE-3 DeepSeek layer always builds a dense MLP of intermediate_size.
    }


def form_of_hf(hf: dict) -> str:
    """Which form an EAGLE-3 ``config.json`` describes: by architecture, else by model type."""
    names = hf.get("architectures") or []
    for form, architecture in ARCHITECTURES.items():
        if architecture in names:
            return form
    return DEEPSEEK_MLA if hf.get("kv_lora_rank") or any("Deepseek" in n for n in names) else LLAMA


def draft_config_from_hf(hf: dict, source: str) -> tuple[AnyDraftConfig, list[int] | None]:
    """A draft config (of its form) from an existing draft's ``config.json``; layer ids ``None`` if it names none."""
    form = form_of_hf(hf)
    required = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"]
    if form == DEEPSEEK_MLA:
        required += list(FORM_FIELDS[DEEPSEEK_MLA])
    missing = [f for f in required if hf.get(f) is None]
    if missing:
        raise ValueError(f"draft config {source} lacks {missing}")
    if int(hf.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"draft config {source}: num_hidden_layers {hf['num_hidden_layers']}, only 1-layer drafts are supported")
    eagle = hf.get("eagle_config") or {}
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids")
    heads = int(hf["num_attention_heads"])
    shared = dict(
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_attention_heads=heads,
        vocab_size=int(hf["vocab_size"]),
        draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
        target_hidden_size=int(hf.get("target_hidden_size") or hf["hidden_size"]),
        aux_layer_ids=tuple(int(i) for i in (layer_ids or ())),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta_of(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        **hf_norm_flags(hf, form),
    )
    sliding = (hf.get("layer_types") or [None])[0] == "sliding_attention"  # where vLLM's Llama draft reads it
    if form == DEEPSEEK_MLA:
        if sliding:
            raise ValueError(f"draft config {source}: a sliding window on an MLA-form draft (only the Llama form's is read by vLLM)")
        config: AnyDraftConfig = MLADraftConfig(**shared, **{f: int(hf[f]) for f in FORM_FIELDS[DEEPSEEK_MLA]})
    else:
        config = DraftConfig(
            **shared,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            sliding_window=int(hf["sliding_window"]) if sliding else None,
        )
    return config, ([int(i) for i in layer_ids] if layer_ids else None)


def hf_norm_flags(hf: dict, form: str) -> dict[str, bool]:
    """The norm flags of a ``config.json`` as vLLM reads them (absent: off); ``norm_before_fc`` also from ``eagle_config``."""
    flags = {flag: bool(hf.get(flag, False)) for flag in MLADraftConfig.norm_flags}  # the flags both forms read
    if form == LLAMA:
        flags["norm_before_fc"] = bool((hf.get("eagle_config") or {}).get("norm_before_fc", hf.get("norm_before_fc", False)))
    return flags


def export_draft(model: Eagle3Draft, out_dir: Path, *, dtype: str = "bfloat16", target_embedding: torch.Tensor | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir``, replacing it as a whole.

    The embedding is left out when it is the target's (vLLM then shares the
    target's, no second copy of a 160k x 7168 table). ``d2t`` is left out only
    when the draft vocabulary is the whole target vocabulary, where vLLM has
    no map to load it into.
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"export dtype {dtype!r}: expected one of {sorted(TORCH_DTYPES)}")
    config = model.config
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "embed_tokens.weight" and target_embedding is not None and torch.equal(
            value.detach().cpu().float(), target_embedding.detach().cpu().float()
        ):
            continue
        if name == "d2t" and config.draft_vocab_size == config.vocab_size:
            continue
        value = value.detach().cpu()
        tensors[name] = (value.to(TORCH_DTYPES[dtype]) if value.is_floating_point() else value).contiguous()

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out_dir)
    try:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / DRAFT_CONFIG_FILE).write_text(json.dumps(draft_hf_config(config, dtype), indent=2) + "\n")
        for path in staging.iterdir():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        # Swap whole directories so that a reader never sees new weights beside an old config.
        retired = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(retired, ignore_errors=True)
        if out_dir.exists():
            os.replace(out_dir, retired)
        os.replace(staging, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def read_draft_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` and every tensor of an EAGLE-3 directory (one or several safetensors files)."""
    path = Path(path)
    config_file = path / DRAFT_CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"draft checkpoint {path}: no {DRAFT_CONFIG_FILE}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"draft checkpoint {path}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    return json.loads(config_file.read_text()), tensors


def expected_weight_shapes(config: AnyDraftConfig) -> dict[str, tuple[int, ...]]:
    h = config.hidden_size
    shapes = {
        "fc.weight": (h, len(config.aux_layer_ids or (0, 0, 0)) * config.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        **_attention_shapes(config),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (config.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (config.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, config.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }
    if config.draft_vocab_size != config.vocab_size:
        shapes["d2t"] = (config.draft_vocab_size,)
    if config.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (config.target_hidden_size,) for i in range(len(config.aux_layer_ids or (0, 0, 0)))})
    if getattr(config, "norm_before_fc", False):
        shapes["input_norm.weight"] = (len(config.aux_layer_ids or (0, 0, 0)) * config.target_hidden_size,)
    return shapes


def _attention_shapes(config: AnyDraftConfig) -> dict[str, tuple[int, ...]]:
    """The first layer's attention weights: its input projections take the embedding and the fused state (2H)."""
    h, attn = config.hidden_size, "midlayer.self_attn."
    if isinstance(config, MLADraftConfig):
        heads, rank, rope = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
        return {
            attn + "q_a_proj.weight": (config.q_lora_rank, 2 * h),
            attn + "q_a_layernorm.weight": (config.q_lora_rank,),
            attn + "q_b_proj.weight": (heads * (config.qk_nope_head_dim + rope), config.q_lora_rank),
            attn + "kv_a_proj_with_mqa.weight": (rank + rope, 2 * h),
            attn + "kv_a_layernorm.weight": (rank,),
            attn + "kv_b_proj.weight": (heads * (config.qk_nope_head_dim + config.v_head_dim), rank),
            attn + "o_proj.weight": (h, heads * config.v_head_dim),
        }
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        attn + "q_proj.weight": (q, 2 * h),
        attn + "k_proj.weight": (kv, 2 * h),
        attn + "v_proj.weight": (kv, 2 * h),
        attn + "o_proj.weight": (h, q),
    }


def config_problems(draft_dir: Path, expected_layer_ids: list[int], target_vocab_size: int | None = None) -> list[str]:
    """Everything that would make vLLM reject this draft or run it on the wrong layers; empty when complete."""
    try:
        hf, tensors = read_draft_dir(draft_dir)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    form = form_of_hf(hf)
    problems = []
    for name, kind in {**COMMON_FIELDS, **FORM_FIELDS[form]}.items():
        if name not in hf:
            problems.append(f"config.json lacks {name}")
        elif not isinstance(hf[name], kind) or (kind is int and isinstance(hf[name], bool)):
            problems.append(f"config.json {name}={hf[name]!r} is not {getattr(kind, '__name__', kind)}")
    if problems:
        return problems
    if ARCHITECTURES[form] not in hf["architectures"]:
        problems.append(f"architectures {hf['architectures']} does not name {ARCHITECTURES[form]}")
    if hf["model_type"] != MODEL_TYPES[form] or hf["num_hidden_layers"] != 1:
        problems.append(
            f"model_type {hf['model_type']!r} / num_hidden_layers {hf['num_hidden_layers']}: expected {MODEL_TYPES[form]!r} / 1"
        )
    eagle = hf["eagle_config"]
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids:
        problems.append("eagle_config lacks eagle_aux_hidden_state_layer_ids: vLLM would silently use its default layers")
    elif list(layer_ids) != list(expected_layer_ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids {layer_ids} differ from the hidden states' {list(expected_layer_ids)}")
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state is not true")
    problems += norm_flag_problems(hf, form)
    if target_vocab_size is not None and hf["vocab_size"] != target_vocab_size:
        problems.append(f"vocab_size {hf['vocab_size']} differs from the target's {target_vocab_size}")
    try:
        config, _ = draft_config_from_hf(hf, str(draft_dir))
    except (ValueError, NotImplementedError) as exc:
        return problems + [str(exc)]
    for name, shape in expected_weight_shapes(config).items():
        if name not in tensors:
            problems.append(f"{WEIGHTS_FILE} lacks {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, config implies {shape}")
    if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
        problems.append(f"d2t is {tensors['d2t'].dtype}, vLLM expects int64 offsets")
    elif "d2t" in tensors:
        targets = torch.arange(config.draft_vocab_size) + tensors["d2t"]
        if targets.min() < 0 or targets.max() >= config.vocab_size:
            problems.append("d2t maps draft ids outside the target vocabulary")
    if "embed_tokens.weight" in tensors and tuple(tensors["embed_tokens.weight"].shape) != (config.vocab_size, config.hidden_size):
        problems.append(f"embed_tokens.weight has shape {tuple(tensors['embed_tokens.weight'].shape)}")
    return problems


def norm_flag_problems(hf: dict, form: str) -> list[str]:
    """Norm flags vLLM would misread: not a boolean, both input norms, or ``norm_before_fc`` in the MLA form (ignored there)."""
    problems = [f"config.json {flag}={hf[flag]!r} is not bool" for flag in NORM_FLAGS if flag in hf and not isinstance(hf[flag], bool)]
    if problems:
        return problems
    flags = hf_norm_flags(hf, LLAMA)
    if flags["fc_norm"] and flags["norm_before_fc"]:
        problems.append("fc_norm and norm_before_fc are both set: vLLM would apply both norms, no trainer makes such a draft")
    if form == DEEPSEEK_MLA and flags["norm_before_fc"]:
        problems.append("norm_before_fc is set, but vLLM's MLA-form class (deepseek_eagle3.py) never applies it")
    return problems
