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
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    Config,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)
from dagster._core.definitions.data_version import extract_data_version_from_entry
from pydantic import Field

from eagle3_assets.core.state_layout import BACKENDS, DEFAULT_PART_BYTES, FP8_DTYPE, STORAGE_DTYPE_BYTES, bytes_per_token
from eagle3_assets.core.preflight import StageRequirements
from eagle3_assets.core.shard_files import read_shard_parquet
from eagle3_assets.core.storage import asset_dir, data_dir, file_hash, stable_hash
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
    """How a shard is extracted; every field is editable per run in the launchpad."""

    backend: str = Field(default="transformers", description=f"one of {BACKENDS}; 'vllm' for targets too large for transformers")
    dtype: str = Field(
        default="bfloat16",
        description=f"storage precision of the states, one of {sorted(STORAGE_DTYPE_BYTES)}; '{FP8_DTYPE}' stores 8-bit codes "
        "with a float32 scale per token and state: half the bytes of bfloat16, dequantised to float32 for training",
    )
    part_size_bytes: int = Field(default=DEFAULT_PART_BYTES, gt=0, description="a shard's states are split into files of at most this size")
    max_batch_tokens: int = Field(default=16384, gt=0, description="padded tokens per forward batch (transformers) or tokens per request chunk (vLLM)")
    max_batch_size: int = Field(default=64, gt=0, description="samples per forward batch (transformers)")
    cpu_threads: int = Field(default=0, ge=0, description="torch threads on a CPU host; 0: torch's default")
    vllm_dtype: str = Field(default="auto", description="vLLM backend: the engine's dtype")
    vllm_max_model_len: int = Field(default=0, ge=0, description="vLLM backend: max_model_len; 0: the longest trace + 1")
    vllm_tensor_parallel_size: int = Field(default=1, gt=0, description="vLLM backend: GPUs per engine")
    vllm_gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="vLLM backend: share of GPU memory for the engine")
    vllm_enforce_eager: Optional[bool] = Field(default=None, description="vLLM backend: no CUDA graphs; default: eager on CPU only")
    logits_check_samples: int = Field(default=8, gt=0, description="samples drawn for final_state_reproduces_logits")
    logits_check_positions: int = Field(default=4096, gt=0, description="at most this many positions compared over those samples")
    min_argmax_agreement: float = Field(default=0.999, ge=0, le=1, description="final_state_reproduces_logits passes at or above this share")
    aux_check_samples: int = Field(default=4, gt=0, description="samples drawn for aux_states_match_layer_ids")
    recompute: bool = Field(
        default=False, description="discard the shard's stored files and extract it again (a rerun otherwise keeps durable parts and re-checks them)"
    )
    aux_check_reference: str = Field(
        default="auto", description="'transformers' (a transformers forward), 'none' (sidecar only) or 'auto' (transformers unless backend is vllm)"
    )


def upstream_version(context: AssetExecutionContext, key: str) -> str:
    """The data version of this shard's ``validated_traces``, else a hash of its file (written outside Dagster)."""
    record = context.instance.get_latest_data_version_record(AssetKey(UPSTREAM), is_source=False, partition_key=key)
    version = extract_data_version_from_entry(record.event_log_entry) if record else None
    if version is not None:
        return version.value
    traces = data_dir() / UPSTREAM / f"{key}.parquet"
    return f"file:{file_hash(traces)}" if traces.is_file() else "unknown"


def shard_tokens(key: str) -> int | None:
    """Tokens of the shard's validated traces, or None when the traces are not on this machine."""
    traces = data_dir() / UPSTREAM / f"{key}.parquet"
    if not traces.is_file():
        return None
    return int(read_shard_parquet(traces, asset=UPSTREAM, shard=key, columns=["num_tokens"])["num_tokens"].sum() or 0)


