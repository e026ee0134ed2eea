"""``prompts``: the normalised questions of one sample shard.

Writes ``<data>/prompts/<shard>.parquet`` (``row_index``, ``id``, ``messages``),
``<shard>.heldout.parquet`` (the rows kept out of training for
``draft_evaluation``, see :mod:`eagle3_assets.core.prompts.heldout`) and
``<shard>.rejected.parquet`` (each bad row with its reason). A shard with
bad rows still materialises; only an unreadable file fails the run.

A backfill puts ALL the shards of ``prompts`` it targets in one run
(``BackfillPolicy.single_run``; the UI's materialise is a range of one), each
shard still written, checked and recorded as its own partition
(:class:`~eagle3_assets.glue.shard_runs.ShardReporter`). Why: ``raw_responses``
runs over ranges of up to ``EAGLE3_SHARDS_PER_RUN`` shards, and the backfill
daemon requests a range only from the shards whose prompts are recorded at
its tick. With a run per prompts shard, a whole-graph backfill (``--assets
prompts,raw_responses``) got its generation ranges piecemeal, as the prompts
runs happened to finish: several short generation runs, one after the other in
the generation pool, each draining the server at its end. With the prompts in
one run, the prompts are all recorded by the same tick, and the generation goes
in full ranges (docs/generation.md). The policy differs from ``raw_responses'``
(a bounded ``multi_run``) on purpose: the daemon groups a parent and child
asset in one run only when their policies are equal, and a ranged ``prompts``
step reports its shards without Dagster's output, which would make Dagster
skip a ``raw_responses`` step in the same run.
"""


from types import SimpleNamespace

from dagster import AssetExecutionContext, AssetSpec, BackfillPolicy, MetadataValue, multi_asset

from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.prompts.gates import PROMPT_GATES
from eagle3_assets.core.storage.shard_files import quarantine_if_corrupt
from eagle3_assets.core.storage.shard_lease import ShardLease
from eagle3_assets.core.prompts.heldout import split_held_out
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.storage.files import stable_hash, write_parquet_atomic
from eagle3_assets.glue.partitions import sample_shards
from eagle3_assets.glue.shard_runs import ShardReporter
from resources.prompt_dataset import PromptDataset

CHECKS = AssetChecks(PROMPT_GATES)  # the declared gates as this asset's checks


CODE_VERSION = "2"  # 2: held out by question, not by id


@multi_asset(
    specs=[
        AssetSpec(
            "prompts", partitions_def=sample_shards, group_name="generation", code_version=CODE_VERSION, kinds={"polars", "parquet"},
            description="The questions of one shard, normalised to id and chat messages; bad rows kept apart with a reason.",
        )
    ],
    check_specs=CHECKS.specs(),
    can_subset=True,
    backfill_policy=BackfillPolicy.single_run(),  # see the module: one run for a backfill's prompts
)  # fmt: skip
def prompts(context: AssetExecutionContext, prompt_dataset: PromptDataset):
    """The questions of each shard of the run, normalised to ``id`` and chat ``messages``; bad rows kept apart with a reason."""
    holdout = prompt_dataset.holdout_plan()  # the share that holds out at least holdout_min_prompts over the dataset
    reporter = ShardReporter(context, CHECKS, code_version=CODE_VERSION)
    for key in context.partition_keys:
        metadata, version, outcomes = _shard(context, prompt_dataset, holdout, key)
        reporter.report(key, metadata, version, outcomes)  # recorded now: a run that dies later keeps it
    yield from reporter.results()


def _shard(context: AssetExecutionContext, prompt_dataset: PromptDataset, holdout, key: str):
    """One shard: its files written, its metadata, data version and gate outcomes."""
    shard = prompt_dataset.load_shard(key)
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
    metadata = {
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
    }
    evidence = SimpleNamespace(key=key, accepted=accepted, rejected=rejected, rejected_share=rejected_share, examples=examples)
    return metadata, version, [gate.predicate(evidence) for gate in CHECKS.by_name.values()]
