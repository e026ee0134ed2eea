"""``validated_traces``: the raw responses that pass the gates, as the target's own token sequences.

Reads ``<data>/prompts/<shard>.parquet`` and ``<data>/raw_responses/<shard>.parquet``;
writes ``<data>/validated_traces/<shard>.parquet`` (``id``, ``messages``,
``reasoning``, ``content``, ``input_ids``, ``loss_mask``, ``num_tokens``) and
``<shard>.rejected.parquet`` (``id``, ``reason``, ``detail``). The rules and the
rendering live in :mod:`eagle3_assets.core.validation.shard_validation` and
:mod:`eagle3_assets.core.validation.chat_rendering`; this module wires them to Dagster.

The blocking checks are the point of running on Dagster: when one fails, the
step fails after writing its files (so the rejected rows can be inspected),
and nothing downstream of the shard is built in that run. Had such a gate stood
after generation in the story this project comes from, 388 rows of empty
reasoning would have stopped the run at once.
The gates are declared in core beside their checks
(:data:`eagle3_assets.core.validation.gates.TRACE_GATES`), where the assets
that train on green shards read them too; :data:`CHECKS` adapts them.

``raw_responses`` is referenced by key, not imported, so this module does not
depend on how generation is implemented.
"""

from types import SimpleNamespace
from typing import Optional

