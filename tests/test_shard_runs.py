"""A run over a range of shards records each shard as its own partition (eagle3_assets/glue/shard_runs.py).

Real Dagster (an ephemeral instance, a ranged run as a backfill makes it): the
per-shard materializations carry their own data version and the upstream
partition's provenance, gates are recorded per partition, a failed blocking
gate fails the run only after the other shards are recorded.
"""

from types import SimpleNamespace

from dagster import (
    AssetCheckKey,
    BackfillPolicy,
    AssetKey,
    AssetSpec,
    DagsterInstance,
    DynamicPartitionsDefinition,
    MaterializeResult,
    DataVersion,
    asset,
    materialize,
    multi_asset,
)

from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.reporting.checks import Gate, GateTable
from eagle3_assets.core.reporting.checks import CheckOutcome
from eagle3_assets.demo.pipeline import shard_runs
from eagle3_assets.graph import PER_SHARD_ASSETS
from eagle3_assets.glue.partitions import shard_range_tags
from eagle3_assets.glue.shard_runs import ShardReporter, shards_per_run_policy

shards = DynamicPartitionsDefinition(name="test_shards")
CHECKS = AssetChecks(GateTable("ranged", [Gate("rows_positive", True, "each shard has rows"), Gate("advice", False, "advisory")]))
BAD_SHARD = "s2"


@asset(partitions_def=shards)
def upstream(context) -> MaterializeResult:
    return MaterializeResult(data_version=DataVersion(f"up-{context.partition_key}"))


@multi_asset(
    specs=[AssetSpec("ranged", partitions_def=shards, deps=[AssetKey("upstream")], code_version="7")],
    check_specs=CHECKS.specs(),
    can_subset=True,
    backfill_policy=shards_per_run_policy(8),
)
def ranged(context):
    reporter = ShardReporter(context, CHECKS, code_version="7", upstream=["upstream"])
    for shard in context.partition_keys:
        reporter.materialized(shard, {"shard": shard, "rows": int(shard[1:])}, f"v-{shard}")
        reporter.checked(shard, [CheckOutcome("rows_positive", shard != BAD_SHARD, "no rows" if shard == BAD_SHARD else ""), CheckOutcome("advice", False, "just advice")])
    reporter.raise_for_blocked()
    yield from ()


def test_each_shard_of_a_ranged_run_is_its_own_partition():
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("test_shards", ["s0", "s1", "s2", "s3"])
    for key in ["s0", "s1", "s2", "s3"]:
        assert materialize([upstream], instance=instance, partition_key=key).success

    result = materialize([upstream, ranged], instance=instance, selection=[AssetKey("ranged")], tags=shard_range_tags("s0", "s3"), raise_on_error=False)

    # The bad shard fails the run, naming it, after every shard was recorded.
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert f"{BAD_SHARD}: blocking check(s) failed: rows_positive" in failure.event_specific_data.error.message
    assert instance.get_materialized_partitions(AssetKey("ranged")) == {"s0", "s1", "s2", "s3"}

    for key in ["s0", "s3"]:
        record = instance.get_latest_data_version_record(AssetKey("ranged"), partition_key=key)
        tags = record.asset_materialization.tags
        assert tags["dagster/data_version"] == f"v-{key}"
        assert tags["dagster/input_data_version/upstream"] == f"up-{key}"
        assert record.asset_materialization.metadata["rows"].value == int(key[1:])

    history = instance.event_log_storage.get_asset_check_execution_history(AssetCheckKey(AssetKey("ranged"), "rows_positive"), limit=10)
    verdicts = {r.partition: r.status.value for r in history if r.partition}
    assert verdicts == {"s0": "SUCCEEDED", "s1": "SUCCEEDED", "s2": "FAILED", "s3": "SUCCEEDED"}


def test_a_single_shard_is_a_range_of_one():
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("test_shards", ["s1"])
    result = materialize([upstream, ranged], instance=instance, selection=[AssetKey("ranged")], partition_key="s1")
    assert result.success
    assert instance.get_materialized_partitions(AssetKey("ranged")) == {"s1"}


@multi_asset(
    specs=[AssetSpec("reported", partitions_def=shards, deps=[AssetKey("upstream")], code_version="7")],
    check_specs=AssetChecks(GateTable("reported", [Gate("rows_positive", True, "each shard has rows")])).specs(),
    can_subset=True,
    backfill_policy=shards_per_run_policy(8),
)
def reported(context):
    reporter = ShardReporter(context, AssetChecks(GateTable("reported", [Gate("rows_positive", True, "each shard has rows")])), code_version="7", upstream=["upstream"])
    for shard in context.partition_keys:
        reporter.report(shard, {"rows": int(shard[1:])}, f"v-{shard}", [CheckOutcome("rows_positive", True, "")])
    yield from reporter.results()


@asset(partitions_def=shards, deps=[AssetKey("reported")])
def downstream(context) -> MaterializeResult:
    return MaterializeResult()


def test_a_one_shard_run_goes_on_downstream_and_a_range_records_each_shard():
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("test_shards", ["s1", "s2", "s3"])
    # One shard (the UI's materialise): Dagster's own output, so the step downstream in the same run is not skipped.
    result = materialize([upstream, reported, downstream], instance=instance, partition_key="s1")
    assert result.success
    assert instance.get_materialized_partitions(AssetKey("downstream")) == {"s1"}
    record = instance.get_latest_data_version_record(AssetKey("reported"), partition_key="s1")
    assert record.asset_materialization.tags["dagster/data_version"] == "v-s1" and record.asset_materialization.metadata["rows"].value == 1
    (evaluation,) = result.get_asset_check_evaluations()
    assert evaluation.passed and evaluation.check_name == "rows_positive"

    # A range: every shard recorded as its own partition, with its own version.
    for key in ["s2", "s3"]:
        materialize([upstream], instance=instance, partition_key=key)
    ranged_run = materialize([upstream, reported], instance=instance, selection=[AssetKey("reported")], tags=shard_range_tags("s2", "s3"))
    assert ranged_run.success
    for key in ["s2", "s3"]:
        tags = instance.get_latest_data_version_record(AssetKey("reported"), partition_key=key).asset_materialization.tags
        assert tags["dagster/data_version"] == f"v-{key}" and tags["dagster/input_data_version/upstream"]


def test_the_demo_splits_its_shards_into_runs_as_a_backfill_does():
    """Generation and extraction over every shard in one ranged run (a server kept busy, the target loaded once);
    the prompts of every shard in one run (so the generation behind them comes in full ranges); the assets without
    a backfill policy one run per shard; a policy's cap splits a longer range."""
    keys = [f"shard-{i:05d}" for i in range(5)]
    # A ranged run carries the tags a backfill's does.
    assert shard_range_tags(keys[0], keys[-1]) == {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}
    runs = {a.key.to_user_string(): shard_runs(a, keys) for a in PER_SHARD_ASSETS}
    assert runs == {
        "prompts": [keys], "raw_responses": [keys], "validated_traces": [[k] for k in keys], "hidden_states": [keys],
    }  # fmt: skip
    assert shard_runs(SimpleNamespace(backfill_policy=shards_per_run_policy(2)), ["a", "b", "c"]) == [["a", "b"], ["c"]]
    assert shard_runs(SimpleNamespace(backfill_policy=BackfillPolicy.single_run()), ["a", "b", "c"]) == [["a", "b", "c"]]
