"""Sensors against a real Dagster instance and a real HTTP receiver on loopback."""

from __future__ import annotations

import json

import pytest
from dagster import DagsterEventType, DagsterInstance, SkipReason, build_run_status_sensor_context, build_sensor_context, materialize

from eagle3_assets.core.serving.vllm_metrics import parse_prometheus
from eagle3_assets.glue.partitions import SAMPLE_SHARDS, register_shards
from eagle3_assets.defs.prompts import prompts
from resources.alerts import AlertChannel
from resources.prompt_dataset import PromptDataset
from sensors.gate_failure import gate_failure_alert
from sensors.new_shards import new_prompt_shards
from tests.alert_receiver import AlertReceiver


@pytest.fixture
def receiver():
    server = AlertReceiver().start()
    yield server
    server.stop()


def write_dataset(path, count, bad=0):
    rows = [json.dumps({"id": f"q{i}", "question": f"question {i}?"}) for i in range(count)] + ["{bad"] * bad
    path.write_text("\n".join(rows) + "\n")
    return path


def tick(sensor, instance, cursor, channel):
    context = build_sensor_context(instance=instance, cursor=cursor, resources={"alert_channel": channel})
    result = sensor(context)
    return context.cursor, result


def test_a_failed_warn_gate_alerts_once_and_survives_a_receiver_outage(tmp_path, receiver):
    instance = DagsterInstance.ephemeral()
    dataset = PromptDataset(source=str(write_dataset(tmp_path / "d.jsonl", 3, bad=2)), shard_size=8)
    register_shards(instance, ["shard-00000"])
    run = materialize([prompts], partition_key="shard-00000", resources={"prompt_dataset": dataset}, instance=instance)
    assert run.success  # a WARN check fails without failing the run: only this sensor sees it
    channel = AlertChannel(webhook_url=receiver.url, ui_base_url="http://ui.example:3000")

    receiver.stop()  # down for one tick: nothing delivered, nothing lost
    cursor, _ = tick(gate_failure_alert, instance, None, channel)
    assert receiver.received == []
    receiver.start()
    for _ in range(3):
        cursor, _ = tick(gate_failure_alert, instance, cursor, channel)
    (text,) = receiver.texts()
    assert "rejected_rows_rare" in text and "[shard-00000]" in text and "WARN" in text
    assert "rejected_share=0.4" in text and "threshold=0.05" in text
    assert f"http://ui.example:3000/runs/{run.run_id}" in text


def test_without_a_destination_the_sensor_skips(tmp_path):
    instance = DagsterInstance.ephemeral()
    _, result = tick(gate_failure_alert, instance, None, AlertChannel())
    assert "EAGLE3_ALERT_WEBHOOK_URL" in result.skip_message


def test_appending_prompts_adds_new_partition_keys_and_keeps_old_ones(tmp_path):
    instance = DagsterInstance.ephemeral()
    path = write_dataset(tmp_path / "d.jsonl", 5)
    dataset = PromptDataset(source=str(path), shard_size=4)
    register_shards(instance, dataset.shard_keys())
    assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == ["shard-00000", "shard-00001"]

    write_dataset(path, 13)
    context = build_sensor_context(instance=instance, resources={"prompt_dataset": dataset})
    result = new_prompt_shards(context)
    (request,) = result.dynamic_partitions_requests
    assert list(request.partition_keys) == ["shard-00002", "shard-00003"]
    assert result.run_requests == []  # generation is requested only when EAGLE3_AUTO_GENERATE=1
    instance.add_dynamic_partitions(SAMPLE_SHARDS, list(request.partition_keys))
    assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]


