"""``prompts``: the normalised questions of one sample shard.

Writes ``<data>/prompts/<shard>.parquet`` (``row_index``, ``id``, ``messages``),
``<shard>.heldout.parquet`` (the rows kept out of training for
``draft_evaluation``, see :mod:`eagle3_assets.core.prompts.heldout`) and
``<shard>.rejected.parquet`` (each bad row with its reason). A shard with
bad rows still materialises; only an unreadable file fails the run.
"""


from types import SimpleNamespace

from dagster import (
    AssetExecutionContext,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from eagle3_assets.check_results import Gate, Gates
from eagle3_assets.core.reporting.checks import CheckOutcome, share_at_most
from eagle3_assets.core.storage.shard_files import quarantine_if_corrupt
from eagle3_assets.core.storage.shard_lease import ShardLease
from eagle3_assets.core.prompts.heldout import split_held_out
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.storage.files import stable_hash, write_parquet_atomic
from eagle3_assets.partitions import sample_shards
from resources.prompt_dataset import PromptDataset

MAX_REJECTED_SHARE = 0.05

GATES = Gates(
    "prompts",
    [
        Gate(
            "prompts_present", True, "the shard holds at least one usable prompt",
            lambda e: CheckOutcome(
                "prompts_present", e.accepted > 0, "" if e.accepted else f"shard {e.key} has no usable prompt ({e.rejected} rows rejected)",
                {"accepted": e.accepted, "rejected": e.rejected},
            ),
        ),
        Gate(
            "rejected_rows_rare", False, f"at most {MAX_REJECTED_SHARE:.0%} of the shard's rows were rejected",
            lambda e: share_at_most(
                "rejected_rows_rare", "rejected_share", e.rejected_share, MAX_REJECTED_SHARE, "the shard's rows were rejected", examples=e.examples
            ),
        ),
    ],
)  # fmt: skip


@asset(
    partitions_def=sample_shards,
    group_name="generation",
    code_version="2",  # 2: held out by question, not by id
    kinds={"polars", "parquet"},
    check_specs=GATES.specs(),
)
def prompts(context: AssetExecutionContext, prompt_dataset: PromptDataset) -> MaterializeResult:
    """The questions of one shard, normalised to ``id`` and chat ``messages``; bad rows kept apart with a reason."""
    key = context.partition_key
    shard = prompt_dataset.load_shard(key)
    holdout = prompt_dataset.holdout_plan()  # the share that holds out at least holdout_min_prompts over the dataset
    training, held_out = split_held_out(shard.accepted, holdout.share)
    paths = ShardPaths("prompts", key)
    with ShardLease(paths.asset_dir, key, asset="prompts", run_id=context.run.run_id, log=context.log.info):
        for written in (paths.parquet, paths.heldout, paths.rejected):
            quarantine_if_corrupt(written, context.log.warning)  # kept for inspection, not overwritten unseen
        write_parquet_atomic(paths.parquet, training)
        write_parquet_atomic(paths.heldout, held_out)
        write_parquet_atomic(paths.rejected, shard.rejected)

    accepted, rejected = training.height, shard.rejected.height
    total = accepted + held_out.height + rejected
    reasons = dict(shard.rejected.group_by("reason").len().iter_rows()) if rejected else {}
    rejected_share = rejected / total if total else 0.0
    examples = [f"row {r['row_index']}: {r['reason']} ({r['detail']})" for r in shard.rejected.head(10).iter_rows(named=True)]
    context.log.info(f"{key}: {accepted} prompts accepted, {held_out.height} held out for evaluation, {rejected} rejected {reasons or ''}")
    if "built" in shard.indexes.values() or "extended" in shard.indexes.values():
        context.log.info(f"{key}: dataset indexes {shard.indexes} (later shards of this file version reuse them)")
    version = stable_hash({"prompts": training.to_dicts(), "source": prompt_dataset.resolved_source()})
    return MaterializeResult(
        data_version=DataVersion(version),
        metadata={
            "path": MetadataValue.path(str(paths.parquet)),
            "source": prompt_dataset.resolved_source(),
            "rows": total,
            "accepted": accepted,
            "held_out": held_out.height,
            "holdout_share": prompt_dataset.holdout_share,
            **holdout.as_metadata(),
            "rejected": rejected,
            "rejected_by_reason": MetadataValue.json(reasons),
            # what reading this shard cost: a "built" index is the one-off pass over the dataset
            "dataset_indexes": MetadataValue.json(shard.indexes),
            "dagster/row_count": accepted,
        },
        check_results=GATES.results(
            SimpleNamespace(key=key, accepted=accepted, rejected=rejected, rejected_share=rejected_share, examples=examples)
        ),
    )
