"""``draft_checkpoint`` in bounded-disk mode: train while extracting, with a window of shards on disk.

Selected in the launchpad with ``hidden_states_mode: bounded`` (and
``window_shards``) on ``draft_checkpoint``. The stage ``train_draft_bounded``
extracts each shard's states again every epoch into
``<data>/draft_checkpoint/streamed_states/`` (the training asset's own
directory, never ``hidden_states/``), gates them as ``hidden_states`` does,
trains on them and deletes them.

What Dagster is told, so that nothing claims a deleted file:

- no ``hidden_states`` partition is materialised by this mode: the transient
  states are not an asset, and a ``hidden_states`` materialisation that exists
  is one of offline mode, whose files are still there;
- ``draft_checkpoint`` depends on ``validated_traces`` too (declared on the
  asset), which is what bounded mode reads;
- its materialisation records which shards were streamed, in which epoch, with
  the data version ``hidden_states`` would have given them, and their gates;
  the window, the peak bytes of states seen on disk, and the mode.
"""

from __future__ import annotations

from pathlib import Path

from dagster import AssetExecutionContext

from eagle3_assets.config_fields import settings_of
from eagle3_assets.core.bounded_training import describe_estimate
from eagle3_assets.core.preflight import StageRequirements
from eagle3_assets.core.shard_paths import ShardPaths
from eagle3_assets.core.stage_jobs import (
    BoundedModeError,
    BoundedRun,
    BoundedTrainingJob,
    ExtractionRecipe,
    StageTarget,
    StreamedShard,
    TrainingJob,
    mode_problems,
)
from eagle3_assets.core.storage import stable_hash
from eagle3_assets.core.extraction_needs import EXTRACTION_MODULES as STAGE_MODULES
from eagle3_assets.core.extraction_needs import TRACES as UPSTREAM
from eagle3_assets.core.extraction_needs import disk_estimate
from eagle3_assets.lineage import states_lineage
from eagle3_assets.stage_configs import HiddenStatesConfig
from resources.gpu_host import GPUHost, register_stage
from resources.target_model import TargetModel

STAGE = "train_draft_bounded"
WINDOW_DIR = "streamed_states"
BOUNDED_REQUIREMENTS = register_stage(STAGE, StageRequirements(modules=STAGE_MODULES, output_dirs=["draft_checkpoint"]))


def check_mode(mode: str, window_shards: int, checkpoint_every_steps: int = 1, nproc: int = 1) -> None:
    """Refuse bad launchpad values before anything runs, naming each setting."""
    problems = mode_problems(mode, window_shards, checkpoint_every_steps, nproc)
    if problems:
        raise BoundedModeError("draft_checkpoint config: " + "; ".join(problems))


def streamed_data_version(context: AssetExecutionContext, key: str, target_model: TargetModel, extraction: HiddenStatesConfig) -> str:
    """The data version ``hidden_states`` would record for this shard's states: the same inputs, hashed the same way."""
    return stable_hash(states_lineage(context, key, target_model, extraction.backend, extraction.dtype))


def bounded_requirements(keys: list[str], hidden_size: int, extraction: HiddenStatesConfig, window_shards: int) -> StageRequirements:
    """The pre-flight's disk estimate in bounded mode: the window's bytes, not the dataset's."""
    shard_bytes = {key: disk_estimate(key, hidden_size, extraction.dtype)[0] for key in keys}
    window_bytes, note = describe_estimate(shard_bytes, window_shards, f"{extraction.dtype}, H={hidden_size}")
    return StageRequirements(
        modules=STAGE_MODULES + (["vllm"] if extraction.backend == "vllm" else []),
        output_dirs=["draft_checkpoint"],
        disk_bytes=window_bytes,
        disk_note=note,
    )


def run_bounded_stage(
    context: AssetExecutionContext, gpu_host: GPUHost, target_model: TargetModel, keys: list[str], export: TrainingJob, *, out: Path, config
):
    """Run ``train_draft_bounded`` on the GPU host after its pre-flight; the Pipes invocation.

    ``export`` is the job offline mode would send (its ``train`` without shard
    directories); ``config`` is ``draft_checkpoint``'s.
    """
    extraction = config.streamed_extraction
    shards = [
        StreamedShard(
            key=key,
            traces=ShardPaths(UPSTREAM, key).parquet.as_posix(),
            data_version=streamed_data_version(context, key, target_model, extraction),
        )
        for key in keys
    ]
    requirements = bounded_requirements(keys, target_model.hidden_size(), extraction, config.window_shards)
    context.log.info(f"draft_checkpoint: {requirements.disk_note}; the pre-flight checks the GPU host can hold the window")
    job = BoundedTrainingJob(
        bounded=BoundedRun(
            train=export.train,
            shards=shards,
            window_dir=str(out / WINDOW_DIR),
            target=StageTarget(**target_model.stage_extras()),
            extraction=ExtractionRecipe(**settings_of(extraction, ExtractionRecipe)),
            window_shards=config.window_shards,
            checkpoint_every_steps=config.checkpoint_every_steps,
        ),
        export=export,
    )
    return gpu_host.run_stage(context, STAGE, job.to_dict(), requirements=requirements)
