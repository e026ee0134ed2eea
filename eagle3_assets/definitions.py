"""The one ``Definitions`` object: assets, checks, resources, sensors and jobs."""

from __future__ import annotations

from dagster import Definitions

from eagle3_assets import settings
from eagle3_assets.demo.stack import DEMO_SHARD_SIZE
from eagle3_assets.prompts import prompts
from resources.alerts import alert_channel_from_env
from resources.prompt_dataset import PromptDataset
from sensors import ALL_SENSORS

# Materialised together, one shard at a time (the demo, backfills).
PER_SHARD_ASSETS = [prompts]


def default_resources() -> dict:
    return {
        "prompt_dataset": PromptDataset(source=settings.PROMPTS_SOURCE, shard_size=settings.SHARD_SIZE),
        "alert_channel": alert_channel_from_env(),
    }


def demo_resources(base_url: str, served_model_name: str) -> dict:
    """The resources of the embedded default, pointed at a demo vLLM server."""
    return {
        **default_resources(),
        "prompt_dataset": PromptDataset(source="demo", shard_size=DEMO_SHARD_SIZE),
    }


defs = Definitions(assets=PER_SHARD_ASSETS, resources=default_resources(), sensors=ALL_SENSORS)
