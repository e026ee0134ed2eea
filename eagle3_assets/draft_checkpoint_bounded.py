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
from typing import Any

from dagster import AssetExecutionContext

from eagle3_assets.core.bounded_training import DEFAULT_CHECKPOINT_EVERY_STEPS, BoundedModeError, describe_estimate, mode_problems
from eagle3_assets.core.preflight import StageRequirements
from eagle3_assets.core.storage import data_dir, stable_hash
from eagle3_assets.hidden_states import STAGE_MODULES, UPSTREAM, HiddenStatesConfig, disk_estimate, upstream_version
from resources.gpu_host import GPUHost, register_stage
from resources.target_model import TargetModel

STAGE = "train_draft_bounded"
WINDOW_DIR = "streamed_states"
BOUNDED_REQUIREMENTS = register_stage(STAGE, StageRequirements(modules=STAGE_MODULES, output_dirs=["draft_checkpoint"]))


def check_mode(mode: str, window_shards: int, checkpoint_every_steps: int = DEFAULT_CHECKPOINT_EVERY_STEPS, nproc: int = 1) -> None:
    """Refuse bad launchpad values before anything runs, naming each setting."""
    problems = mode_problems(mode, window_shards, checkpoint_every_steps, nproc)
    if problems:
        raise BoundedModeError("draft_checkpoint config: " + "; ".join(problems))


def streamed_data_version(context: AssetExecutionContext, key: str, target_model: TargetModel, extraction: HiddenStatesConfig) -> str:
    """The data version ``hidden_states`` would record for this shard's states: the same inputs, hashed the same way."""
    return stable_hash(
        {
            UPSTREAM: upstream_version(context, key),
            "target_config_hash": target_model.config_hash(),
            "aux_layer_ids": target_model.layer_ids(),
            "backend": extraction.backend,
            "dtype": extraction.dtype,
        }
    )


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
    context: AssetExecutionContext,
    gpu_host: GPUHost,
    target_model: TargetModel,
    keys: list[str],
    train_settings: dict[str, Any],
    common_extras: dict[str, Any],
    *,
    out: Path,
    extraction: HiddenStatesConfig,
    window_shards: int,
    checkpoint_every_steps: int,
):
    """Run ``train_draft_bounded`` on the GPU host after its pre-flight; the Pipes invocation."""
    shards = [
        {"key": key, "traces": str(data_dir() / UPSTREAM / f"{key}.parquet"), "data_version": streamed_data_version(context, key, target_model, extraction)}
        for key in keys
    ]
    requirements = bounded_requirements(keys, target_model.hidden_size(), extraction, window_shards)
    context.log.info(f"draft_checkpoint: {requirements.disk_note}; the pre-flight checks the GPU host can hold the window")
    bounded = {
        "train": {**train_settings, "hidden_state_dirs": []},
        "shards": shards,
        "window_dir": str(out / WINDOW_DIR),
        "target_config_hash": target_model.config_hash(),
        "aux_layer_ids": target_model.layer_ids(),
        "window_shards": window_shards,
        "dtype": extraction.dtype,
        "part_bytes": extraction.part_size_bytes,
        "checkpoint_every_steps": checkpoint_every_steps,
        "checks": {
            "logits_samples": extraction.logits_check_samples,
            "logits_positions": extraction.logits_check_positions,
            "min_argmax_agreement": extraction.min_argmax_agreement,
            "aux_samples": extraction.aux_check_samples,
            "seed": 0,
        },
    }
    backend_extras = {
        "target": target_model.stage_extras(),
        "backend": extraction.backend,
        "max_batch_tokens": extraction.max_batch_tokens,
        "max_batch_size": extraction.max_batch_size,
        "cpu_threads": extraction.cpu_threads,
        "vllm": {
            "dtype": extraction.vllm_dtype,
            "max_model_len": extraction.vllm_max_model_len,
            "tensor_parallel_size": extraction.vllm_tensor_parallel_size,
            "gpu_memory_utilization": extraction.vllm_gpu_memory_utilization,
            "enforce_eager": extraction.vllm_enforce_eager,
        },
        "checks": {"aux_reference": extraction.aux_check_reference},
    }
    extras = {**common_extras, "bounded": bounded, "extraction": backend_extras}
    return gpu_host.run_stage(context, STAGE, extras, requirements=requirements)
