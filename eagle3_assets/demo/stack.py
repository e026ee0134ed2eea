"""Where the embedded default lives on disk: the tiny target and the demo prompt sets.

Everything is derived from seeds and cached under the data directory, so a
fresh machine builds it once (about a minute) and later runs reuse it.
``EAGLE3_TINY_TARGET_DIR`` points several data directories (the tests') at one
cached target; ``EAGLE3_KIMI_TARGET_DIR`` does the same for the second built-in
target, of the DeepSeek-V3 / Kimi-K2 family (about two minutes to build), and
``EAGLE3_QWEN3_TARGET_DIR`` for the Qwen3 one and ``EAGLE3_LONG_TARGET_DIR`` for the long-trace one.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.core.storage.files import data_dir
from eagle3_assets.demo.environment import KIMI_TARGET_DIR, LONG_TARGET_DIR, QWEN3_TARGET_DIR, TINY_TARGET_DIR
from eagle3_assets.demo.kimi_target import KimiTargetSpec, ensure_kimi_target
from eagle3_assets.demo.long_target import LongTargetSpec, ensure_long_target, long_prompts
from eagle3_assets.demo.prompt_set import demo_prompts, eval_prompts, write_jsonl
from eagle3_assets.demo.qwen3_target import Qwen3TargetSpec, ensure_qwen3_target
from eagle3_assets.demo.tiny_target import TinyTargetSpec, ensure_tiny_target

__all__ = [
    "demo_eval_prompts_path", "demo_prompts_path", "kimi_target_dir", "long_prompts_path", "long_target_dir", "qwen3_target_dir", "tiny_target_dir",
]  # fmt: skip


def tiny_target_dir(spec: TinyTargetSpec = TinyTargetSpec(), log=print) -> Path:
    override = TINY_TARGET_DIR.get()
    return ensure_tiny_target(Path(override) if override else data_dir() / "demo" / "tiny_target", spec, log=log)


def kimi_target_dir(spec: KimiTargetSpec = KimiTargetSpec(), log=print) -> Path:
    override = KIMI_TARGET_DIR.get()
    return ensure_kimi_target(Path(override) if override else data_dir() / "demo" / "kimi_target", spec, log=log)


def qwen3_target_dir(spec: Qwen3TargetSpec = Qwen3TargetSpec(), log=print) -> Path:
    override = QWEN3_TARGET_DIR.get()
    return ensure_qwen3_target(Path(override) if override else data_dir() / "demo" / "qwen3_target", spec, log=log)


def long_target_dir(spec: LongTargetSpec = LongTargetSpec(), log=print) -> Path:
    override = LONG_TARGET_DIR.get()
    return ensure_long_target(Path(override) if override else data_dir() / "demo" / "long_target", spec, log=log)


def long_prompts_path() -> Path:
    """The long target's own prompt set (its task families, multi-turn and system prompts), written once."""
    path = data_dir() / "demo" / "long_prompts.jsonl"
    if not path.is_file():
        write_jsonl(path, long_prompts())
    return path


def demo_prompts_path() -> Path:
    path = data_dir() / "demo" / "prompts.jsonl"
    if not path.is_file():
        write_jsonl(path, demo_prompts())
    return path


def demo_eval_prompts_path() -> Path:
    path = data_dir() / "demo" / "eval_prompts.jsonl"
    if not path.is_file():
        write_jsonl(path, eval_prompts())
    return path