def disk_estimate(key: str, hidden_size: int, dtype: str) -> tuple[int, str]:
    """The bytes the pre-flight must find free, and a line that says how they were counted."""
    tokens = shard_tokens(key)
    if tokens is None:
        return 0, f"{key}: traces not on this machine, no disk estimate"
    per_token = bytes_per_token(hidden_size, dtype)
    return tokens * per_token, f"{key}: {tokens} tokens x {per_token} B/token ({dtype}, H={hidden_size}) = {tokens * per_token} B"


def _value(entry):
    return getattr(entry, "value", entry)


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
    traces_file = data_dir() / UPSTREAM / f"{key}.parquet"
    if gpu_host.mode == "local" and not traces_file.is_file():
        raise FileNotFoundError(f"validated_traces for {key}: {traces_file} does not exist (materialise validated_traces for this shard first)")

    layer_ids = target_model.layer_ids()
    target_hash = target_model.config_hash()
    lineage = {
        UPSTREAM: upstream_version(context, key),
        "target_config_hash": target_hash,
        "aux_layer_ids": layer_ids,
        "backend": config.backend,
        "dtype": config.dtype,
    }
    version = stable_hash(lineage)
    output = asset_dir(ASSET) / key
    extras = {
        "shard": key,
        "traces": f"{UPSTREAM}/{key}.parquet",
        "output": f"{ASSET}/{key}",
        "target": target_model.stage_extras(),
        "backend": config.backend,
        "dtype": config.dtype,
        "part_bytes": config.part_size_bytes,
        "max_batch_tokens": config.max_batch_tokens,
        "max_batch_size": config.max_batch_size,
        "cpu_threads": config.cpu_threads,
        "recompute": config.recompute,
        "vllm": {
            "dtype": config.vllm_dtype,
            "max_model_len": config.vllm_max_model_len,
            "tensor_parallel_size": config.vllm_tensor_parallel_size,
            "gpu_memory_utilization": config.vllm_gpu_memory_utilization,
            "enforce_eager": config.vllm_enforce_eager,
        },
        "checks": {
            "logits_samples": config.logits_check_samples,
            "logits_positions": config.logits_check_positions,
            "min_argmax_agreement": config.min_argmax_agreement,
            "aux_samples": config.aux_check_samples,
            "aux_reference": config.aux_check_reference,
            "seed": int(stable_hash(key, 8), 16),
        },
        "data_version": version,
    }
    disk_bytes, disk_note = disk_estimate(key, target_model.hidden_size(), config.dtype)
    context.log.info(f"{key}: the shard's hidden states will take {disk_note}; the pre-flight checks the GPU host can hold them")
    requirements = StageRequirements(
        modules=STAGE_MODULES + (["vllm"] if config.backend == "vllm" else []),
        output_dirs=[ASSET],
        disk_bytes=disk_bytes,
        disk_note=f"offline mode, the states stay on disk: {disk_note}",  # bounded mode: draft_checkpoint_bounded.py
    )
    context.log.info(f"{key}: extracting hidden states at layer ids {layer_ids} with the {config.backend} backend into {output}")
    invocation = gpu_host.run_stage(context, STAGE, extras, requirements=requirements)
    reported = invocation.get_materialize_result()

    metadata = dict(reported.metadata or {})
    returned = {result.check_name: result for result in reported.check_results or []}
    missing = sorted(set(CHECKS) - set(returned))
    if missing:
        raise RuntimeError(f"stage {STAGE} reported no result for the checks {missing}")
    check_results = []
    for name in CHECKS:
        result = returned[name]
        check_metadata = {k: v for k, v in (result.metadata or {}).items() if k != "summary"}
        summary = (result.metadata or {}).get("summary")
        check_results.append(
            AssetCheckResult(
                check_name=name,
                passed=result.passed,
                severity=AssetCheckSeverity.ERROR,
                description=str(_value(summary)) if summary is not None else None,
                metadata=check_metadata,
            )
        )
        if not result.passed:
            context.log.error(f"{key}: {name} failed: {_value(summary)}")
    metadata["data_version_inputs"] = MetadataValue.json(lineage)
    return MaterializeResult(data_version=DataVersion(version), metadata=metadata, check_results=check_results)
