"""``draft_checkpoint``: train the EAGLE-3 draft on the green shards' hidden states, export it for vLLM, prove vLLM loads it.

The training runs on the GPU host (stage ``train_draft``, Dagster Pipes; DDP
under ``torchrun`` with ``nproc_per_node`` > 1). The result is
``<data>/draft_checkpoint/model/`` in vLLM's native EAGLE-3 form, Llama or
MLA (``draft_form``; ``auto`` is decided on the GPU host from what its vLLM
serves beside the target, and the metadata says which and why); the training
state (step checkpoints, the journal, ``history.json``) is under
``<data>/draft_checkpoint/training/``.

The states come from one of two sources, the launchpad's ``hidden_states_mode``:
``offline``, the materialised ``hidden_states`` shards; ``bounded``, each
shard's states extracted again every epoch by the stage into
``<data>/draft_checkpoint/streamed_states/`` (never ``hidden_states/``), at
most ``window_shards`` shards at a time, gated as ``hidden_states`` gates them,
trained on and deleted (docs/bounded-disk.md). In bounded mode no
``hidden_states`` partition is materialised (nothing claims a deleted file);
the asset depends on ``validated_traces`` too, which is what that mode reads,
and its materialisation records the streamed shards with the data version
``hidden_states`` would have given them, the window and its peak bytes. Gates:

- ``config_complete`` (blocking): every field vLLM reads is in ``config.json``,
  every weight is there with its shape, and the layer ids are the ones the
  hidden states were extracted at (vLLM silently uses its defaults otherwise);
- ``loads_in_vllm`` (blocking): vLLM serves the target with this draft as its
  speculative model and answers a chat completion, running the draft;
- ``loss_decreased`` (WARN): the last epoch's mean loss is below the first's.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.draft.load_check import LOAD_CHECK_CONTEXT
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements, with_serving_need
from eagle3_assets.core.draft.gates import DRAFT_CHECKPOINT_GATES
from eagle3_assets.core.storage.shard_paths import SIDECAR, DatasetPaths, ShardPaths
from eagle3_assets.core.extraction.job import ExtractionRecipe, StageTarget
from eagle3_assets.core.training.job import (
    BoundedModeError,
    BoundedRun,
    ExportGates,
    StreamedShard,
    TrainingJob,
    TrainingStageRecipe,
    mode_problems,
)
from eagle3_assets.core.storage.files import asset_dir, stable_hash
from eagle3_assets.core.settings.job_schema import values_of
from eagle3_assets.core.training.config import TrainConfig, TrainingRecipe
from eagle3_assets.core.training.curves import epoch_means, expected_accepted_tokens, render_accuracy, render_curve
from eagle3_assets.core.training.window import describe_estimate
from eagle3_assets.core.extraction.gates import HIDDEN_STATE_GATES
from eagle3_assets.core.extraction.backends import extraction_modules
from eagle3_assets.core.extraction.needs import TRACES, disk_estimate
from eagle3_assets.core.validation.gates import TRACE_GATES
from eagle3_assets.glue.lineage import states_lineage
from eagle3_assets.core.planning.shard_selection import ShardSelection
from eagle3_assets.glue.partitions import SAMPLE_SHARDS
from eagle3_assets.glue.shard_status import green_shards, selection_metadata
from eagle3_assets.glue.stage_configs import DraftTrainingConfig, HiddenStatesConfig
from resources.gpu_host import GPU_POOL, GPUHost, register_stage
from resources.target_model import TargetModel

STAGE = "train_draft"
WINDOW_DIR = "streamed_states"
# Offline mode's needs; bounded mode passes its own (the extraction's modules and the window's disk) with each run.
TRAIN_DRAFT_REQUIREMENTS = register_stage(
    STAGE,
    StageRequirements(
        modules=["torch", "safetensors", "dagster_pipes"], output_dirs=["draft_checkpoint"],
        serves_target=True, serving_context=LOAD_CHECK_CONTEXT,  # loads_in_vllm starts the target beside the draft
    ),
)


CHECKS = AssetChecks(DRAFT_CHECKPOINT_GATES)  # the declared gates as this asset's checks


def check_mode(mode: str, window_shards: int, checkpoint_every_steps: int = 1, nproc: int = 1, nnodes: int = 1) -> None:
    """Refuse bad launchpad values before anything runs, naming each setting."""
    problems = mode_problems(mode, window_shards, checkpoint_every_steps, nproc, nnodes)
    if problems:
        raise BoundedModeError("draft_checkpoint config: " + "; ".join(problems))


@dataclass(frozen=True)
class StatesSource:
    """What the job says of the training's states: stored shard directories, or the shards to stream (bounded)."""

    shard_dirs: list[Path]
    layer_ids: list[int]  # what the export's layer ids must be
    vocab_size: int
    bounded: BoundedRun | None = None
    requirements: StageRequirements | None = None  # the pre-flight's, when not the stage's registered ones


