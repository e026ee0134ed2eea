"""The one ``Definitions`` object (the code location): the platform's graph over the deployment's resources.

The resources come from the environment (``EAGLE3_TARGET_MODEL``,
``EAGLE3_PROMPTS``, ``EAGLE3_VLLM_URLS``...). Where it names no target or no
prompts, or names ``demo``, the embedded default serves: the built-in tiny
target and prompt set of :mod:`eagle3_assets.demo`, with the sampling that
fits them. This is the one module outside ``demo/`` that knows of it.
"""

from __future__ import annotations


from eagle3_assets.core.settings.environment import BY_NAME
from eagle3_assets.demo import plugin as demo
from eagle3_assets.graph import build_definitions, deployment_resources
from resources.prompt_dataset import SOURCE_ENV, PromptDataset
from resources.target_model import PATH_ENV, TargetModel


def _names_the_demo(variable: str) -> bool:
    return (BY_NAME[variable].get() or "") in ("", demo.BUILT_IN)


def default_resources() -> dict:
    """The deployment's resources, read from the environment now."""
    # EAGLE3_TARGET_MODEL, EAGLE3_TRUST_REMOTE_CODE, EAGLE3_AUX_LAYER_IDS
    target = demo.DemoTargetModel.from_env() if _names_the_demo(PATH_ENV) else TargetModel.from_env()
    # EAGLE3_PROMPTS, EAGLE3_SHARD_SIZE
    prompt_dataset = demo.DemoPromptDataset.from_env() if _names_the_demo(SOURCE_ENV) else PromptDataset.from_env()
    # The demo's target (`make dev` beside `make serve-demo`) is sampled as its 4,096-token context allows.
    sampling = demo.SAMPLING if isinstance(target, demo.DemoTargetModel) else {}
    return deployment_resources(target, prompt_dataset, **sampling)


defs = build_definitions(default_resources())
