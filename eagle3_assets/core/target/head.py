"""The weights a stage needs without the whole model, and the target's next-token logits from its final states.

The embedding, the final norm and the ``lm_head`` are found by name in the
target's safetensors files; :class:`TargetHead` applies the last two. torch is
imported only by what reads weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.target.description import TargetError, read_config, rms_norm_eps, text_config


def weight_files(path: Path | str) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for a single or a sharded checkpoint."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return {name: root / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    if not names:
        raise TargetError(f"target model {root}: no safetensors weights")
    return names


@dataclass(frozen=True)
class HeadWeightNames:
    """The names, in the target's checkpoint, of the weights around its decoder layers."""

    embed: str  # model.embed_tokens.weight
    norm: str  # the final norm, model.norm.weight: a sibling of the embedding, outside the layers
    lm_head: str  # lm_head.weight, or the embedding when the two are tied


def head_weight_names(path: Path | str, names: Sequence[str] | None = None) -> HeadWeightNames:
    """Where the embedding, final norm and ``lm_head`` are among the checkpoint's tensors.

    A wrapped checkpoint (Kimi-K2.5's ``language_model.``) prefixes every name;
    the shortest match is the language model's own. The final norm is the
    ``norm.weight`` beside the embedding (not a layer's ``q_norm``, not a
    vision tower's norm). Without an ``lm_head`` the head is the embedding,
    unless the config says the two are not tied.
    """
    root = Path(path)
    names = list(names if names is not None else weight_files(root))

    def shortest(predicate) -> str | None:
        hits = sorted((n for n in names if predicate(n)), key=len)
        return hits[0] if hits else None

    embed = shortest(lambda n: n.endswith("embed_tokens.weight"))
    lm_head = shortest(lambda n: n.endswith("lm_head.weight"))
    sibling = embed[: -len("embed_tokens.weight")] + "norm.weight" if embed else None
    norm = sibling if sibling in names else shortest(lambda n: n.split(".")[-2:] == ["norm", "weight"] and ".layers." not in n)
    if lm_head is None:
        config = read_config(root)
        # transformers ties the two unless told otherwise (a wrapper may say so at its top level)
        if text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", True)):
            lm_head = embed
    missing = [what for what, name in (("embed_tokens", embed), ("final norm", norm), ("lm_head", lm_head)) if name is None]
    if missing:
        raise TargetError(f"target model {root}: cannot find its {', '.join(missing)} weights among {len(names)} tensors")
    return HeadWeightNames(embed=embed, norm=norm, lm_head=lm_head)


def load_head_weights(path: Path | str, device: str = "cpu") -> dict[str, Any]:
    """The target's ``embed`` [V, H], final ``norm`` [H] and ``lm_head`` [V, H] as float32 tensors, and its ``rms_norm_eps``."""
    from safetensors import safe_open

    root = Path(path)
    files = weight_files(root)
    wanted = head_weight_names(root, list(files))
    out: dict[str, Any] = {}
    for key, name in (("embed", wanted.embed), ("norm", wanted.norm), ("lm_head", wanted.lm_head)):
        with safe_open(str(files[name]), framework="pt") as handle:
            out[key] = handle.get_tensor(name).float().to(device)
    out["rms_norm_eps"] = rms_norm_eps(read_config(root))
    return out


def rms_norm(x, weight, eps: float):
    """Llama's RMSNorm (Llama, Qwen, Mistral, DeepSeek/Kimi): normalise in float32, scale in the input's dtype."""
    import torch

    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass
class TargetHead:
    """The target's final norm and ``lm_head``: its next-token logits from stored final states.

    Read by name from the checkpoint (:func:`load_head_weights`): for a target
    too large for transformers this is a few GB, not the model. vLLM stores the
    last layer's output before the norm (``pre_norm``); transformers' last
    hidden state is after it (``post_norm``).
    """

    lm_head: Any  # torch.Tensor [V, H], float32
    norm_weight: Any  # torch.Tensor [H], float32
    eps: float

    @classmethod
    def from_checkpoint(cls, path: Path | str, device: str = "cpu") -> TargetHead:
        return cls.from_weights(load_head_weights(path, device))

    @classmethod
    def from_weights(cls, weights: dict[str, Any]) -> TargetHead:
        return cls(lm_head=weights["lm_head"], norm_weight=weights["norm"], eps=float(weights["rms_norm_eps"]))

    def to(self, device) -> TargetHead:
        return TargetHead(self.lm_head.to(device), self.norm_weight.to(device), self.eps)

    def normed(self, final_states, final_state: str):
        """What the ``lm_head`` reads, in float32: the final states, through the final norm when they are pre-norm."""
        states = final_states.to(self.lm_head.device).float()
        if final_state not in ("pre_norm", "post_norm"):
            raise ValueError(f"final_state {final_state!r}: expected pre_norm or post_norm")
        return rms_norm(states, self.norm_weight, self.eps) if final_state == "pre_norm" else states

    def logits(self, final_states, final_state: str):
        return self.normed(final_states, final_state) @ self.lm_head.T

    def draft_logits(self, final_states, final_state: str, draft_to_target, chunk: int = 4096):
        """(the logits of the draft vocabulary's tokens [.., Vd], the target's top-1 token id [..]), without gradients.

        The full-vocabulary logits exist only a chunk of positions at a time (160k wide for Kimi).
        """
        import torch

        with torch.no_grad():
            normed = self.normed(final_states, final_state)
            flat = normed.reshape(-1, normed.shape[-1])
            restricted, top = [], []
            for part in flat.split(chunk):
                logits = part @ self.lm_head.T
                top.append(logits.argmax(-1))
                restricted.append(logits[:, draft_to_target])
            shape = normed.shape[:-1]
            return torch.cat(restricted).view(*shape, -1), torch.cat(top).view(shape)

