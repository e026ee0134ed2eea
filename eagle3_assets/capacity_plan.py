"""``capacity_plan``: what the whole run of the registered shards needs of disk and GPU time, before the work and as shards finish.

An unpartitioned asset (group ``planning``) with one check, ``run_fits``
(ERROR when a volume cannot hold what the rest of the run writes there), a
job ``plan_capacity`` that materialises it, and a sensor
(``sensors/capacity_plan_refresh.py``) that runs the job again when shards finish, so the
measured rates and the ETA follow the backfill. The figures and the rules are
in :mod:`eagle3_assets.core.planning.capacity`; this module gathers the
facts: each registered shard's prompts, validated tokens, generated tokens
and bytes on disk, the rates the shards' materialisations measured, the free
space of the data volume and of the GPU host.

``hidden_states`` calls :func:`refuse_unless_run_fits` before each shard: the
states of every registered shard not yet extracted, against the GPU host's free
space; a run that cannot fit stops before its first shard, naming both numbers
and the ways out (8-bit storage, bounded-disk training, fewer shards).
"""

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    Config,
    DagsterInstance,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
    define_asset_job,
)
from pydantic import Field

from eagle3_assets.core.extraction.needs import TRACES, shard_tokens
from eagle3_assets.core.extraction.state_layout import DEFAULT_DTYPE, STORAGE_DTYPE_BYTES
from eagle3_assets.core.gpu_host.remote import HostError
from eagle3_assets.core.planning.capacity import CapacityPlan, PlanSettings, ShardFacts, Volume, plan_capacity
from eagle3_assets.core.planning.stage_rates import Rate, estimated_training_rate, first_rate, measured_rate
from eagle3_assets.core.storage.shard_files import ShardFileError, read_shard_parquet
from eagle3_assets.core.storage.shard_paths import ShardPaths, data_dir
from eagle3_assets.partitions import SAMPLE_SHARDS
from eagle3_assets.shard_status import PAGE, records_filter
from resources.gpu_host import GPUHost
from resources.prompt_dataset import PromptDataset
from resources.target_model import TargetModel

ASSET = "capacity_plan"
# The story's GPU: an H200's bf16 matrix product measured 790 TFLOP/s, and the training step reached 0.34 of it
# at Kimi width, depth 7 (issue training-at-scale; docs/performance.md P13).
DEFAULT_DEVICE_TFLOPS = 790.0
DEFAULT_TRAINING_FLOP_SHARE = 0.34

# Free bytes and the device of the nearest existing directory of a path, run by an SSH GPU host's own Python
# (volume_at reads the same figures in process for a local one).
_FREE_SPACE = (
    "import json, os, shutil, sys\n"
    "p = os.path.abspath(sys.argv[1])\n"
    "while not os.path.exists(p): p = os.path.dirname(p)\n"
    "print(json.dumps({'path': p, 'free': shutil.disk_usage(p).free, 'device': os.stat(p).st_dev}))\n"
)


class CapacityPlanConfig(Config):
    """What the plan cannot measure before the first shards, and the run's shape."""

    dtype: str = Field(default=DEFAULT_DTYPE, description=f"hidden_states' storage precision ({', '.join(STORAGE_DTYPE_BYTES)})")
    sample_tokens: Optional[float] = Field(
        default=None, description="mean tokens of one validated trace per prompt, until a shard is validated (then measured)"
    )
    completion_tokens: Optional[float] = Field(
        default=None, description="mean tokens the target generates per prompt, until a shard is generated (then measured)"
    )
    responses_bytes_per_token: Optional[float] = Field(
        default=None, description="bytes of raw responses and validated traces per token; unset: measured on the shards written"
    )
    epochs: Optional[int] = Field(default=None, gt=0, description="training epochs; unset: the schedule fitted to the projected tokens (10 for a large run)")
    ttt_steps: int = Field(default=7, gt=0, description="training-time-test depth, for the training's FLOPs per token")
    draft_vocab_size: int = Field(default=32000, gt=0, description="the draft vocabulary, for its size and FLOPs")
    window_shards: int = Field(default=2, gt=0, description="bounded-disk mode's window, for the way-out figure")
    generation_tokens_per_s: Optional[float] = Field(default=None, description="output tokens/s of the vLLM server; unset: measured by raw_responses")
    extraction_tokens_per_s: Optional[float] = Field(default=None, description="tokens/s per GPU of the extraction; unset: measured by hidden_states")
    training_tokens_per_s: Optional[float] = Field(
        default=None, description="tokens/s per GPU of training at the target's width; unset: measured by a draft_checkpoint of this target, else estimated"
    )
    device_tflops: float = Field(default=DEFAULT_DEVICE_TFLOPS, gt=0, description="the GPU's bf16 matrix-product TFLOP/s, for the estimated training rate")
    training_flop_share: float = Field(
        default=DEFAULT_TRAINING_FLOP_SHARE, gt=0, le=1, description="the share of it the training step reaches, for the estimated training rate"
    )
    generation_gpus: int = Field(default=8, gt=0, description="GPUs the vLLM server holds while it generates (the story's: 8, tensor-parallel)")
    extraction_gpus: int = Field(default=1, gt=0, description="GPUs extracting at once")
    training_gpus: int = Field(default=1, gt=0, description="GPUs training (nproc_per_node)")