def test_an_unchanged_dataset_is_not_read_again_and_a_grown_one_adds_its_shards(tmp_path):
    instance = DagsterInstance.ephemeral()
    path = write_dataset(tmp_path / "d.jsonl", 5)
    dataset = PromptDataset(source=str(path), shard_size=4)
    line_index = tmp_path / ".d.jsonl.lines"

    def tick(cursor):
        result = new_prompt_shards(build_sensor_context(instance=instance, cursor=cursor, resources={"prompt_dataset": dataset}))
        for request in getattr(result, "dynamic_partitions_requests", None) or []:
            instance.add_dynamic_partitions(SAMPLE_SHARDS, list(request.partition_keys))
        return result

    first = tick(None)
    assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == ["shard-00000", "shard-00001"]
    assert line_index.is_file()  # counting the rows built the dataset's line index

    line_index.unlink()  # if the next tick read the file at all, the index would come back
    second = tick(first.cursor)
    assert isinstance(second, SkipReason)
    assert second.skip_message == f"{path} unchanged since the last look ({path.stat().st_size} bytes, mtime_ns {path.stat().st_mtime_ns}): nothing read"
    assert not line_index.exists()

    with open(path, "a") as fh:  # the dataset grows by appending, as a collection job does
        fh.write("".join(json.dumps({"id": f"q{i}", "question": f"question {i}?"}) + "\n" for i in range(5, 14)))
    third = tick(first.cursor)
    assert [list(r.partition_keys) for r in third.dynamic_partitions_requests] == [["shard-00002", "shard-00003"]]
    assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == [f"shard-0000{i}" for i in range(4)]
    assert line_index.is_file()
    fourth = tick(third.cursor)
    assert isinstance(fourth, SkipReason) and "unchanged since the last look" in fourth.skip_message

    # a new shard size re-keys everything: the same file is looked at again
    dataset = PromptDataset(source=str(path), shard_size=2)
    fifth = tick(third.cursor)
    assert [list(r.partition_keys) for r in fifth.dynamic_partitions_requests] == [["shard-00004", "shard-00005", "shard-00006"]]


def test_auto_generate_requests_one_run_per_new_shard(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_AUTO_GENERATE", "1")
    instance = DagsterInstance.ephemeral()
    dataset = PromptDataset(source=str(write_dataset(tmp_path / "d.jsonl", 6)), shard_size=4)
    result = new_prompt_shards(build_sensor_context(instance=instance, resources={"prompt_dataset": dataset}))
    assert [r.partition_key for r in result.run_requests] == ["shard-00000", "shard-00001"]


def test_run_failure_alert_posts_the_failed_run(tmp_path, receiver):
    from sensors.run_failure import run_failure_alert

    instance = DagsterInstance.ephemeral()
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"\xff\n")
    register_shards(instance, ["shard-00000"])
    run = materialize(
        [prompts], partition_key="shard-00000", instance=instance, raise_on_error=False,
        resources={"prompt_dataset": PromptDataset(source=str(broken), shard_size=4)},
    )  # fmt: skip
    assert not run.success
    failure = next(e for e in run.all_events if e.event_type == DagsterEventType.RUN_FAILURE)
    context = build_run_status_sensor_context(
        sensor_name="run_failure_alert", dagster_event=failure, dagster_instance=instance,
        dagster_run=instance.get_run_by_id(run.run_id), resources={"alert_channel": AlertChannel(webhook_url=receiver.url)},
    ).for_run_failure()  # fmt: skip
    run_failure_alert(context)
    (text,) = receiver.texts()
    assert "Run failed" in text and "partition: shard-00000" in text and run.run_id in text


def test_prometheus_parsing_sums_label_sets():
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "vllm:num_requests_waiting 7\n"
    )
    metrics = parse_prometheus(text)
    assert metrics["vllm:num_requests_running"] == 5.0 and metrics["vllm:num_requests_waiting"] == 7.0


def test_a_failed_reasoning_present_alerts_once_with_partition_and_figure(data_dir, tiny_target, receiver):
    """The story's bug, end to end: empty reasoning on a shard -> the blocking gate fails -> one alert."""
    from eagle3_assets.defs.validated_traces import validated_traces
    from tests.test_validation import question, response, run, write_shard

    empty_reasoning = [response(f"p{i}", i, reasoning=None, reasoning_field="none") for i in range(4)]
    write_shard(data_dir, [(f"p{i}", question(i)) for i in range(4)], empty_reasoning, shard="shard-00007")
    result, instance = run([validated_traces], tiny_target, shard="shard-00007")
    assert not result.success  # the blocking gate stops the run
    channel = AlertChannel(webhook_url=receiver.url)
    cursor = None
    for _ in range(4):
        cursor, _ = tick(gate_failure_alert, instance, cursor, channel)
    gate_alerts = [t for t in receiver.texts() if "reasoning_present" in t]
    assert len(gate_alerts) == 1
    (text,) = gate_alerts
    assert "[shard-00007]" in text and "ERROR" in text
    assert "reasoning_share=0" in text and "threshold=0.98" in text