from dagster import (
    AssetExecutionContext,
    AssetKey,
    Config,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.storage.journal import parquet_generation
from eagle3_assets.core.generation.response_rules import DEFAULT_MIN_REASONING_SHARE
from eagle3_assets.core.storage.shard_files import quarantine_if_corrupt, verify_shard_parquet
from eagle3_assets.core.storage.shard_lease import ShardLease
from eagle3_assets.core.target.identity import parquet_metadata
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.storage.files import data_dir, file_hash, stable_hash
from eagle3_assets.core.validation.mask_alignment import mask_alignment_problems
from eagle3_assets.core.validation.trace_files import written_ids, written_token_lengths
from eagle3_assets.core.validation.gates import (
    DEFAULT_MAX_REQUEST_ERROR_SHARE,
    DEFAULT_MAX_TRUNCATION_RATE,
    TRACE_GATES,
    token_length_histogram_markdown,
    token_length_stats,
)
from eagle3_assets.core.validation.shard_validation import REJECTION_REASONS, ValidationRules, validate_shard
from eagle3_assets.glue.partitions import sample_shards
from resources.target_model import TargetModel

ASSET = "validated_traces"
CHECKS = AssetChecks(TRACE_GATES)  # the declared gates as this asset's checks


class ValidationConfig(Config):
    """The keep/reject rules and gate thresholds; set per run in the launchpad."""

    max_seq_len: Optional[int] = Field(
        default=None, description="longest rendered trace kept, in tokens; default: the target's max_position_embeddings"
    )
    allow_truncated: Optional[bool] = Field(
        default=None,
        description="keep rows whose generation hit max_tokens (finish_reason 'length'); they get no end-of-turn token. "
        "Default: vllm_server.allow_truncated as the raw shard was generated with it (recorded in its file), else false",
    )
    min_reasoning_share: float = Field(
        default=DEFAULT_MIN_REASONING_SHARE,
        description="reasoning_present fails (blocking) below this share of reasoning among the rows that got a response",
    )
    max_request_error_share: float = Field(
        default=DEFAULT_MAX_REQUEST_ERROR_SHARE,
        description="request_errors_rare fails (blocking) above this share of requests that ended in an error "
        "(prompts too long for the server were never sent and are not counted)",
    )
    max_truncation_rate: float = Field(
        default=DEFAULT_MAX_TRUNCATION_RATE, description="truncation_rate_low warns above this share of truncated generations"
    )
    batch_rows: int = Field(default=128, description="rows rendered and tokenised per batch, and rows per parquet row group (bounds memory)")


@asset(
    partitions_def=sample_shards,
    group_name="validation",
    code_version="1",
    kinds={"polars", "parquet"},
    deps=[AssetKey("prompts"), AssetKey("raw_responses")],
    check_specs=CHECKS.specs(),
)
def validated_traces(context: AssetExecutionContext, config: ValidationConfig, target_model: TargetModel) -> MaterializeResult:
    """Rows that pass the gates, rendered into the target's chat template with its thinking tokens, with input_ids and loss_mask; rejected rows kept apart with a reason."""
    key = context.partition_key
    # One writer per shard: a second run of this shard fails at once, naming the run that holds it.
    with ShardLease(ShardPaths(ASSET, key).asset_dir, key, asset=ASSET, run_id=context.run.run_id, log=context.log.info):
        return _validate(context, config, target_model, key)


def _validate(context: AssetExecutionContext, config: ValidationConfig, target_model: TargetModel, key: str) -> MaterializeResult:
    root = data_dir()
    prompts_path = ShardPaths("prompts", key, root).parquet
    raw_path = ShardPaths("raw_responses", key, root).parquet
    out = ShardPaths(ASSET, key, root)
    kept_path, rejected_path = out.parquet, out.rejected
    # Inputs are trusted only once they decode; a damaged output of ours is kept aside, not overwritten unseen.
    verify_shard_parquet(prompts_path, asset="prompts", shard=key)
    verify_shard_parquet(raw_path, asset="raw_responses", shard=key)
    for written in (kept_path, rejected_path):
        quarantine_if_corrupt(written, context.log.warning)

    renderer = target_model.renderer()
    identity = target_model.identity()
    max_seq_len = config.max_seq_len or target_model.context_length() or 0
    if max_seq_len <= 0:
        raise ValueError(f"target {target_model.path} has no max_position_embeddings: set max_seq_len in the validated_traces config")
    # One setting for generation and validation: what the raw shard was generated (and retried) under, unless set here.
    recorded = parquet_generation(raw_path) if raw_path.is_file() else None
    allow_truncated = config.allow_truncated if config.allow_truncated is not None else bool((recorded or {}).get("allow_truncated", False))
    rules = ValidationRules(max_seq_len=max_seq_len, allow_truncated=allow_truncated)

    summary = validate_shard(
        raw_path, prompts_path, renderer, rules, kept_path, rejected_path, batch_rows=config.batch_rows,
        file_metadata=parquet_metadata(identity),  # the GPU host compares the model it loads with this one
    )  # fmt: skip
    alignment = mask_alignment_problems(kept_path, raw_path, renderer, batch_rows=config.batch_rows)
    lengths = written_token_lengths(kept_path)
    stats = token_length_stats(lengths)
    markers = (renderer.think_open, renderer.think_close)
    context.log.info(
        f"{key}: {summary.kept} of {summary.raw_rows} raw rows kept, rejected {summary.rejected_by_reason or 'none'}; "
        f"tokens p50 {stats['p50']} p95 {stats['p95']} max {stats['max']}"
    )

    check_results = CHECKS.results(
        SimpleNamespace(
            summary=summary, config=config, alignment=alignment, markers=markers,
            kept_ids=written_ids(kept_path), rejected_ids=written_ids(rejected_path),
        )
    )  # fmt: skip

    version = stable_hash(
        {
            "prompts": file_hash(prompts_path),
            "raw_responses": file_hash(raw_path),
            "target": identity.config_hash,
            "rendering": renderer.fingerprint(),
            "rules": {"max_seq_len": max_seq_len, "allow_truncated": allow_truncated},
        }
    )
    return MaterializeResult(
        data_version=DataVersion(version),
        metadata={
            "path": MetadataValue.path(str(kept_path)),
            "rejected_path": MetadataValue.path(str(rejected_path)),
            "raw_rows": summary.raw_rows,
            "kept": summary.kept,
            "rejected": summary.rejected,
            "rejected_by_reason": MetadataValue.json(summary.rejected_by_reason),
            # Kept rows whose ids equal the server's own (prompt_token_ids, output_token_ids); the rest were rebuilt
            # from text alone because their raw rows carry no ids (a server without return_token_ids, older files).
            "kept_with_server_ids": summary.kept_with_server_ids,
            "rejection_reasons": MetadataValue.json({r: REJECTION_REASONS[r] for r in summary.rejected_by_reason}),
            "dagster/row_count": summary.kept,
            "tokens_p50": stats["p50"],
            "tokens_p95": stats["p95"],
            "tokens_max": stats["max"],
            "tokens_mean": stats["mean"],
            "tokens_total": int(sum(lengths)),
            "token_length_histogram": MetadataValue.md(token_length_histogram_markdown(lengths)),
            "think_markers": MetadataValue.json(list(markers)),
            "end_of_turn": renderer.end_of_turn,
            "template_opens_think_block": renderer.template_opens_think_block(),
            "max_seq_len": max_seq_len,
            "allow_truncated": allow_truncated,
            "target": MetadataValue.json(identity.as_dict()),
        },
        check_results=check_results,
    )