# -- facts


def volume_at(name: str, path: str, gpu_host: GPUHost | None = None) -> Volume:
    """The free space at ``path``: on this machine, or on the GPU host through its Python (an ssh host)."""
    try:
        if gpu_host is None or gpu_host.mode == "local":
            p = Path(path).resolve()
            while not p.exists():
                p = p.parent
            return Volume(name, str(path), shutil.disk_usage(p).free, device=f"local:{os.stat(p).st_dev}")
        done = gpu_host.connection().run([gpu_host.python, "-c", _FREE_SPACE, path], timeout_s=gpu_host.preflight_timeout_s)
        report = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None
        if not isinstance(report, dict):
            return Volume(name, path, None, note=f"the host's python did not answer (exit {done.returncode}): {done.stderr.strip()[-200:]}")
        return Volume(name, path, int(report["free"]), device=f"{gpu_host.connection().label}:{report['device']}")
    except (OSError, HostError, ValueError, KeyError) as exc:
        return Volume(name, path, None, note=str(exc))


def latest_metadata(instance: DagsterInstance, asset: str, keys: list[str]) -> dict[str, dict]:
    """Shard -> the metadata of its latest materialisation of ``asset`` (plain values)."""
    found: dict[str, dict] = {}
    wanted = set(keys)
    cursor = None
    while wanted:
        page = instance.fetch_materializations(records_filter(asset, keys), limit=PAGE, cursor=cursor)
        for record in page.records:
            key = record.partition_key
            if key in wanted and key not in found and record.asset_materialization is not None:
                found[key] = {k: getattr(v, "value", v) for k, v in record.asset_materialization.metadata.items()}
        if not page.has_more or len(found) == len(wanted):
            break
        cursor = page.cursor
    return found


def _column_sum(asset: str, key: str, column: str) -> int | None:
    path = ShardPaths(asset, key).parquet
    if not path.is_file():
        return None
    try:
        return int(read_shard_parquet(path, asset=asset, shard=key, columns=[column])[column].sum() or 0)
    except ShardFileError:
        return None  # a damaged file is its own stage's error to name; the plan counts the shard from its prompts


def _validated_tokens(key: str) -> int | None:
    """The shard's validated token count; None when its traces are missing or damaged (then its prompts count)."""
    try:
        return shard_tokens(key)
    except ShardFileError:
        return None


