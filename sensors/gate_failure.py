"""``gate_failure_alert``: one alert per failed asset-check evaluation.

A failed non-blocking (WARN) check does not fail its run, so a run-failure
sensor never sees it; this sensor reads the check evaluations themselves. Its
cursor is the storage id of the last evaluation it has dealt with: an
evaluation is alerted once, and an alert the webhook did not take stops the
cursor there, so the next tick retries it instead of losing it.
"""

from dagster import (
    DagsterEventType,
    DefaultSensorStatus,
    EventRecordsFilter,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from eagle3_assets.core.serving.alerts import Alert, AlertDeliveryError, figures_of
from resources.alerts import WEBHOOK_ENV, AlertChannel

BATCH = 200


def gate_alert(evaluation, partition: str | None, link: str) -> Alert:
    severity = evaluation.severity.value
    where = f"{evaluation.asset_key.to_user_string()}" + (f" [{partition}]" if partition else "")
    lines = [f"severity: {severity}", f"asset: {where}"]
    if evaluation.description:
        lines.append(evaluation.description)
    figures = figures_of(dict(evaluation.metadata))
    if figures:
        lines.append("figures: " + ", ".join(figures))
    return Alert(title=f"Gate failed: {evaluation.check_name} on {where}", lines=lines, link=link)


@sensor(
    name="gate_failure_alert",
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description="Posts one alert per failed asset check (ERROR or WARN), with asset, partition, figures and a run link.",
)
def gate_failure_alert(context: SensorEvaluationContext, alert_channel: AlertChannel):
    if not alert_channel.configured:
        return SkipReason(f"no alert destination: set {WEBHOOK_ENV}")
    cursor = int(context.cursor or 0)
    records = context.instance.event_log_storage.get_event_records(
        EventRecordsFilter(DagsterEventType.ASSET_CHECK_EVALUATION, after_cursor=cursor), limit=BATCH, ascending=True
    )
    sent = 0
    for record in records:
        evaluation = record.event_log_entry.dagster_event.event_specific_data
        if not evaluation.passed:
            partition = evaluation.partition or _run_partition(context, record.run_id)
            try:
                alert_channel.send(gate_alert(evaluation, partition, alert_channel.run_link(record.run_id)))
            except AlertDeliveryError as exc:
                context.log.warning(f"alert for {evaluation.check_name} not delivered, retrying next tick: {exc}")
                break
            sent += 1
        cursor = record.storage_id
    context.update_cursor(str(cursor))
    if not sent:
        return SkipReason("no new failed checks")
    context.log.info(f"{sent} gate alert(s) sent")
    return None


def _run_partition(context: SensorEvaluationContext, run_id: str) -> str | None:
    run = context.instance.get_run_by_id(run_id)
    return run.tags.get("dagster/partition") if run else None
