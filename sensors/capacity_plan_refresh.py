"""``capacity_plan_refresh``: plans the run again when shards finished since the last plan.

The capacity plan's rates are measured on the shards done, so its GPU-hours and
ETA follow the backfill: each tick (every 5 minutes) compares the newest
materialisation of a per-shard asset with the one the last plan saw, and
requests one ``plan_capacity`` run when it changed (one run per tick, however
many shards finished).
"""

from dagster import AssetKey, DefaultSensorStatus, RunRequest, SensorEvaluationContext, SkipReason, sensor

from eagle3_assets.defs.capacity_plan import plan_capacity_job

PER_SHARD = ("raw_responses", "validated_traces", "hidden_states")


@sensor(
    name="capacity_plan_refresh",
    job=plan_capacity_job,
    minimum_interval_seconds=300,
    default_status=DefaultSensorStatus.RUNNING,
    description="Plans the run again when shards finished since the last plan, so the measured rates and the ETA follow the backfill.",
)
def capacity_plan_refresh(context: SensorEvaluationContext):
    latest = 0
    for asset in PER_SHARD:
        records = context.instance.fetch_materializations(AssetKey(asset), limit=1).records
        latest = max([latest] + [r.storage_id for r in records])
    if not latest or str(latest) == context.cursor:
        return SkipReason("no shard finished since the last plan")
    context.update_cursor(str(latest))
    return RunRequest(run_key=f"capacity-plan-{latest}")