def stored_states(keys: list[str], target_hash: str, target_path) -> StatesSource:
    """Offline mode: every registered shard's hidden-state directory; an error names incomplete or stale shards."""
    if not keys:
        raise ValueError(f"no sample shards are registered ({SAMPLE_SHARDS}): materialise the per-shard assets first")
    shards = [ShardPaths("hidden_states", key) for key in keys]
    incomplete = [s.shard for s in shards if not s.sidecar.is_file()]
    if incomplete:
        raise FileNotFoundError(f"hidden_states of shards {incomplete} are missing or incomplete (no {SIDECAR} under {shards[0].asset_dir})")
    sidecars = [json.loads(s.sidecar.read_text()) for s in shards]
    stale = [key for key, meta in zip(keys, sidecars) if meta.get("target_config_hash") != target_hash]
    if stale:
        raise ValueError(
            f"hidden_states of shards {stale} were extracted from another target (config hash "
            f"{sidecars[keys.index(stale[0])].get('target_config_hash')}) than target_model {target_path} ({target_hash}): "
            "set target_model.path to the target they came from, or materialise their hidden_states again"
        )
    return StatesSource([s.directory for s in shards], [int(i) for i in sidecars[0]["aux_layer_ids"]], int(sidecars[0]["vocab_size"]))


def training_shards(context: AssetExecutionContext, config: DraftTrainingConfig) -> ShardSelection:
    """The shards to train on: green for what the mode reads (bounded mode extracts and gates the states itself)."""
    gates = {TRACES: TRACE_GATES.blocking_names}
    if config.hidden_states_mode != "bounded":
        gates["hidden_states"] = HIDDEN_STATE_GATES.blocking_names
    selection = green_shards(context.instance, gates, config.shards)
    context.log.info(f"draft_checkpoint: {selection.summary()}")
    return selection


def streamed_data_version(context: AssetExecutionContext, key: str, target_model: TargetModel, extraction: HiddenStatesConfig) -> str:
    """The data version ``hidden_states`` would record for this shard's states: the same inputs, hashed the same way."""
    return stable_hash(states_lineage(context, key, target_model, extraction.backend, extraction.dtype))


def bounded_requirements(keys: list[str], hidden_size: int, extraction: HiddenStatesConfig, window_shards: int) -> StageRequirements:
    """The pre-flight's disk estimate in bounded mode: the window's bytes, not the dataset's."""
    shard_bytes = {key: disk_estimate(key, hidden_size, extraction.dtype)[0] for key in keys}
    window_bytes, note = describe_estimate(shard_bytes, window_shards, f"{extraction.dtype}, H={hidden_size}")
    return StageRequirements(
        modules=extraction_modules(extraction.backend),
        output_dirs=["draft_checkpoint"],
        disk_bytes=window_bytes,
        disk_note=note,
    )


def streamed_states(
    context: AssetExecutionContext, keys: list[str], target_model: TargetModel, config: DraftTrainingConfig, out: Path
) -> StatesSource:
    """Bounded mode: the shards to stream with their traces, and the pre-flight's estimate of the window."""
    if not keys:
        raise ValueError(f"no sample shards are registered ({SAMPLE_SHARDS}): materialise the per-shard assets first")
    extraction = config.streamed_extraction
    shards = [
        StreamedShard(
            key=key,
            traces=ShardPaths(TRACES, key).parquet.as_posix(),
            data_version=streamed_data_version(context, key, target_model, extraction),
        )
        for key in keys
    ]
    requirements = bounded_requirements(keys, target_model.hidden_size(), extraction, config.window_shards)
    context.log.info(f"draft_checkpoint: {requirements.disk_note}; the pre-flight checks the GPU host can hold the window")
    run = BoundedRun(
        shards=shards,
        window_dir=str(out / WINDOW_DIR),
        target=StageTarget(**target_model.stage_extras()),
        extraction=ExtractionRecipe(**values_of(extraction, ExtractionRecipe)),
        window_shards=config.window_shards,
        checkpoint_every_steps=config.checkpoint_every_steps,
    )
    return StatesSource([], target_model.layer_ids(), int(target_model.text_config()["vocab_size"]), run, requirements)


