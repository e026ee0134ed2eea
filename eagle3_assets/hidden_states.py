"""``hidden_states``: per shard, the target's features that EAGLE-3 trains on.

Runs the ``extract_hidden_states`` stage on the GPU host (after its
pre-flight) over ``<data>/validated_traces/<shard>.parquet`` and writes
``<data>/hidden_states/<shard>/``: ``part-NNNNN.safetensors`` files (aux states
at the target's layer ids in vLLM's convention, the final state, input ids,
loss mask, per-sample offsets) and ``metadata.json``, written last. See
:mod:`eagle3_assets.core.extraction` for the format and the backends.

The gates are computed on the GPU host, next to the files, and come back
through Pipes; all four block everything downstream (training) of a shard
whose states are not finite, not the traces' samples, not what the target's
``lm_head`` consumes, or not from the layers the sidecar names.

``validated_traces`` is referenced by key, not imported, so this module does
not depend on how validation is implemented.
"""

from typing import Optional

from dagster import (
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    Config,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)
from dagster._core.definitions.data_version import extract_data_version_from_entry  # no public reader of the tag

from eagle3_assets.check_results import check_result
from eagle3_assets.config_fields import config_field, settings_of
from eagle3_assets.core.checks import CheckOutcome
from eagle3_assets.core.stage_requirements import StageRequirements
from eagle3_assets.core.shard_files import read_shard_parquet
from eagle3_assets.core.shard_paths import ShardPaths
from eagle3_assets.core.stage_jobs import ExtractionJob, StageTarget, shard_check_seed
from eagle3_assets.core.state_layout import BACKENDS, STORAGE_DTYPE_BYTES, bytes_per_token
from eagle3_assets.core.storage import file_hash, stable_hash
from eagle3_assets.partitions import sample_shards
from resources.gpu_host import GPU_POOL, GPUHost, register_stage
from resources.target_model import TargetModel

ASSET = "hidden_states"
UPSTREAM = "validated_traces"
STAGE = "extract_hidden_states"
STAGE_MODULES = ["torch", "transformers", "safetensors", "polars", "dagster_pipes"]
EXTRACTION_REQUIREMENTS = register_stage(STAGE, StageRequirements(modules=STAGE_MODULES, output_dirs=[ASSET]))

CHECKS = {
    "target_matches_traces": "the model that extracts is the one whose tokenizer and template rendered the traces (same config "
    "hash); compared before extraction, so a wrong target costs no GPU time",
    "states_finite": "no NaN or Inf in any stored state",
    "states_match_traces": "exactly the validated traces' ids, each with the same tokens, token count and loss mask",
    "final_state_reproduces_logits": "the target's lm_head on the stored final states (normed when pre-norm) gives the argmax "
    "of the target's own forward pass on at least min_argmax_agreement of sampled positions (a flip between two "
    "logits closer than the storage dtype can resolve counts as a tie)",
    "aux_states_match_layer_ids": "the sidecar's layer ids are the target's configured ids (vLLM's convention), and the stored "
    "aux states are the states at those ids (checked against a transformers forward where one runs)",
}


class HiddenStatesConfig(Config):
    """How a shard is extracted; every field is editable per run in the launchpad (defaults: ``ExtractionJob``)."""

    backend: str = config_field(ExtractionJob, "backend")
    dtype: str = config_field(ExtractionJob, "dtype")
    part_size_bytes: int = config_field(ExtractionJob, "part_size_bytes")
    max_batch_tokens: int = config_field(ExtractionJob, "max_batch_tokens")
    max_batch_size: int = config_field(ExtractionJob, "max_batch_size")
    cpu_threads: int = config_field(ExtractionJob, "cpu_threads")
    vllm_dtype: str = config_field(ExtractionJob, "vllm_dtype")
    vllm_max_model_len: int = config_field(ExtractionJob, "vllm_max_model_len")
    vllm_tensor_parallel_size: int = config_field(ExtractionJob, "vllm_tensor_parallel_size")
    vllm_gpu_memory_utilization: float = config_field(ExtractionJob, "vllm_gpu_memory_utilization")
    vllm_enforce_eager: Optional[bool] = config_field(ExtractionJob, "vllm_enforce_eager")
    logits_check_samples: int = config_field(ExtractionJob, "logits_check_samples")
    logits_check_positions: int = config_field(ExtractionJob, "logits_check_positions")
    min_argmax_agreement: float = config_field(ExtractionJob, "min_argmax_agreement")
    aux_check_samples: int = config_field(ExtractionJob, "aux_check_samples")
    recompute: bool = config_field(ExtractionJob, "recompute")
    aux_check_reference: str = config_field(ExtractionJob, "aux_check_reference")


def upstream_version(context: AssetExecutionContext, key: str) -> str:
    """The data version of this shard's ``validated_traces``, else a hash of its file (written outside Dagster)."""
    record = context.instance.get_latest_data_version_record(AssetKey(UPSTREAM), is_source=False, partition_key=key)
    version = extract_data_version_from_entry(record.event_log_entry) if record else None
    if version is not None:
        return version.value
    traces = ShardPaths(UPSTREAM, key).parquet
    return f"file:{file_hash(traces)}" if traces.is_file() else "unknown"


