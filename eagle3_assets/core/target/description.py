"""The target model as every stage sees it: its config facts and its typed description, checked once.

One place for what the stages must agree on about the target, so that the
orchestrator (rendering the traces), the GPU host (extracting, training,
evaluating) and the pre-flight read the same facts the same way:

- multimodal wrappers (Kimi-K2.5) nest the language model's config under
  ``text_config``: :func:`text_config` is the one lookup;
- the EAGLE-3 auxiliary layer ids, in vLLM's convention (id k is the residual
  stream *entering* layer k, ``hidden_states[k]`` of transformers), are checked
  in one place, :func:`checked_layer_ids`, which :class:`TargetDescription` (the
  target as configured, built once from its config) and every stage that is
  handed ids call.

The rest of what a stage knows of the target lives beside this module: its
identity (:mod:`.target_identity`), its tokenizer (:mod:`.tokenizer_loading`),
its final norm and head (:mod:`.target_head`), the pre-flight
(:mod:`.target_preflight`) and how vLLM serves it (:mod:`.target_serving`).
Nothing here imports Dagster or torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The settings a user changes, named once for the messages (launchpad field / environment variable).
TRUST_REMOTE_CODE_SETTING = "target_model.trust_remote_code (environment: EAGLE3_TRUST_REMOTE_CODE=1)"
LAYER_IDS_SETTING = "target_model.aux_layer_ids (environment: EAGLE3_AUX_LAYER_IDS, e.g. 2,4,5)"


class TargetError(ValueError):
    """The target cannot be used as configured; the message names the setting to change."""


def read_config(path: Path | str) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise TargetError(f"target model {path}: no config.json (is target_model.path / EAGLE3_TARGET_MODEL an HF model directory?)")
    return json.loads(config_file.read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: nested under ``text_config`` in multimodal wrappers (Kimi-K2.5), else the config."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


# transformers' default where a config does not say (LlamaConfig, PretrainedConfig).
DEFAULT_RMS_NORM_EPS = 1e-6


def rms_norm_eps(config: dict[str, Any]) -> float:
    """The epsilon of the target's RMSNorms."""
    return float(text_config(config).get("rms_norm_eps", DEFAULT_RMS_NORM_EPS))


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence the target takes (``max_position_embeddings``), or None when its config does not say."""
    value = text_config(config).get("max_position_embeddings")
    return int(value) if value else None



def vllm_default_aux_layer_ids(num_layers: int) -> list[int]:
    """The ids vLLM feeds a draft whose config names none: ``(2, L//2, L-3)``, repeated or not."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layer ids, ``(2, L//2, L-3)``, when they are distinct; else three spread ids.

    vLLM de-duplicates repeated ids silently and then feeds the draft fewer states
    than it was trained on; on a shallow target (6 layers: 2, 3, 3) its default
    repeats. The ids are always written into the exported draft's config, so a
    deviation from vLLM's default is safe; a repeated id never is.
    """
    ids = vllm_default_aux_layer_ids(num_layers)
    if len(set(ids)) == 3 and all(0 < i <= num_layers for i in ids):
        return ids
    spread = sorted({max(1, min(num_layers, round(num_layers * k / 4))) for k in (1, 2, 3)})
    if len(spread) == 3:
        return spread
    return [1, 2, 3] if num_layers >= 3 else ids  # under 3 layers there are no three ids: the pre-flight says so


def _layer_id_problem(layer_ids: Sequence[int], num_layers: int) -> str | None:
    """Why ``layer_ids`` cannot feed an EAGLE-3 draft of this target (None when they can)."""
    ids = [int(i) for i in layer_ids]
    if len(ids) != 3:
        return f"aux_layer_ids {ids}: EAGLE-3 takes exactly three ids"
    if len(set(ids)) != 3:
        return f"aux_layer_ids {ids}: repeated id (vLLM de-duplicates them silently and feeds the draft fewer states)"
    if any(not 0 < i <= num_layers for i in ids):
        return f"aux_layer_ids {ids}: each must be in 1..{num_layers} for this {num_layers}-layer target (vLLM's convention)"
    return None


def checked_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The one check of EAGLE-3 layer ids: ``layer_ids`` as a tuple, or TargetError naming the setting to change."""
    problem = _layer_id_problem(layer_ids, num_layers)
    if problem:
        raise TargetError(f"{problem}; set {LAYER_IDS_SETTING} to three distinct ids, e.g. {default_aux_layer_ids(num_layers)}")
    return tuple(int(i) for i in layer_ids)


@dataclass(frozen=True)
class TargetDescription:
    """The target as the stages use it: the facts of its config and the layer ids its draft reads, checked once.

    Built by :meth:`read` (or :meth:`from_config`) where the target is
    configured; an instance always holds valid ids (unset: the default for its
    depth), so whoever receives one need not check them again.
    """

    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int | None
    aux_layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", checked_layer_ids(self.aux_layer_ids, self.num_layers))

    @classmethod
    def from_config(cls, path: Path | str, config: dict[str, Any], aux_layer_ids: Sequence[int] | None = None) -> TargetDescription:
        """From a config already read (``aux_layer_ids`` unset or empty: the default for the target's depth)."""
        text = text_config(config)
        num_layers = int(text.get("num_hidden_layers") or 0)
        return cls(
            path=str(path),
            num_layers=num_layers,
            hidden_size=int(text.get("hidden_size") or 0),
            vocab_size=int(text.get("vocab_size") or 0),
            context_length=context_length(config),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else tuple(default_aux_layer_ids(num_layers)),
        )

    @classmethod
    def read(cls, path: Path | str, aux_layer_ids: Sequence[int] | None = None) -> TargetDescription:
        """From the target's ``config.json``; TargetError when there is none or the ids do not fit it."""
        return cls.from_config(path, read_config(path), aux_layer_ids)
