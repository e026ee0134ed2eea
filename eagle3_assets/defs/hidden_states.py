"""``hidden_states``: per shard, the target's features that EAGLE-3 trains on; one run loads the target once for many shards.

Runs the ``extract_hidden_states`` stage on the GPU host (after its
pre-flight) over ``<data>/validated_traces/<shard>.parquet`` and writes
``<data>/hidden_states/<shard>/``: ``part-NNNNN.safetensors`` files (aux states
at the target's layer ids in vLLM's convention, the final state, input ids,
loss mask, per-sample offsets), ``metadata.json`` (the sidecar) and
``extraction.json`` (the stage's record of the finished shard), written last.
See :mod:`eagle3_assets.core.extraction.shard_extraction` for the format and the backends.

A backfill makes runs over ranges of at most ``$EAGLE3_EXTRACTION_SHARDS_PER_RUN``
shards (a single shard from the UI is a range of one). Each run sends one job
listing its shards: the stage builds the engine once (loading a 1T target takes
hours) and reports each shard the moment it is done, which becomes that
partition's materialisation and gate results at once
(:class:`eagle3_assets.glue.shard_runs.ShardReporter`). A crash part-way keeps the
finished shards; the rerun reports them as stored and extracts only the rest,
and builds no engine when none is left.

The gates (declared in core beside their checks,
:data:`eagle3_assets.core.extraction.gates.HIDDEN_STATE_GATES`) are computed on the
GPU host, next to the files; all five block everything downstream (training)
of a shard whose states are not finite, not the traces' samples, not what the
target's ``lm_head`` consumes, not from the layers the sidecar names, or not
from the target that rendered the traces.
A shard that fails one is named when the run fails, after the others are recorded.

``validated_traces`` is referenced by key, not imported, so this module does
not depend on how validation is implemented.
"""

from collections.abc import Mapping
from typing import Any

from dagster import AssetExecutionContext, AssetKey, AssetSpec, MetadataValue, multi_asset

from eagle3_assets.glue.capacity_facts import refuse_unless_run_fits
from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.extraction.gates import HIDDEN_STATE_GATES
from eagle3_assets.core.extraction.needs import EXTRACTION_MODULES, EXTRACTION_STAGE, TRACES, disk_estimate
from eagle3_assets.core.extraction.backends import EXTRACTION_BACKENDS, extraction_backend, extraction_modules
from eagle3_assets.core.extraction.state_layout import STORAGE_DTYPE_BYTES
from eagle3_assets.core.extraction.job import EXTRACTION_SHARD_MESSAGE, ExtractionJob, ExtractionShard, shard_check_seed, StageTarget
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements, with_serving_need
from eagle3_assets.core.reporting.checks import CheckOutcome
from eagle3_assets.core.settings.environment import EXTRACTION_SHARDS_PER_RUN
from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.core.storage.shard_files import ShardFileError
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.glue.lineage import states_lineage
from eagle3_assets.glue.partitions import sample_shards
from eagle3_assets.glue.shard_runs import ShardReporter, shards_per_run_policy
from eagle3_assets.glue.stage_configs import HiddenStatesConfig
from resources.gpu_host import GPU_POOL, GPUHost, register_stage
from resources.target_model import TargetModel

ASSET = "hidden_states"
UPSTREAM = TRACES
STAGE = EXTRACTION_STAGE
CODE_VERSION = "1"
CHECKS = AssetChecks(HIDDEN_STATE_GATES)  # the declared gates as this asset's checks
SHARDS_PER_RUN = EXTRACTION_SHARDS_PER_RUN.get()  # read once, when the definitions load
# serves_target: the vLLM backend, the scale path, starts the target as its profile says.
EXTRACTION_REQUIREMENTS = register_stage(STAGE, StageRequirements(modules=EXTRACTION_MODULES, output_dirs=[ASSET], serves_target=True))

