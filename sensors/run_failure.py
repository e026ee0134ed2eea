"""``run_failure_alert``: any failed run, posted to the same channel as the gate alerts."""

from dagster import DefaultSensorStatus, RunFailureSensorContext, run_failure_sensor

from eagle3_assets.core.serving.alerts import Alert, AlertDeliveryError
from resources.alerts import AlertChannel


@run_failure_sensor(
    name="run_failure_alert",
    default_status=DefaultSensorStatus.RUNNING,
    monitor_all_code_locations=False,
    description="Posts an alert for every failed run, with its job, partition, error and a run link.",
)
def run_failure_alert(context: RunFailureSensorContext, alert_channel: AlertChannel):
    if not alert_channel.configured:
        return
    run = context.dagster_run
    partition = run.tags.get("dagster/partition")
    lines = [f"job: {run.job_name}"] + ([f"partition: {partition}"] if partition else [])
    if context.failure_event.message:
        lines.append(context.failure_event.message[:500])
    try:
        alert_channel.send(Alert(title=f"Run failed: {run.job_name}", lines=lines, link=alert_channel.run_link(run.run_id)))
    except AlertDeliveryError as exc:
        # Run-status sensors do not re-deliver a run: raising makes the tick fail visibly in the UI.
        raise RuntimeError(f"run-failure alert for {run.run_id} not delivered: {exc}") from None