def shard_tokens(key: str) -> int | None:
    """Tokens of the shard's validated traces, or None when the traces are not on this machine."""
    traces = ShardPaths(UPSTREAM, key).parquet
    if not traces.is_file():
        return None
    return int(read_shard_parquet(traces, asset=UPSTREAM, shard=key, columns=["num_tokens"])["num_tokens"].sum() or 0)


def states_lineage(context: AssetExecutionContext, key: str, target_model: TargetModel, backend: str, dtype: str) -> dict:
    """What a shard's states are made of, hashed into their data version (bounded-disk mode records the same version)."""
    return {
        UPSTREAM: upstream_version(context, key),
        "target_config_hash": target_model.config_hash(),
        "aux_layer_ids": target_model.layer_ids(),
        "backend": backend,
        "dtype": dtype,
    }


def disk_estimate(key: str, hidden_size: int, dtype: str) -> tuple[int, str]:
    """The bytes the pre-flight must find free, and a line that says how they were counted."""
    tokens = shard_tokens(key)
    if tokens is None:
        return 0, f"{key}: traces not on this machine, no disk estimate"
    per_token = bytes_per_token(hidden_size, dtype)
    return tokens * per_token, f"{key}: {tokens} tokens x {per_token} B/token ({dtype}, H={hidden_size}) = {tokens * per_token} B"


@asset(
    partitions_def=sample_shards,
    group_name="extraction",
    code_version="1",
    kinds={"pytorch", "safetensors"},
    pool=GPU_POOL,
    deps=[AssetKey(UPSTREAM)],
    check_specs=[AssetCheckSpec(name, asset=ASSET, blocking=True, description=text) for name, text in CHECKS.items()],
)
def hidden_states(
    context: AssetExecutionContext, config: HiddenStatesConfig, target_model: TargetModel, gpu_host: GPUHost
) -> MaterializeResult:
    """Per token of each validated trace: the target's 3 auxiliary hidden states and its final one, with input ids and loss mask (safetensors)."""
    key = context.partition_key
    if config.backend not in BACKENDS:
        raise ValueError(f"hidden_states config backend {config.backend!r}: one of {BACKENDS}")
    if config.dtype not in STORAGE_DTYPE_BYTES:
        raise ValueError(f"hidden_states config dtype {config.dtype!r}: one of {sorted(STORAGE_DTYPE_BYTES)}")
    traces_file = ShardPaths(UPSTREAM, key).parquet
    if gpu_host.mode == "local" and not traces_file.is_file():
        raise FileNotFoundError(f"validated_traces for {key}: {traces_file} does not exist (materialise validated_traces for this shard first)")

    layer_ids = target_model.layer_ids()
    lineage = states_lineage(context, key, target_model, config.backend, config.dtype)
    version = stable_hash(lineage)
    output = ShardPaths(ASSET, key).directory
    job = ExtractionJob(
        shard=key,
        traces=ShardPaths.relative(UPSTREAM, key).parquet.as_posix(),
        output=ShardPaths.relative(ASSET, key).directory.as_posix(),
        target=StageTarget(**target_model.stage_extras()),
        data_version=version,
        check_seed=shard_check_seed(key),
        **settings_of(config, ExtractionJob),
    )
    disk_bytes, disk_note = disk_estimate(key, target_model.hidden_size(), config.dtype)
    context.log.info(f"{key}: the shard's hidden states will take {disk_note}; the pre-flight checks the GPU host can hold them")
    requirements = StageRequirements(
        modules=STAGE_MODULES + (["vllm"] if config.backend == "vllm" else []),
        output_dirs=[ASSET],
        disk_bytes=disk_bytes,
        disk_note=f"offline mode, the states stay on disk: {disk_note}",  # bounded mode: draft_checkpoint_bounded.py
    )
    context.log.info(f"{key}: extracting hidden states at layer ids {layer_ids} with the {config.backend} backend into {output}")
    invocation = gpu_host.run_stage(context, STAGE, job.to_dict(), requirements=requirements)
    reported = invocation.get_materialize_result()

    metadata = dict(reported.metadata or {})
    returned = {result.check_name: result for result in reported.check_results or []}
    missing = sorted(set(CHECKS) - set(returned))
    if missing:
        raise RuntimeError(f"stage {STAGE} reported no result for the checks {missing}")
    check_results = []
    for name in CHECKS:
        outcome = CheckOutcome.from_pipes(name, returned[name].passed, dict(returned[name].metadata or {}))
        check_results.append(check_result(outcome))
        if not outcome.passed:
            context.log.error(f"{key}: {name} failed: {outcome.description}")
    metadata["data_version_inputs"] = MetadataValue.json(lineage)
    return MaterializeResult(data_version=DataVersion(version), metadata=metadata, check_results=check_results)
