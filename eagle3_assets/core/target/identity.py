"""Which target a file was made by: the files that define the model for the traces and the states.

A stage records the identity of the model it actually loaded, and the gates
compare identities, never paths alone (a GPU host may mount the same model
elsewhere). The identity of the target that rendered a shard's traces travels
with the file, in its Parquet metadata.

The identity is made only of what both sides of a deployment hold: the
orchestrator renders traces with the tokenizer, the chat template and the
config, and has no weights; the GPU host has all of it. So it hashes

- ``config``: config.json (parsed: its formatting does not count);
- ``tokenizer``: the tokenizer's files (tokenizer.json, tokenizer_config.json,
  vocab/merges, sentencepiece or tiktoken models, the remote tokenizer code
  that ``auto_map`` names and the data files that code names);
- ``chat_template``: chat_template.jinja / .json, else tokenizer_config's;
- ``weights_index``: the weights' own index (``model.safetensors.index.json``:
  which tensor lives in which file, and the total size) or a checksum file
  beside them, where the model has one; copy it with the tokenizer and config.

and never the weight files themselves: their names and sizes exist only on
the GPU host (an orchestrator without them got another identity and
``target_matches_traces`` blocked every shard), and hashing a 600 GB
checkpoint per run is not an option.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.core.target.description import read_config

# The files a tokenizer is loaded from, by the names transformers and the common remote tokenizers give them.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "tiktoken.model", "qwen.tiktoken",
)  # fmt: skip
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# The weights' own description, where the model ships one: small, and the same wherever the weights are copied.
WEIGHTS_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "SHA256SUMS", "checksums.sha256")
PARTS = ("config", "tokenizer", "chat_template", "weights_index")
# A file name a remote tokenizer's code opens (``BPE_FILE = "kimi_tiny_bpe.json"``, ``"tiktoken.model"``).
_NAMED_FILE = re.compile(r"""["']([\w.-]+\.(?:json|model|tiktoken|txt))["']""")


def _content_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _remote_tokenizer_files(root: Path, tokenizer_config: dict[str, Any]) -> list[Path]:
    """The tokenizer code ``auto_map`` names (``tokenization_kimi.KimiTokenizer``) and the files that code names."""
    auto = (tokenizer_config.get("auto_map") or {}).get("AutoTokenizer") or []
    entries = auto if isinstance(auto, list) else [auto]
    modules = [root / f"{entry.split('.', 1)[0]}.py" for entry in entries if isinstance(entry, str) and "--" not in entry]
    files = [m for m in modules if m.is_file()]
    for module in list(files):
        files += [root / name for name in _NAMED_FILE.findall(module.read_text(encoding="utf-8", errors="replace"))]
    return [f for f in dict.fromkeys(files) if f.is_file()]


def identity_parts(path: Path | str) -> dict[str, str | None]:
    """A hash per part that defines the model (None: the model directory has no such file)."""
    root = Path(path)
    config_file = root / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    tokenizer = [root / name for name in TOKENIZER_FILES if (root / name).is_file()] + _remote_tokenizer_files(root, tokenizer_config)
    templates = [root / name for name in CHAT_TEMPLATE_FILES if (root / name).is_file()]
    index = [root / name for name in WEIGHTS_INDEX_FILES if (root / name).is_file()]
    return {
        "config": stable_hash(read_config(root)),
        "tokenizer": stable_hash({f.name: _content_hash(f) for f in tokenizer}) if tokenizer else None,
        "chat_template": stable_hash({f.name: _content_hash(f) for f in templates})
        if templates
        else (stable_hash(tokenizer_config["chat_template"]) if tokenizer_config.get("chat_template") else None),
        "weights_index": stable_hash({f.name: _content_hash(f) for f in index}) if index else None,
    }


def config_hash(path: Path | str) -> str:
    """The model's identity hash (the name is older than what it covers: config, tokenizer, template, weights index)."""
    return stable_hash(identity_parts(path))


@dataclass(frozen=True)
class TargetIdentity:
    path: str
    config_hash: str
    parts: dict[str, str | None] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "config_hash": self.config_hash, "parts": dict(self.parts)}

    def mismatch(self, other: TargetIdentity | dict[str, Any] | None) -> str | None:
        """Why ``other`` is another model than this one (None when they are the same model)."""
        if other is None:
            return None
        if not isinstance(other, TargetIdentity):
            other = TargetIdentity(str(other.get("path")), str(other.get("config_hash")), dict(other.get("parts") or {}))
        if other.config_hash == self.config_hash:
            return None
        text = f"{self.path} (identity {self.config_hash}) is not {other.path} (identity {other.config_hash})"
        differing = [part for part in PARTS if self.parts.get(part) != other.parts.get(part)] if self.parts and other.parts else []
        if differing:
            text += f": they differ in {', '.join(differing)}"
        one_sided = [part for part in differing if (self.parts.get(part) is None) != (other.parts.get(part) is None)]
        if one_sided:
            text += f" ({', '.join(one_sided)} present in one directory only: copy the file(s) to the other)"
        return text


def target_identity(path: Path | str) -> TargetIdentity:
    parts = identity_parts(path)
    return TargetIdentity(str(Path(path)), stable_hash(parts), parts)

# The identity of the target that rendered a shard's traces travels with the file, in its Parquet metadata,
# so that the GPU host can compare it with the model it loads without asking the orchestrator.
PARQUET_METADATA_KEY = "eagle3.target"


def parquet_metadata(identity: TargetIdentity) -> dict[str, str]:
    return {PARQUET_METADATA_KEY: json.dumps(identity.as_dict(), sort_keys=True)}


def identity_in_parquet(path: Path | str) -> dict[str, Any] | None:
    """The target identity a Parquet file was written with, or None (written before identities were recorded)."""
    import polars as pl

    raw = pl.read_parquet_metadata(path).get(PARQUET_METADATA_KEY)
    return json.loads(raw) if raw else None
