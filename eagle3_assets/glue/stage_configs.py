"""Dagster ``Config`` classes that more than one module takes: each is a stage's settings model with Dagster's base mixed in.

``HiddenStatesConfig`` is ``hidden_states``' run config and, nested, how
``draft_checkpoint``'s bounded-disk mode extracts each streamed shard;
``DraftTrainingConfig`` and ``VocabMappingConfig`` are their assets' run
config and what a plug-in of ``definitions.py`` sets for its own targets.
Here, not in an asset module, so that no asset module imports another and a
plug-in imports no asset.
"""

from dagster import Config
from pydantic import Field

from eagle3_assets.core.settings.environment import ACCEPT_UNKNOWN_CAPACITY
from eagle3_assets.core.extraction.job import ExtractionRecipe, ShardRerun
from eagle3_assets.core.training.job import BoundedWindow, HiddenStatesSource, TrainingStageRecipe
from eagle3_assets.core.training.config import TrainingRecipe


class HiddenStatesConfig(ShardRerun, ExtractionRecipe, Config):
    """How a shard is extracted (``ExtractionRecipe``) and rerun (``ShardRerun``): those models themselves, every
    field editable per run in the launchpad; and one field of the orchestrator's own, not sent to the stage."""

    accept_unknown_capacity: bool = Field(
        default=ACCEPT_UNKNOWN_CAPACITY.get(),
        description="offline mode: a run on a GPU host whose free space cannot be read goes ahead, the risk stated in the run's "
        f"log, instead of being refused before its first shard (default: ${ACCEPT_UNKNOWN_CAPACITY.name})",
    )

    def stage_settings(self) -> dict:
        """What the stage is sent (``ExtractionJob``'s settings): every field but the orchestrator's own."""
        return self.model_dump(exclude={"accept_unknown_capacity"})


# Bases last-first: pydantic lists the fields of the last base first, so the launchpad shows the recipe, then the rest.
class DraftTrainingConfig(BoundedWindow, HiddenStatesSource, TrainingStageRecipe, TrainingRecipe, Config):
    """Training knobs: published EAGLE-3 recipes, with the schedule fitted to the data where it is left unset.

    The settings models themselves with Dagster's base mixed in, no field listed again: the recipe
    (:class:`~eagle3_assets.core.training.config.TrainingRecipe`), the stage's processes, export precision and vLLM
    check (:class:`~eagle3_assets.core.training.job.TrainingStageRecipe`), and where the states come from
    (``HiddenStatesSource``, ``BoundedWindow``).
    """

    # Which shards: the green ones (traces and, offline, states past their blocking gates), or these by key.
    shards: list[str] = Field(default=[], description="the shards to train on, by key; empty: every registered shard that is green")
    streamed_extraction: HiddenStatesConfig = Field(
        default=HiddenStatesConfig(),
        description="bounded mode: how each streamed shard is extracted and gated (hidden_states' settings; "
        "recompute does not apply: every epoch extracts anew)",
    )


class VocabMappingConfig(Config):
    draft_vocab_size: int = Field(default=32000, description="tokens the draft predicts over (capped at the target's vocabulary)")
    shards: list[str] = Field(
        default=[], description="the shards to count, by key; empty: every registered shard whose validated traces are green"
    )
