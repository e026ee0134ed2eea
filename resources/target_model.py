"""The target model: where its weights and tokenizer are, and the facts stages need from it."""

from __future__ import annotations

import json
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

from eagle3_assets.core.storage import stable_hash

DEMO_TARGET = "demo"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layer ids: the residual stream *entering* layers 2, L//2 and L-3.

    In transformers' ``output_hidden_states`` these are ``hidden_states[k]``
    (index 0 is the embeddings).
    """
    return [2, num_layers // 2, num_layers - 3]


class TargetModel(ConfigurableResource):
    """The target as stages load it: a local HF model directory (or ``demo``, the tiny target)."""

    path: str = Field(default=DEMO_TARGET, description="HF model directory on the host that runs the stage, or 'demo'")
    aux_layer_ids: list[int] | None = Field(
        default=None, description="EAGLE-3 auxiliary layer ids in vLLM's convention; default (2, L//2, L-3)"
    )
    _resolved: Path | None = PrivateAttr(default=None)

    def resolved_path(self) -> Path:
        if self._resolved is None:
            if self.path == DEMO_TARGET:
                from eagle3_assets.demo.stack import tiny_target_dir

                self._resolved = tiny_target_dir()
            else:
                self._resolved = Path(self.path).expanduser()
        return self._resolved

    def config(self) -> dict:
        config_file = self.resolved_path() / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"target model {self.resolved_path()}: no config.json")
        return json.loads(config_file.read_text())

    def config_hash(self) -> str:
        """Identifies the target's weights and config for lineage (config + weight file sizes and names)."""
        root = self.resolved_path()
        weights = sorted((p.name, p.stat().st_size) for p in root.glob("*.safetensors"))
        return stable_hash({"config": self.config(), "weights": weights})

    def num_layers(self) -> int:
        return int(_text_config(self.config())["num_hidden_layers"])

    def hidden_size(self) -> int:
        return int(_text_config(self.config())["hidden_size"])

    def layer_ids(self) -> list[int]:
        ids = list(self.aux_layer_ids) if self.aux_layer_ids else default_aux_layer_ids(self.num_layers())
        if len(ids) != 3 or any(not 0 < i <= self.num_layers() for i in ids):
            raise ValueError(f"aux_layer_ids {ids} must be three ids in 1..{self.num_layers()} (vLLM's convention)")
        return ids

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.resolved_path())


def _text_config(config: dict) -> dict:
    """Multimodal wrappers (e.g. Kimi-K2.5) nest the language model's config."""
    return config.get("text_config", config)
