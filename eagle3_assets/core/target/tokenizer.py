"""The target's tokenizer: remote-code tokenizers (Kimi's is one) load only when the user opts in.

The model directory says when a tokenizer is remote code
(:func:`remote_code_tokenizer`), and :func:`load_tokenizer` names the setting to
change and the code to review.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.target.description import TRUST_REMOTE_CODE_SETTING, TargetError


@dataclass(frozen=True)
class RemoteTokenizerCode:
    """A tokenizer that only its model directory's own code can build, as the directory itself says.

    ``tokenizer_class`` is the class ``tokenizer_config.json`` names; ``code``
    the Python files ``auto_map`` points at (relative to the model directory, or
    ``repo--module.py`` when the code lives in another repository);
    ``declared_in`` the file that declares it.
    """

    tokenizer_class: str | None
    code: tuple[str, ...]
    declared_in: str

    def describe(self, path: Path | str) -> str:
        named = f"class {self.tokenizer_class}" if self.tokenizer_class else "its class"
        if not self.code:
            return (
                f"{self.declared_in} names tokenizer_class {self.tokenizer_class!r}, which transformers does not ship, "
                "and no auto_map says which code defines it"
            )
        # `repo--module.py` is code from another repository; anything else is a file of this directory.
        files = ", ".join(c if "--" in c else str(Path(path) / c) for c in self.code)
        return f"{self.declared_in} maps AutoTokenizer to {named} (auto_map), defined by the model's own code: {files}"


def _auto_map_code(entry: Any) -> list[str]:
    """The code files of one ``auto_map`` entry: ``"module.Class"`` or ``[slow, fast]`` (either may be None)."""
    references = entry if isinstance(entry, (list, tuple)) else [entry]
    files = []
    for reference in references:
        if isinstance(reference, str) and "." in reference:
            module = reference.rsplit(".", 1)[0]
            files.append(module.replace(".", "/") + ".py" if "--" not in module else module + ".py")
    return list(dict.fromkeys(files))


def _transformers_ships_tokenizer(class_name: str) -> bool:
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        return tokenizer_class_from_name(class_name) is not None
    except Exception:  # noqa: BLE001  a class transformers cannot import is one it does not ship usably
        return False


def remote_code_tokenizer(path: Path | str) -> RemoteTokenizerCode | None:
    """What in the model directory says its tokenizer is remote code, or None when transformers builds it alone.

    Read from the directory itself (``tokenizer_config.json``, then ``config.json``):
    an ``auto_map`` entry for ``AutoTokenizer``, or a ``tokenizer_class`` that the
    installed transformers does not ship. Not from the wording of transformers'
    exception: a remote-code class whose vocabulary is a file of its own (Kimi's
    tiktoken file) fails without the opt-in with "Couldn't instantiate the backend
    tokenizer", which says nothing of remote code.
    """
    root = Path(path)
    tokenizer_class = None
    for name in ("tokenizer_config.json", "config.json"):
        file = root / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text())
        except ValueError:
            continue  # an unreadable file is for transformers to report
        if not isinstance(config, dict):
            continue
        tokenizer_class = tokenizer_class or config.get("tokenizer_class")
        auto_map = config.get("auto_map")
        if isinstance(auto_map, dict) and auto_map.get("AutoTokenizer"):
            return RemoteTokenizerCode(tokenizer_class, tuple(_auto_map_code(auto_map["AutoTokenizer"])), name)
    if isinstance(tokenizer_class, str) and not _transformers_ships_tokenizer(tokenizer_class):
        return RemoteTokenizerCode(tokenizer_class, (), "tokenizer_config.json")
    return None


def load_tokenizer(path: Path | str, trust_remote_code: bool = False):
    """The target's tokenizer; a remote-code tokenizer without the opt-in is an error naming the setting and the code.

    The directory says whether the tokenizer is remote code
    (:func:`remote_code_tokenizer`), so the error comes before transformers is
    asked, whatever transformers would have said.
    """
    from transformers import AutoTokenizer

    remote = remote_code_tokenizer(path)
    if remote is not None and not remote.code:
        raise TargetError(
            f"target model {path}: its tokenizer does not load: {remote.describe(path)}; add the auto_map entry and its "
            "code to the model directory (as the model's publisher ships them), or use a transformers that has the class"
        )
    if remote is not None and not trust_remote_code:
        raise TargetError(
            f"target model {path}: its tokenizer is remote code and loads only with trust_remote_code: "
            f"{remote.describe(path)}. Review that code, then set {TRUST_REMOTE_CODE_SETTING}"
        )
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
