"""``capacity_plan``: what the whole run of the registered shards needs of disk and GPU time, before the work and as shards finish.

An unpartitioned asset (group ``planning``) with one check, ``run_fits``
(declared in :mod:`eagle3_assets.core.planning.gates`: ERROR when a volume cannot hold what the rest of the run writes there, or
when its free bytes cannot be read and ``accept_unknown_capacity`` is not set;
with it set, passed with the risk in its description and metadata), a
job ``plan_capacity`` that materialises it, and a sensor
(``sensors/capacity_plan_refresh.py``) that runs the job again when shards finish, so the
measured rates and the ETA follow the backfill. The figures and the rules are
in :mod:`eagle3_assets.core.planning.capacity`; this module gathers the
facts (each registered shard's prompts, validated tokens, generated tokens
and bytes on disk, the rates the shards' materialisations measured, the free
space of the data volume and of the GPU host) and makes the plan.

The facts are read by :mod:`eagle3_assets.glue.capacity_facts`, which
``hidden_states`` also calls before a run (:func:`~eagle3_assets.glue.capacity_facts.refuse_unless_run_fits`).
"""

import os
from dataclasses import replace
from typing import Optional

from dagster import (
    AssetExecutionContext,
    Config,
    MaterializeResult,
    MetadataValue,
    asset,
    define_asset_job,
)
from pydantic import Field

from eagle3_assets.glue.capacity_facts import latest_metadata, measured_rates, measured_training_rate, shard_facts, volume_at
from eagle3_assets.core.extraction.state_layout import DEFAULT_DTYPE, STORAGE_DTYPE_BYTES
from eagle3_assets.core.planning.capacity import CapacityPlan, PlanSettings, plan_capacity, plan_nodes
from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.planning.gates import CAPACITY_GATES, check_run_fits
from eagle3_assets.core.planning.stage_rates import Rate, estimated_training_rate, first_rate
from eagle3_assets.core.settings.environment import ACCEPT_UNKNOWN_CAPACITY, EXTRACTION_SHARDS_PER_RUN
from eagle3_assets.core.storage.shard_paths import data_dir
from eagle3_assets.glue.partitions import SAMPLE_SHARDS
from resources.gpu_host import GPUHost
from resources.prompt_dataset import PromptDataset
from resources.target_model import TargetModel

ASSET = "capacity_plan"
CHECKS = AssetChecks(CAPACITY_GATES)  # the declared gate as this asset's check
# The story's GPU: an H200's bf16 matrix product measured 790 TFLOP/s, and the training step reached 0.34 of it
# at Kimi width, depth 7 (issue training-at-scale; docs/performance.md P13).
DEFAULT_DEVICE_TFLOPS = 790.0
DEFAULT_TRAINING_FLOP_SHARE = 0.34


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
    training_gpus: int = Field(default=1, gt=0, description="GPUs training per node (nproc_per_node)")
    nodes: Optional[int] = Field(
        default=None,
        gt=0,
        description="nodes of a Ray cluster GPU host: extraction's engines (one per node) and, unless training_nodes is set, the "
        "training's nodes; unset: gpu_host.ray_engines when the host is a Ray cluster and it is set, else 1 (the plan does not ask the cluster)",
    )
    training_nodes: Optional[int] = Field(
        default=None, gt=0, description="nodes training (draft_checkpoint's nnodes; DDP scaling across them assumed); unset: nodes"
    )
    target_load_s: Optional[float] = Field(
        default=None,
        ge=0,
        description="seconds one extraction engine takes to load the target, paid per engine per run of $EAGLE3_EXTRACTION_SHARDS_PER_RUN "
        "shards (each build's load_s is in <data>/hidden_states/engine_builds.jsonl); unset: not counted",
    )
    accept_unknown_capacity: bool = Field(
        default=ACCEPT_UNKNOWN_CAPACITY.get(),
        description="a volume whose free bytes cannot be read passes run_fits, the risk stated in the check, instead of failing it "
        f"(default: ${ACCEPT_UNKNOWN_CAPACITY.name})",
    )


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
    nodes, nodes_note = plan_nodes(config.nodes, gpu_host.mode, gpu_host.ray_engines)
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
        nodes=nodes,
        training_nodes=config.training_nodes,
        target_load_s=config.target_load_s,
        shards_per_run=EXTRACTION_SHARDS_PER_RUN.get(),
        accept_unknown_capacity=config.accept_unknown_capacity,
    )
    gpu_volume = volume_at("GPU host", os.path.join(gpu_host.host_data_dir(), "hidden_states"), gpu_host)
    data_volume = volume_at("data volume", str(data_dir()))
    plan = plan_capacity(facts, settings, gpu_volume, data_volume, rates)
    return replace(plan, assumed=[nodes_note, *plan.assumed]) if nodes_note else plan


@asset(
    group_name="planning",
    code_version="1",
    kinds={"python"},
    check_specs=CHECKS.specs(),
)
def capacity_plan(
    context: AssetExecutionContext, config: CapacityPlanConfig, target_model: TargetModel, gpu_host: GPUHost, prompt_dataset: PromptDataset
) -> MaterializeResult:
    """The whole run of the registered shards: bytes of hidden states, responses and checkpoints against free space, GPU-hours and an ETA."""
    if config.dtype not in STORAGE_DTYPE_BYTES:
        raise ValueError(f"capacity_plan config dtype {config.dtype!r}: one of {sorted(STORAGE_DTYPE_BYTES)}")
    plan = make_plan(context, config, target_model, gpu_host, prompt_dataset)
    for need in plan.needs:
        {True: context.log.info, False: context.log.error, None: context.log.warning}[need.fits](need.describe())
    context.log.info(f"ETA: {plan.eta()}")
    figures = plan.as_metadata()
    return MaterializeResult(
        metadata={
            "plan": MetadataValue.md(plan.markdown()),
            **{k: MetadataValue.json(v) if isinstance(v, (dict, list)) else v for k, v in figures.items() if v is not None},
        },
        check_results=[CHECKS.result(check_run_fits(plan))],
    )


plan_capacity_job = define_asset_job("plan_capacity", selection=[ASSET], description="Project the whole run: disk, GPU-hours, ETA")
