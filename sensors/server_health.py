"""``vllm_server_health``: alerts when a vLLM server goes down and when it recovers.

Transitions only: the cursor remembers each server's last state, so a server
that stays down alerts once, not every tick. A server first seen down alerts;
one first seen up does not. Each tick logs running and waiting requests from
``/metrics``, which shows whether generation keeps the server saturated.
"""

import json

from dagster import DefaultSensorStatus, SensorEvaluationContext, SkipReason, sensor

from eagle3_assets.core.serving.alerts import Alert, AlertDeliveryError, probe_server
from eagle3_assets.core.generation.redaction import redact_url
from resources.alerts import AlertChannel
from resources.vllm_server import VLLMServerResource


@sensor(
    name="vllm_server_health",
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.STOPPED,
    description="Polls /health and /metrics of every configured vLLM server; alerts on down and on recovery.",
)
def vllm_server_health(context: SensorEvaluationContext, vllm_server: VLLMServerResource, alert_channel: AlertChannel):
    previous: dict[str, bool] = json.loads(context.cursor) if context.cursor else {}
    state = dict(previous)
    notes = []
    for request_url in vllm_server.request_urls():
        url = redact_url(request_url)  # logs, alerts and the cursor (stored in the instance) never hold credentials
        health = probe_server(request_url)
        if health.up:
            notes.append(f"{url}: up, {health.running} running, {health.waiting} waiting")
        else:
            notes.append(f"{url}: DOWN ({health.error})")
        was_up = previous.get(url)
        changed = (was_up is None and not health.up) or (was_up is not None and was_up != health.up)
        if changed and alert_channel.configured:
            title = f"vLLM server {'recovered' if health.up else 'down'}: {url}"
            lines = [health.error] if health.error else [f"running={health.running}", f"waiting={health.waiting}"]
            try:
                alert_channel.send(Alert(title=title, lines=lines))
            except AlertDeliveryError as exc:
                context.log.warning(f"health alert not delivered, retrying next tick: {exc}")
                continue  # keep the old state so the transition is seen again next tick
        state[url] = health.up
    context.update_cursor(json.dumps(state, sort_keys=True))
    context.log.info("; ".join(notes))
    return SkipReason("; ".join(notes))