@asset(
    group_name="training",
    code_version="1",
    kinds={"pytorch", "safetensors"},
    pool=GPU_POOL,
    deps=[
        AssetDep(AssetKey("hidden_states"), partition_mapping=AllPartitionMapping()),
        # Bounded mode reads the traces and extracts the states itself (streamed_states).
        AssetDep(AssetKey("validated_traces"), partition_mapping=AllPartitionMapping()),
        AssetKey("vocab_mapping"),
    ],
    check_specs=CHECKS.specs(),
)
def draft_checkpoint(
    context: AssetExecutionContext, config: DraftTrainingConfig, target_model: TargetModel, gpu_host: GPUHost
) -> MaterializeResult:
    """The trained EAGLE-3 draft as a vLLM-native directory (config.json + model.safetensors with d2t)."""
    check_mode(config.hidden_states_mode, config.window_shards, config.checkpoint_every_steps, config.nproc_per_node, config.nnodes)
    selection = training_shards(context, config)
    keys = selection.used
    identity = target_model.identity()
    paths = DatasetPaths()
    out = asset_dir("draft_checkpoint")
    model_dir, training_dir = paths.draft_model, paths.training_dir
    # The one choice between the modes: where the stage's batches come from.
    states = (
        streamed_states(context, keys, target_model, config, out)
        if config.hidden_states_mode == "bounded"
        else stored_states(keys, identity.config_hash, identity.path)
    )
    layer_ids = states.layer_ids

    mapping_file = paths.vocab_mapping
    train = TrainConfig(
        hidden_state_dirs=[str(d) for d in states.shard_dirs],
        vocab_mapping=str(mapping_file),
        target_path=target_model.host_path(),
        training_dir=str(training_dir),
        **values_of(config, TrainingRecipe),
    )
    job = TrainingJob(
        train=train,
        export_dir=str(model_dir),
        bounded=states.bounded,
        # The gates run in the stage: loads_in_vllm serves the target, which needs the GPU host's GPUs.
        gates=ExportGates(
            aux_layer_ids=layer_ids,
            target_vocab_size=states.vocab_size,
            log_path=str(paths.loads_in_vllm_log),
            serving=target_model.serving_profile(),
        ),
        **values_of(config, TrainingStageRecipe),
    )
    # loads_in_vllm serves the target (and bounded mode's vLLM backend extracts) as its profile says: checked first.
    requirements = with_serving_need(states.requirements or TRAIN_DRAFT_REQUIREMENTS, target_model.gpu_need(TRAIN_DRAFT_REQUIREMENTS.serving_context))
    invocation = gpu_host.run_stage(context, STAGE, job.to_dict(), requirements=requirements)
    reported = invocation.get_materialize_result()
    stage_metadata = dict(reported.metadata or {})
    problems = list(stage_metadata.pop("config_problems").value)
    vllm_report = stage_metadata.pop("loads_in_vllm").value  # tried only when config_complete passed

    # -- the training curve
    history = json.loads(paths.history.read_text())["history"]
    losses = epoch_means(history, "loss")
    accuracy = epoch_means(history, "accuracy")[-1] if history else []

    # -- the gates (computed by the stage, on the GPU host)
    if problems:
        context.log.error("config_complete failed:\n" + "\n".join(f"- {p}" for p in problems))
    else:
        context.log.info(f"loads_in_vllm: {vllm_report['detail']}")

    version = stable_hash(
        {
            "training": stage_metadata["training_fingerprint"].value,
            "target": identity.config_hash,
            "layer_ids": layer_ids,
            "export_dtype": config.export_dtype,
        }
    )
    return MaterializeResult(
        data_version=DataVersion(version),
        metadata={
            **stage_metadata,
            "path": MetadataValue.path(str(model_dir)),
            "aux_layer_ids": MetadataValue.json(layer_ids),
            "target": MetadataValue.json(identity.as_dict()),
            # The stage's source says the mode, the samples and which storage precision the draft learned from.
            "shards": len(keys),
            **selection_metadata(selection),
            "epochs": (stage_metadata["schedule"].value or {}).get("epochs"),
            "steps": len(history),
            "first_epoch_loss": losses[0] if losses else None,
            "last_epoch_loss": losses[-1] if losses else None,
            "loss_by_epoch": MetadataValue.json([round(x, 5) for x in losses]),
            "accuracy_by_position": MetadataValue.json([round(a, 4) for a in accuracy]),
            "expected_accepted_tokens_per_draft": round(expected_accepted_tokens(accuracy), 3),
            "training_curve": MetadataValue.md(
                "Loss per optimizer step (all unrolled steps, weighted):\n\n" + render_curve([r["loss"] for r in history])
            ),
            "per_position_accuracy": MetadataValue.md(
                "Last epoch, draft token i vs the target's top-1 token:\n\n" + render_accuracy(accuracy)
            ),
        },
        check_results=CHECKS.results(SimpleNamespace(problems=problems, layer_ids=layer_ids, vllm_report=vllm_report, losses=losses)),
    )
