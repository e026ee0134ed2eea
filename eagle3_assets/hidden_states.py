"""``hidden_states``: per shard, the target's features that EAGLE-3 trains on.

Runs the ``extract_hidden_states`` stage on the GPU host (after its
pre-flight) over ``<data>/validated_traces/<shard>.parquet`` and writes
``<data>/hidden_states/<shard>/``: ``part-NNNNN.safetensors`` files (aux states
at the target's layer ids in vLLM's convention, the final state, input ids,
loss mask, per-sample offsets) and ``metadata.json``, written last. See
:mod:`eagle3_assets.core.extraction.shard_extraction` for the format and the backends.

The gates are computed on the GPU host, next to the files, and come back
through Pipes; all four block everything downstream (training) of a shard
whose states are not finite, not the traces' samples, not what the target's
``lm_head`` consumes, or not from the layers the sidecar names.

``validated_traces`` is referenced by key, not imported, so this module does
not depend on how validation is implemented.
"""

from dagster import (
    AssetExecutionContext,
    AssetKey,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from eagle3_assets.capacity_plan import refuse_unless_run_fits
from eagle3_assets.check_results import Gate, Gates
from eagle3_assets.core.reporting.checks import CheckOutcome
from eagle3_assets.core.extraction.needs import EXTRACTION_MODULES, EXTRACTION_STAGE, TRACES, disk_estimate
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements, with_serving_need
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.gpu_host.stage_jobs import ExtractionJob, StageTarget, shard_check_seed
from eagle3_assets.core.extraction.state_layout import BACKENDS, STORAGE_DTYPE_BYTES
from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.lineage import states_lineage
from eagle3_assets.partitions import sample_shards
from eagle3_assets.stage_configs import HiddenStatesConfig
from resources.gpu_host import GPU_POOL, GPUHost, register_stage
from resources.target_model import TargetModel

ASSET = "hidden_states"
UPSTREAM = TRACES
STAGE = EXTRACTION_STAGE
EXTRACTION_REQUIREMENTS = register_stage(STAGE, StageRequirements(modules=EXTRACTION_MODULES, output_dirs=[ASSET]))

# Computed on the GPU host, next to the files; all block training on a shard whose states are wrong.
GATES = Gates(
    ASSET,
    [
        Gate(
            "target_matches_traces", True,
            "the model that extracts is the one whose tokenizer and template rendered the traces (same config "
            "hash); compared before extraction, so a wrong target costs no GPU time",
        ),
        Gate("states_finite", True, "no NaN or Inf in any stored state"),
        Gate("states_match_traces", True, "exactly the validated traces' ids, each with the same tokens, token count and loss mask"),
        Gate(
            "final_state_reproduces_logits", True,
            "the target's lm_head on the stored final states (normed when pre-norm) gives the argmax "
            "of the target's own forward pass on at least min_argmax_agreement of sampled positions (a flip between two "
            "logits closer than the storage dtype can resolve counts as a tie)",
        ),
        Gate(
            "aux_states_match_layer_ids", True,
            "the sidecar's layer ids are the target's configured ids (vLLM's convention), and the stored "
            "aux states are the states at those ids (checked against a transformers forward where one runs)",
        ),
    ],
)  # fmt: skip


@asset(
    partitions_def=sample_shards,
    group_name="extraction",
    code_version="1",
    kinds={"pytorch", "safetensors"},
    pool=GPU_POOL,
    deps=[AssetKey(UPSTREAM)],
    check_specs=GATES.specs(),
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
    refuse_unless_run_fits(context, target_model, config.dtype, gpu_host)  # the whole run, before this shard's
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
        **config.model_dump(),
    )
    disk_bytes, disk_note = disk_estimate(key, target_model.hidden_size(), config.dtype)
    context.log.info(f"{key}: the shard's hidden states will take {disk_note}; the pre-flight checks the GPU host can hold them")
    requirements = StageRequirements(
        modules=EXTRACTION_MODULES + (["vllm"] if config.backend == "vllm" else []),
        output_dirs=[ASSET],
        disk_bytes=disk_bytes,
        disk_note=f"offline mode, the states stay on disk: {disk_note}",  # bounded mode: draft_checkpoint_bounded.py
    )
    if config.backend == "vllm":  # the engine serves the target as its profile says: its GPUs and memory, checked first
        requirements = with_serving_need(requirements, target_model.gpu_need())
    context.log.info(f"{key}: extracting hidden states at layer ids {layer_ids} with the {config.backend} backend into {output}")
    invocation = gpu_host.run_stage(context, STAGE, job.model_dump(), requirements=requirements)
    reported = invocation.get_materialize_result()

    metadata = dict(reported.metadata or {})
    returned = {result.check_name: result for result in reported.check_results or []}
    missing = sorted(set(GATES.names) - set(returned))
    if missing:
        raise RuntimeError(f"stage {STAGE} reported no result for the checks {missing}")
    check_results = []
    for name in GATES.names:
        outcome = CheckOutcome.from_pipes(name, returned[name].passed, dict(returned[name].metadata or {}))
        check_results.append(GATES.result(outcome))
        if not outcome.passed:
            context.log.error(f"{key}: {name} failed: {outcome.description}")
    metadata["data_version_inputs"] = MetadataValue.json(lineage)
    return MaterializeResult(data_version=DataVersion(version), metadata=metadata, check_results=check_results)
