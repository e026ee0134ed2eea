"""``refinement_round``: one round of on-policy refinement of the served draft, re-materialised once per round.

Each materialisation is one round (stage ``refine_draft`` on the GPU host,
Dagster Pipes; :mod:`eagle3_assets.stages.refine_draft` says what it does):
it serves the target with the *current* draft on held-in prompts, keeps the
completions validated_traces' rules keep, extracts their states, replays the
draft on them (refused below 95 % agreement with the server, the share named),
trains from it and measures the refined draft against it on the held-out set,
through vLLM.

The current draft is the one the last round kept, or ``draft_checkpoint``'s
exported draft before the first round (and again whenever draft_checkpoint
exports another draft: :func:`~eagle3_assets.core.refinement.round.next_round`).
The metadata names it (``started_from``, ``start_draft``, its weights' hash)
and the draft the round keeps (``kept_draft``, ``kept_from``): the refined one
when ``refined_not_worse`` passes, else the draft it started from, so the next
round starts from that again. ``refined_not_worse`` is ERROR (blocking) when the
refined draft's held-out mean acceptance length is below the starting one's.

Files: ``<data>/refinement_round/round-<n>/`` per round; a failed
materialisation records nothing, so its rerun is the same round and resumes
from the files the first run finished. The numeric metadata (``acceptance_before``,
``acceptance_after``, ``replay_agreement``, ``rejections``) plots over the
rounds in the asset's page; ``rejections_where`` is where the round's rejections
fell, by position within the speculation and by output-position bucket.
"""

import json

from dagster import AssetExecutionContext, AssetKey, Config, DataVersion, MaterializeResult, MetadataValue, asset

from eagle3_assets.core.evaluation.acceptance import load_conversations
from eagle3_assets.core.extraction.job import StageTarget
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements, with_serving_need
from eagle3_assets.core.prompts.heldout import held_out_prompts
from eagle3_assets.core.refinement.job import RefinementJob, RefinementRecipe
from eagle3_assets.core.refinement.round import (
    ASSET, REFINEMENT_GATES, RoundPaths, check_refined_not_worse, held_in_rows, held_out_overlap, kept_draft, next_round,
)  # fmt: skip
from eagle3_assets.core.serving.deployment import draft_weights_hash
from eagle3_assets.core.settings.job_schema import values_of
from eagle3_assets.core.storage.files import asset_dir, write_bytes_atomic, write_parquet_atomic
from eagle3_assets.core.storage.shard_paths import DRAFT_CONFIG_FILE, SIDECAR, DatasetPaths, ShardPaths, training_shards
from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.glue.partitions import SAMPLE_SHARDS
from resources.gpu_host import GPU_POOL, GPUHost, register_stage
from resources.target_model import TargetModel

STAGE = "refine_draft"
CHECKS = AssetChecks(REFINEMENT_GATES)
REFINE_DRAFT_REQUIREMENTS = register_stage(
    STAGE,
    StageRequirements(modules=["vllm", "torch", "safetensors", "openai", "dagster_pipes"], output_dirs=[ASSET], serves_target=True),
)


class RefinementRoundConfig(RefinementRecipe, Config):
    """How the round serves, trains and judges (:class:`~eagle3_assets.core.refinement.job.RefinementRecipe`)."""


def round_eval_prompts(target_model: TargetModel, limit: int) -> list[tuple[str, list[dict]]]:
    """The held-out set the gate serves: the target's own where it comes with one, else the rows ``prompts`` held out."""
    builtin = target_model.builtin_eval_prompts()
    if builtin:
        ids, conversations = load_conversations(builtin)
        return list(zip(ids, conversations))[:limit]
    rows = held_out_prompts(asset_dir("prompts"), limit)
    if rows.is_empty():
        raise ValueError(
            f"{ASSET} has no held-out prompts to judge the refined draft on (prompt_dataset.holdout_share is 0, or no prompts "
            "shard is materialised): raise holdout_share and materialise prompts again"
        )
    return list(zip(rows["id"].to_list(), rows["messages"].to_list()))