@multi_asset(
    name=ASSET,
    specs=[
        AssetSpec(
            ASSET,
            partitions_def=sample_shards,
            deps=[AssetKey(UPSTREAM)],
            group_name="extraction",
            code_version=CODE_VERSION,
            kinds={"pytorch", "safetensors"},
            description="Per token of each validated trace: the target's 3 auxiliary hidden states and its final one, "
            "with input ids and loss mask (safetensors).",
        )
    ],
    check_specs=CHECKS.specs(),
    can_subset=True,
    backfill_policy=shards_per_run_policy(SHARDS_PER_RUN),
    pool=GPU_POOL,
)
def hidden_states(context: AssetExecutionContext, config: HiddenStatesConfig, target_model: TargetModel, gpu_host: GPUHost):
    """Every shard of the run from one engine on the GPU host, each reported as its own partition as soon as it is done."""
    if config.backend not in EXTRACTION_BACKENDS:
        raise ValueError(f"hidden_states config backend {config.backend!r}: one of {tuple(EXTRACTION_BACKENDS)}")
    if config.dtype not in STORAGE_DTYPE_BYTES:
        raise ValueError(f"hidden_states config dtype {config.dtype!r}: one of {sorted(STORAGE_DTYPE_BYTES)}")
    keys = list(context.partition_keys)  # the run's range of shards (one, from the UI)
    refuse_unless_run_fits(context, target_model, config.dtype, gpu_host, config.accept_unknown_capacity)  # the whole run, before its first shard
    layer_ids = target_model.layer_ids()
    lineages = {key: states_lineage(context, key, target_model, config.backend, config.dtype) for key in keys}
    job = ExtractionJob(
        shards=[
            ExtractionShard(
                shard=key,
                traces=ShardPaths.relative(UPSTREAM, key).parquet.as_posix(),
                output=ShardPaths.relative(ASSET, key).directory.as_posix(),
                data_version=stable_hash(lineages[key]),
                check_seed=shard_check_seed(key),
            )
            for key in keys
        ],
        target=StageTarget(**target_model.stage_extras()),
        **config.stage_settings(),
    )
    estimates = [_disk_estimate(key, target_model.hidden_size(), config.dtype) for key in keys]
    disk_bytes = sum(size for size, _ in estimates)
    context.log.info(
        f"the run's hidden states will take {disk_bytes} B; the pre-flight checks the GPU host can hold them:\n"
        + "\n".join(note for _, note in estimates)
    )
    requirements = StageRequirements(
        modules=extraction_modules(config.backend),
        output_dirs=[ASSET],
        disk_bytes=disk_bytes,
        disk_note="offline mode, the states stay on disk: "  # bounded mode: draft_checkpoint_bounded.py
        + (estimates[0][1] if len(keys) == 1 else f"{len(keys)} shards, {disk_bytes} B ({config.dtype}), the first {estimates[0][1]}"),
    )
    if extraction_backend(config.backend).serves_target:  # as the target's profile says: its GPUs and memory, checked first
        requirements = with_serving_need(requirements, target_model.gpu_need())
    context.log.info(
        f"{len(keys)} shard(s) ({keys[0]} .. {keys[-1]}): extracting hidden states at layer ids {layer_ids} with the "
        f"{config.backend} backend, one engine for the run"
    )
    reporter = ShardReporter(context, CHECKS, code_version=CODE_VERSION, upstream=[UPSTREAM])
    reported: set[str] = set()
    stopped: dict[str, str] = {}

    def on_shard(payload: Any, preflight: Mapping[str, Any]) -> None:
        if not isinstance(payload, dict) or payload.get("kind") != EXTRACTION_SHARD_MESSAGE:
            return
        shard = str(payload["shard"])
        if shard not in lineages:
            raise RuntimeError(f"stage {STAGE} reported shard {shard!r}, which this run did not ask for ({keys[0]} .. {keys[-1]})")
        reported.add(shard)
        if payload.get("stopped"):
            stopped[shard] = str(payload["stopped"])
            return
        checks = [CheckOutcome(c["name"], bool(c["passed"]), c.get("description") or "", dict(c.get("metadata") or {})) for c in payload["checks"]]
        missing = sorted(set(CHECKS.names) - {c.name for c in checks})
        if missing:
            stopped[shard] = f"stage {STAGE} reported no result for the checks {missing}"
            return
        metadata = {**shard_metadata(payload["metadata"]), **preflight, "data_version_inputs": MetadataValue.json(lineages[shard])}
        reporter.materialized(shard, metadata, str(payload["data_version"]))
        for name in reporter.checked(shard, checks):
            context.log.error(f"{shard}: {name} failed: {next(c.description for c in checks if c.name == name)}")

    try:
        gpu_host.run_stage(context, STAGE, job.model_dump(), requirements=requirements, on_custom_message=on_shard)
    except Exception:
        done = sorted(reported - set(stopped))
        context.log.error(
            f"the stage stopped after recording {len(done)} of {len(keys)} shard(s) ({', '.join(done) or 'none'}); "
            "a rerun of the same range reports those as stored and extracts only the rest"
        )
        raise
    reporter.reported_through_pipes()
    for key in keys:
        if key not in reported:
            stopped[key] = f"stage {STAGE} ended without reporting it"
    reporter.raise_for_blocked(stopped)
    yield from ()  # every result went through the reporter; a generator, so that Dagster yields its events


def _disk_estimate(key: str, hidden_size: int, dtype: str) -> tuple[int, str]:
    """A shard's estimate; damaged traces count nothing here: the stage stops that shard, naming the file, and does the others."""
    try:
        return disk_estimate(key, hidden_size, dtype)
    except ShardFileError as exc:
        return 0, f"{key}: no disk estimate ({exc})"


def shard_metadata(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's plain-JSON metadata of a shard as the UI shows it (its directory as a path, structures as JSON)."""
    metadata: dict[str, Any] = {}
    for name, value in raw.items():
        if name == "path":
            metadata[name] = MetadataValue.path(value)
        elif isinstance(value, (list, dict)):
            metadata[name] = MetadataValue.json(value)
        else:
            metadata[name] = value
    return metadata