def _files_bytes(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def shard_facts(keys: list[str], prompts: dict[str, int], states: dict[str, dict], responses: bool = True) -> list[ShardFacts]:
    """What is done of each shard, read from its files here (and the states' size from their materialisation when they live on the GPU host).

    ``responses=False`` leaves out what only the full plan needs (generated tokens, the responses' bytes): one file read per shard less.
    """
    facts = []
    for key in keys:
        tokens = _validated_tokens(key)
        written = None
        if tokens is not None and responses:
            traces = ShardPaths(TRACES, key).parquet
            written = _files_bytes(ShardPaths("raw_responses", key).parquet, traces, traces.with_name(f"{key}.rejected.parquet"))
        state_dir = ShardPaths("hidden_states", key)
        if state_dir.sidecar.is_file():
            states_bytes = sum(f.stat().st_size for f in state_dir.directory.iterdir() if f.is_file())
        else:
            states_bytes = states.get(key, {}).get("bytes")
        facts.append(
            ShardFacts(
                key=key,
                prompts=prompts.get(key, 0),
                validated_tokens=tokens,
                completion_tokens=_column_sum("raw_responses", key, "completion_tokens") if responses else None,
                responses_bytes=written,
                states_bytes=int(states_bytes) if states_bytes is not None else None,
            )
        )
    return facts


def prompts_from_files(keys: list[str]) -> dict[str, int]:
    """Prompts per shard from the ``prompts`` files here; a shard not yet read counts as the largest shard seen (a full one)."""
    counts = {}
    for key in keys:
        path = ShardPaths("prompts", key).parquet
        if path.is_file():
            counts[key] = read_shard_parquet(path, asset="prompts", shard=key, columns=["id"]).height
    full = max(counts.values(), default=0)
    return {key: counts.get(key, full) for key in keys}


def measured_rates(instance: DagsterInstance, keys: list[str], states: dict[str, dict]) -> dict[str, Rate | None]:
    """Generation's output tokens/s and extraction's tokens/s over the shards' latest materialisations."""
    generation = latest_metadata(instance, "raw_responses", keys)
    gen = [
        (float(m["output_tokens_per_s"]) * float(m["generation_wall_s"]), float(m["generation_wall_s"]))
        for m in generation.values()
        if m.get("output_tokens_per_s") and m.get("generation_wall_s")
    ]
    ext = []
    for m in states.values():
        if m.get("tokens_per_s") and m.get("bytes") and m.get("bytes_per_token"):
            tokens = float(m["bytes"]) / float(m["bytes_per_token"])
            ext.append((tokens, tokens / float(m["tokens_per_s"])))
    return {"generation": measured_rate(gen, "raw_responses"), "extraction": measured_rate(ext, "hidden_states")}


def measured_training_rate(instance: DagsterInstance, target_hash: str) -> Rate | None:
    """Tokens/s per GPU of the latest draft_checkpoint trained on this target (its width), when there is one."""
    event = instance.get_latest_materialization_event(AssetKey("draft_checkpoint"))
    if event is None or event.asset_materialization is None:
        return None
    metadata = {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}
    target = metadata.get("target") or {}
    rate = metadata.get("train_tokens_per_s") or metadata.get("tokens_per_s")
    if not rate or target.get("config_hash") != target_hash:
        return None
    world = int(metadata.get("world_size") or 1)
    return Rate(float(rate) / world, f"measured by the latest draft_checkpoint of this target ({world} GPU(s))")


def draft_parameters_and_flops(target_model: TargetModel, config: CapacityPlanConfig) -> tuple[int, float]:
    """The draft's trainable parameters and its training step's FLOPs per token, at the target's width."""
    # Here, not at the top: they import torch, which the run worker of every other asset does not need.
    from eagle3_assets.core.draft.model import DraftConfig
    from eagle3_assets.core.training.memory import StepShape
    from eagle3_assets.core.training.throughput import shape_of_target, step_flops

    text = target_model.text_config()
    draft = DraftConfig.for_target(text, min(config.draft_vocab_size, int(text["vocab_size"])), target_model.layer_ids())
    parameters = StepShape.of(draft, tokens=1, seq_len=1, ttt_steps=config.ttt_steps, bf16=True).trainable_parameters
    shape = shape_of_target(str(target_model.resolved_path()), draft_vocab=config.draft_vocab_size)
    return parameters, step_flops(shape, config.ttt_steps)


# -- the plan


def make_plan(
    context: AssetExecutionContext, config: CapacityPlanConfig, target_model: TargetModel, gpu_host: GPUHost, prompt_dataset: PromptDataset
) -> CapacityPlan:
    instance = context.instance
    keys = sorted(instance.get_dynamic_partitions(SAMPLE_SHARDS))
    states = latest_metadata(instance, "hidden_states", keys) if keys else {}
    facts = shard_facts(keys, prompt_dataset.shard_rows(keys), states)
    measured = measured_rates(instance, keys, states) if keys else {"generation": None, "extraction": None}
    parameters, flops = draft_parameters_and_flops(target_model, config)
    configured = lambda value: Rate(value, "configured") if value else None  # noqa: E731
    rates = {
        "generation": first_rate(configured(config.generation_tokens_per_s), measured["generation"], missing="unknown until a shard is generated (or configure generation_tokens_per_s)"),
        "extraction": first_rate(configured(config.extraction_tokens_per_s), measured["extraction"], missing="unknown until a shard is extracted (or configure extraction_tokens_per_s)"),
        "training": first_rate(
            configured(config.training_tokens_per_s),
            measured_training_rate(instance, target_model.config_hash()),
            estimated_training_rate(flops, config.device_tflops, config.training_flop_share),
            missing="unknown",
        ),
    }  # fmt: skip
    settings = PlanSettings(
        hidden_size=target_model.hidden_size(),
        dtype=config.dtype,
        sample_tokens=config.sample_tokens,
        completion_tokens=config.completion_tokens,
        responses_bytes_per_token=config.responses_bytes_per_token,
        draft_parameters=parameters,
        epochs=config.epochs,
        window_shards=config.window_shards,
        generation_gpus=config.generation_gpus,
        extraction_gpus=config.extraction_gpus,
        training_gpus=config.training_gpus,
    )
    gpu_volume = volume_at("GPU host", os.path.join(gpu_host.host_data_dir(), "hidden_states"), gpu_host)
    data_volume = volume_at("data volume", str(data_dir()))
    return plan_capacity(facts, settings, gpu_volume, data_volume, rates)


@asset(
    group_name="planning",
    code_version="1",
    kinds={"python"},
    check_specs=[
        AssetCheckSpec(
            "run_fits",
            asset=ASSET,
            description="the data volume and the GPU host's have room for what the rest of the registered shards' run writes "
            "(hidden states, raw responses and traces, checkpoints)",
        )
    ],
)
def capacity_plan(
    context: AssetExecutionContext, config: CapacityPlanConfig, target_model: TargetModel, gpu_host: GPUHost, prompt_dataset: PromptDataset
) -> MaterializeResult:
    """The whole run of the registered shards: bytes of hidden states, responses and checkpoints against free space, GPU-hours and an ETA."""
    if config.dtype not in STORAGE_DTYPE_BYTES:
        raise ValueError(f"capacity_plan config dtype {config.dtype!r}: one of {sorted(STORAGE_DTYPE_BYTES)}")
    plan = make_plan(context, config, target_model, gpu_host, prompt_dataset)
    for need in plan.needs:
        (context.log.info if need.fits is not False else context.log.error)(need.describe())
    context.log.info(f"ETA: {plan.eta()}")
    figures = plan.as_metadata()
    refusal = plan.states_refusal()
    short = [need.describe() for need in plan.needs if need.fits is False]
    if short:
        verdict, severity, description = False, AssetCheckSeverity.ERROR, refusal or "; ".join(short)
    elif not plan.projected:
        # Nothing to project from yet: said as a warning, not as a pass.
        verdict, severity = False, AssetCheckSeverity.WARN
        description = "cannot project the run: no shard is validated yet; validate one, or configure sample_tokens"
    else:
        verdict, severity, description = True, AssetCheckSeverity.ERROR, None
    return MaterializeResult(
        metadata={
            "plan": MetadataValue.md(plan.markdown()),
            **{k: MetadataValue.json(v) if isinstance(v, (dict, list)) else v for k, v in figures.items() if v is not None},
        },
        check_results=[
            AssetCheckResult(
                check_name="run_fits",
                passed=verdict,
                severity=severity,
                description=description,
                metadata={
                    "volumes": MetadataValue.json(figures["volumes"]),
                    "hidden_states_bytes_to_write_8bit": plan.states_to_write_8bit,
                    "bounded_window_bytes": plan.bounded_window_bytes,
                },
            )
        ],
    )


plan_capacity_job = define_asset_job("plan_capacity", selection=[ASSET], description="Project the whole run: disk, GPU-hours, ETA")


# -- hidden_states' refusal


def refuse_unless_run_fits(context: AssetExecutionContext, target_model: TargetModel, dtype: str, gpu_host: GPUHost) -> None:
    """Before a shard's extraction: refuse when the GPU host cannot hold the states of every registered shard still to extract.

    The states are nearly all of what the run writes there (checkpoints are a
    few GB beside terabytes); the whole plan, checkpoints and the data volume
    included, is the ``capacity_plan`` asset's.
    """
    keys = sorted(context.instance.get_dynamic_partitions(SAMPLE_SHARDS))
    states = latest_metadata(context.instance, "hidden_states", keys)
    facts = shard_facts(keys, prompts_from_files(keys), states, responses=False)
    volume = volume_at("GPU host", os.path.join(gpu_host.host_data_dir(), "hidden_states"), gpu_host)
    unknown = Rate(None, "not needed for the refusal")
    plan = plan_capacity(
        facts,
        PlanSettings(hidden_size=target_model.hidden_size(), dtype=dtype),
        volume,
        Volume("data volume", str(data_dir()), None, note="not part of this check"),
        {"generation": unknown, "extraction": unknown, "training": unknown},
    )
    refusal = plan.states_refusal()
    shards = _partitions(context)
    if refusal:
        raise Failure(description=f"hidden_states {shards}: {refusal}", allow_retries=False)
    context.log.info(f"{shards}: the run's remaining hidden states fit: {plan.needs[0].describe()}")


def _partitions(context: AssetExecutionContext) -> str:
    """The run's shard, or its first and last (a run of several shards)."""
    if context.has_partition_key_range:
        span = context.partition_key_range
        if span.start != span.end:
            return f"{span.start}..{span.end}"
    return context.partition_key
