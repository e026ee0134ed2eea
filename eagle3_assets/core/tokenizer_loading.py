"""The target's tokenizer: remote-code tokenizers (Kimi's is one) load only when the user opts in."""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.core.target import TRUST_REMOTE_CODE_SETTING, TargetError


def load_tokenizer(path: Path | str, trust_remote_code: bool = False):
    """The target's tokenizer; a remote-code tokenizer without the opt-in is an error naming the setting."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise TargetError(
                f"target model {path}: its tokenizer is remote code (auto_map in tokenizer_config.json) and loads only "
                f"with trust_remote_code; review the code in that directory, then set {TRUST_REMOTE_CODE_SETTING}"
            ) from None
        raise
