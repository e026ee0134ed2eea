"""Sensors: gate-failure and run-failure alerts, server health, new prompt shards, the deployed draft."""

from sensors.capacity_plan_refresh import capacity_plan_refresh
from sensors.deployed_draft_watch import deployed_draft_watch
from sensors.gate_failure import gate_failure_alert
from sensors.new_shards import new_prompt_shards
from sensors.run_failure import run_failure_alert
from sensors.server_health import vllm_server_health

# Alerts, the production watch (a skip until EAGLE3_PRODUCTION_URLS is set) and the capacity plan's refresh run by default;
# health polling and shard discovery are opt-in (README: Sensors).
ALL_SENSORS = [gate_failure_alert, run_failure_alert, vllm_server_health, new_prompt_shards, deployed_draft_watch, capacity_plan_refresh]
