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

- ``qwen3``: the Qwen3 architecture (grouped-query attention, its own markup);
- ``long``: the long-trace target (``long_target.py``): traces of 750-7,750
  tokens whose length the question sets, over its own prompt set (64
  conversations, some multi-turn, several system prompts), generated at
  temperature 0.6 with the user's 8,192 completion tokens and a draft trained at
  ``max_seq_len`` 8,192.

``make demo DEMO_TARGET=kimi`` runs the whole graph on the second one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.core.serving.profile import CPU_KV_CACHE_ENV, ServingProfile
from resources.target_model import TargetModel

from eagle3_assets.demo.environment import DEMO_TARGET

DEMO_TARGET_ENV = DEMO_TARGET.name
# How the tiny target is served: its name in the demo's requests, and the parser of its <think> markup.
TINY_SERVING = {"served_model_name": "tiny-reasoner", "profile": ServingProfile(reasoning_parser="deepseek_r1")}
# The long target's markup is the tiny one's. Its KV cache (2 KiB a token: long_target.py) holds 128 requests of
# ~8,400 tokens (prompt and completion) in 2.1 GiB: 3 GiB, against the platform's 1 GiB default on a CPU host, which
# holds ~60 such requests and would make vLLM preempt and recompute the rest.
LONG_SERVING = {
    "served_model_name": "long-reasoner",
    "profile": ServingProfile(reasoning_parser="deepseek_r1", env={CPU_KV_CACHE_ENV: "3"}),
}
LONG_HOLDOUT_SHARE = 0.125  # ~8 of its 64 prompts held out for draft_evaluation
# The first 4,352 tokens of every held-out trace, all in flight at once: every output-position bucket gets verify
# steps (4,096-8,192 its first 256 positions, from the held-out questions that ask for more than 4,096 tokens). Whole
# traces (8,192) would not fit the demo's 30 minutes: vLLM on 2 shared CPU cores, eager, took 56-100 ms a k = 5 verify
# step (8.5 ms a plain one) whatever the batch, and the untrained baseline verifies one token a step
# (docs/performance.md#the-long-trace-target).
LONG_EVALUATION = {"max_tokens": 4352, "concurrency": 8}


@dataclass(frozen=True)
class DemoTarget:
    name: str
    model_dir: Callable[[], Path]  # builds (once, cached) and returns the model directory
    target_model: Callable[[], TargetModel]  # the target_model resource of the graph's runs
    serving: dict = field(default_factory=dict)  # VLLMServer options of the generation server: its name and serving profile
    holdout_share: float = 0.0  # demo prompts kept out of training for draft_evaluation
    prompts_path: Callable[[], Path] | None = None  # its own prompt set (written once); None: the demo's shared one
    sampling: dict | None = None  # vllm_server's sampling and concurrency; None: the tiny targets' (plugin.SAMPLING)
    training: object | None = None  # draft_checkpoint's DraftTrainingConfig; None: plugin.TRAINING_CONFIG
    evaluation: dict | None = None  # draft_evaluation's run config; None: its defaults


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


def _long_dir() -> Path:
    from eagle3_assets.demo.stack import long_target_dir

    return long_target_dir()


def _long_prompts() -> Path:
    from eagle3_assets.demo.stack import long_prompts_path

    return long_prompts_path()


def _long_training():
    from eagle3_assets.demo.plugin import LONG_TRAINING_CONFIG

    return LONG_TRAINING_CONFIG


def _long_sampling() -> dict:
    from eagle3_assets.demo.plugin import LONG_SAMPLING

    return LONG_SAMPLING


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
    # Long traces: the user's 8,192 completion tokens over 64 prompts (the demo took 31 min on 2 shared cores, resumed).
    "long": DemoTarget(
        "long", _long_dir, lambda: TargetModel(path=str(_long_dir())), serving=LONG_SERVING, holdout_share=LONG_HOLDOUT_SHARE,
        prompts_path=_long_prompts, sampling=_long_sampling(), training=_long_training(), evaluation=LONG_EVALUATION,
    ),  # fmt: skip
}


def selected_demo_target() -> DemoTarget:
    name = DEMO_TARGET.get()
    if name not in DEMO_TARGETS:
        raise ValueError(f"{DEMO_TARGET_ENV}={name!r}: one of {sorted(DEMO_TARGETS)}")
    return DEMO_TARGETS[name]
