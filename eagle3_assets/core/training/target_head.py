"""The target's head (its final norm and ``lm_head``, restricted to the draft vocabulary): what the draft learns to match."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from eagle3_assets.core.vocab import VocabMapping


def _target_weight_names(target_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, for a single or sharded checkpoint."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: str(target_dir / file) for name, file in json.loads(index.read_text())["weight_map"].items()}
    names: dict[str, str] = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            names.update({name: str(file) for name in fh.keys()})
    if not names:
        raise FileNotFoundError(f"target {target_dir}: no safetensors weights")
    return names


def load_target_tensors(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """The target's ``embed_tokens``, final ``norm`` and ``lm_head`` weights (only those), as float32."""
    target_dir = Path(target_dir)
    names = _target_weight_names(target_dir)

    def find(suffix: str, exclude: str = "\0") -> str | None:
        hits = [n for n in names if n.endswith(suffix) and exclude not in n]
        return min(hits, key=len) if hits else None

    wanted = {"embed": find("embed_tokens.weight"), "norm": find("norm.weight", exclude="layers."), "lm_head": find("lm_head.weight")}
    config = json.loads((target_dir / "config.json").read_text())
    text = config.get("text_config", config)
    if wanted["lm_head"] is None and text.get("tie_word_embeddings", config.get("tie_word_embeddings")):
        wanted["lm_head"] = wanted["embed"]
    missing = [k for k, v in wanted.items() if v is None]
    if missing:
        raise ValueError(f"target {target_dir}: cannot find its {missing} weights")
    out = {}
    for key, name in wanted.items():
        with safe_open(names[name], framework="pt") as fh:
            out[key] = fh.get_tensor(name).float()
    out["rms_norm_eps"] = torch.tensor(float(text.get("rms_norm_eps", 1e-6)))
    return out


class TargetHead(nn.Module):
    """The target's next-token distribution from its stored final states."""

    def __init__(self, tensors: dict[str, torch.Tensor], mapping: VocabMapping, final_state: str):
        super().__init__()
        self.apply_norm = final_state == "pre_norm"  # vLLM stores the last layer's output before the norm
        self.eps = float(tensors["rms_norm_eps"])
        self.register_buffer("norm_weight", tensors["norm"])
        self.register_buffer("lm_head", tensors["lm_head"])
        self.register_buffer("draft_to_target", mapping.draft_to_target)

    @torch.no_grad()
    def forward(self, final: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocabulary [.., Vd], the target's top-1 target id [..])."""
        if self.apply_norm:
            final = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        flat = final.reshape(-1, final.shape[-1])
        restricted, top = [], []
        for part in flat.split(chunk):  # full-vocabulary logits only a chunk at a time (160k-wide for Kimi)
            logits = part @ self.lm_head.T
            top.append(logits.argmax(-1))
            restricted.append(logits[:, self.draft_to_target])
        shape = final.shape[:-1]
        return torch.cat(restricted).view(*shape, -1), torch.cat(top).view(shape)

