"""The demo's built-in targets, and how each is served and configured, selected with ``EAGLE3_DEMO_TARGET``.

- ``tiny`` (default): the small Llama whose chat template opens the think
  block; served in float32 with the ``deepseek_r1`` parser; the plug-in's
  target resource (``path: demo``), evaluated on its own built-in held-out
  prompts;
- ``kimi``: the DeepSeek-V3 / Kimi-K2 family (MLA, MoE with ``noaux_tc``
  routing, a remote-code tokenizer, Kimi's markup where the model writes
  ``<think>``); served in bfloat16 with ``--trust-remote-code`` and the
  ``kimi_k2`` parser; configured like a user's own target: a real path,
  ``trust_remote_code`` on, evaluation prompts held out of the prompt set.

``make demo DEMO_TARGET=kimi`` runs the whole graph on the second one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.core.serving.profile import ServingProfile
from resources.target_model import TargetModel

from eagle3_assets.demo.environment import DEMO_TARGET

DEMO_TARGET_ENV = DEMO_TARGET.name
# How the tiny target is served: its name in the demo's requests, and the parser of its <think> markup.
TINY_SERVING = {"served_model_name": "tiny-reasoner", "profile": ServingProfile(reasoning_parser="deepseek_r1")}


@dataclass(frozen=True)
class DemoTarget:
    name: str
    model_dir: Callable[[], Path]  # builds (once, cached) and returns the model directory
    target_model: Callable[[], TargetModel]  # the target_model resource of the graph's runs
    serving: dict = field(default_factory=dict)  # VLLMServer options of the generation server: its name and serving profile
    holdout_share: float = 0.0  # demo prompts kept out of training for draft_evaluation


def _tiny_dir() -> Path:
    from eagle3_assets.demo.stack import tiny_target_dir

    return tiny_target_dir()


def _kimi_dir() -> Path:
    from eagle3_assets.demo.stack import kimi_target_dir

    return kimi_target_dir()


def _kimi_serving() -> dict:
    from eagle3_assets.demo.kimi_target import kimi_serving

    return kimi_serving()


def _qwen3_dir() -> Path:
    from eagle3_assets.demo.stack import qwen3_target_dir

    return qwen3_target_dir()


def _qwen3_serving() -> dict:
    from eagle3_assets.demo.qwen3_target import QWEN3_REASONING_PARSER

    return {"profile": ServingProfile(reasoning_parser=QWEN3_REASONING_PARSER)}


def _tiny_target_model() -> TargetModel:
    from eagle3_assets.demo.plugin import DemoTargetModel

    return DemoTargetModel()


DEMO_TARGETS = {
    "tiny": DemoTarget("tiny", _tiny_dir, _tiny_target_model, serving=TINY_SERVING),
    # A user's own target in all but origin: its real path, remote code opted in, prompts held out of its dataset.
    "kimi": DemoTarget(
        "kimi", _kimi_dir, lambda: TargetModel(path=str(_kimi_dir()), trust_remote_code=True), serving=_kimi_serving(), holdout_share=0.1
    ),
    "qwen3": DemoTarget("qwen3", _qwen3_dir, lambda: TargetModel(path=str(_qwen3_dir())), serving=_qwen3_serving(), holdout_share=0.1),
}


def selected_demo_target() -> DemoTarget:
    name = DEMO_TARGET.get()
    if name not in DEMO_TARGETS:
        raise ValueError(f"{DEMO_TARGET_ENV}={name!r}: one of {sorted(DEMO_TARGETS)}")
    return DEMO_TARGETS[name]
