"""The tests' validated traces: eagle3_assets/demo/validated_traces.py (``eagle3-gpu-check`` writes them too)."""

import os
from contextlib import contextmanager

from eagle3_assets.demo.validated_traces import TRACES_SCHEMA, render_trace, write_validated_traces

__all__ = ["in_process_vllm_environment", "recorded_checks", "recorded_materializations", "TRACES_SCHEMA", "render_trace", "write_validated_traces"]


def recorded_checks(instance, run_id: str) -> dict:
    """The gate results the run recorded in the instance (what the UI shows), by check name.

    ``hidden_states`` reports each shard as it finishes; a run that then fails
    keeps them in the instance, but its in-process result lists only what the
    step yielded before failing.
    """
    from dagster import DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records
    return {r.event_log_entry.dagster_event.event_specific_data.check_name: r.event_log_entry.dagster_event.event_specific_data for r in records}


def recorded_materializations(instance, run_id: str, asset: str) -> list:
    """The materializations of ``asset`` the run recorded in the instance (see :func:`recorded_checks`)."""
    from dagster import DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    found = [r.event_log_entry.dagster_event.event_specific_data.materialization for r in records]
    return [m for m in found if m.asset_key.to_user_string() == asset]


@contextmanager
def in_process_vllm_environment():
    """What an in-process vLLM engine needs on this CPU host (a 1 GiB KV cache, a loopback address), put back after."""
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_HOST_IP")}
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
