"""Dagster ``Config`` classes that more than one asset takes: each is a stage's settings model with Dagster's base mixed in.

``HiddenStatesConfig`` is ``hidden_states``' run config and, nested, how
``draft_checkpoint``'s bounded-disk mode extracts each streamed shard. Here,
not in an asset module, so that no asset module imports another.
"""

from dagster import Config

from eagle3_assets.core.gpu_host.stage_jobs import ExtractionRecipe, ShardRerun


class HiddenStatesConfig(ShardRerun, ExtractionRecipe, Config):
    """How a shard is extracted (``ExtractionRecipe``) and rerun (``ShardRerun``): those models themselves, every
    field editable per run in the launchpad."""