def supervised_shards(context: AssetExecutionContext, share: float) -> list[str]:
    """The stored hidden_states shards whose samples the round mixes in (none needed at a share of 0)."""
    keys = context.instance.get_dynamic_partitions(SAMPLE_SHARDS)
    dirs = [str(ShardPaths("hidden_states", key).directory) for key in keys if ShardPaths("hidden_states", key).sidecar.is_file()]
    if share > 0 and not dirs:
        raise ValueError(
            f"{ASSET} supervised_share {share}: no stored hidden_states shard (no {SIDECAR} under {ShardPaths('hidden_states', 'x').asset_dir}) "
            "to mix in; materialise hidden_states, or set supervised_share to 0"
        )
    return dirs


def previous_round(context: AssetExecutionContext) -> dict | None:
    """The last materialised round's metadata (None before the first round)."""
    event = context.instance.get_latest_materialization_event(AssetKey(ASSET))
    if event is None or event.asset_materialization is None:
        return None
    return {key: value.value for key, value in event.asset_materialization.metadata.items()}


@asset(
    group_name="training",
    code_version="1",
    kinds={"vllm", "pytorch"},
    pool=GPU_POOL,
    deps=[AssetKey("draft_checkpoint")],
    check_specs=CHECKS.specs(),
)
def refinement_round(
    context: AssetExecutionContext, config: RefinementRoundConfig, target_model: TargetModel, gpu_host: GPUHost
) -> MaterializeResult:
    """One round: the current draft served on held-in prompts, trained where vLLM rejected it, kept only if not worse."""
    config.check()
    checkpoint_draft = DatasetPaths().draft_model
    if not (checkpoint_draft / DRAFT_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no exported draft at {checkpoint_draft}: materialise draft_checkpoint first")
    start = next_round(previous_round(context), checkpoint_draft, draft_weights_hash(checkpoint_draft))
    if not (start.draft / DRAFT_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{ASSET} round {start.number}: the current draft {start.draft} (kept by {start.started_from}) is gone")
    paths = RoundPaths.of(asset_dir(ASSET), start.number)
    context.log.info(f"{ASSET}: round {start.number} starts from {start.draft} ({start.started_from})")

    held_out = round_eval_prompts(target_model, config.max_eval_prompts)
    held_in = held_in_rows(training_shards(asset_dir("prompts")), config.prompts_per_round, start.number)
    overlap = held_out_overlap(held_in, [messages for _, messages in held_out])
    if overlap:  # the prompts asset splits by question, so this is a guard against a hand-made file
        raise ValueError(f"{ASSET}: {len(overlap)} held-in prompts ask a held-out question, e.g. {overlap[:5]}: the gate would judge on trained prompts")
    paths.root.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(paths.prompts, held_in)
    write_bytes_atomic(paths.eval_prompts, "".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in held_out).encode())

    job = RefinementJob(
        **values_of(config, RefinementRecipe),
        round=start.number,
        round_dir=str(paths.root),
        start_draft=str(start.draft),
        target=StageTarget(**target_model.stage_extras()),
        vocab_mapping=str(DatasetPaths().vocab_mapping),
        prompts=str(paths.prompts),
        eval_prompts=str(paths.eval_prompts),
        supervised_dirs=supervised_shards(context, config.supervised_share),
        context_length=target_model.context_length() or config.max_seq_len,
        think_open=target_model.think_open,
        think_close=target_model.think_close,
        end_of_turn=target_model.end_of_turn,
    )
    requirements = with_serving_need(REFINE_DRAFT_REQUIREMENTS, target_model.gpu_need())
    reported = gpu_host.run_stage(context, STAGE, job.model_dump(), requirements=requirements).get_materialize_result()
    metadata = dict(reported.metadata or {})
    before, after = metadata["acceptance_before"].value, metadata["acceptance_after"].value
    outcome = check_refined_not_worse(before, after, config.gate_margin)
    kept, kept_from = kept_draft(start, paths.model, outcome.passed)
    context.log.info(f"{ASSET}: round {start.number}: {outcome.description}; current draft now {kept} ({kept_from})")
    return MaterializeResult(
        data_version=DataVersion(draft_weights_hash(kept)),
        metadata={
            **metadata,
            "round": start.number,
            "started_from": start.started_from,
            "start_draft": MetadataValue.path(str(start.draft)),
            "kept_draft": MetadataValue.path(str(kept)),
            "kept_from": kept_from,
            "gate_passed": outcome.passed,
            "acceptance_gain": round(after / before, 4) if before and after else None,
            "base_weights_hash": start.base_weights_hash,
            "round_dir": MetadataValue.path(str(paths.root)),
        },
        check_results=[CHECKS.result(outcome)],
    )
