"""Deployment settings read from the environment when the definitions load.

Resource fields are the knobs a user sees in the UI's launchpad; these are only
their defaults for this deployment, so `dagster dev` and `make demo` agree.
"""

from __future__ import annotations

import os

from eagle3_assets.core.sharding import DEFAULT_SHARD_SIZE


def env_str(name: str, default: str) -> str:
    return os.environ.get(name) or default


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


DEMO_SHARD_SIZE = 64  # the built-in set is a few hundred prompts: a handful of shards

PROMPTS_SOURCE = env_str("EAGLE3_PROMPTS", "demo")
SHARD_SIZE = env_int("EAGLE3_SHARD_SIZE", DEMO_SHARD_SIZE if PROMPTS_SOURCE == "demo" else DEFAULT_SHARD_SIZE)

# Sampling for the demo: short answers, so max_tokens far below the 8k default.
DEMO_MAX_TOKENS = 256
DEMO_TEMPERATURE = 0.7
