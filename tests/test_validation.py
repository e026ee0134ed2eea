"""validated_traces and its gates, on recorded raw shards that follow the raw_responses contract.

The raw shards are written the way generation writes them (one row per prompt,
the contract's columns), so no vLLM server is needed: the point here is what
validation does with what the server returned, the story's empty-reasoning
shard included.

No ``from __future__ import annotations`` here: this module defines an asset,
and Dagster must resolve its ``context`` type hint.
"""

import polars as pl
import pytest
from dagster import AssetExecutionContext, AssetKey, DagsterInstance, MaterializeResult, asset, materialize
from transformers import AutoTokenizer

from eagle3_assets.core.validation.chat_rendering import ChatRenderer
from eagle3_assets.core.prompts.loading import PROMPTS_SCHEMA
from eagle3_assets.core.storage.files import asset_dir, write_parquet_atomic
from eagle3_assets.core.validation.mask_alignment import mask_alignment_problems
from eagle3_assets.core.validation.trace_files import KEPT_SCHEMA, RAW_RESPONSES_SCHEMA, REJECTED_SCHEMA, ValidationInputError
from eagle3_assets.core.validation.gates import (
    check_reasoning_present,
    check_responses_accounted,
    check_truncation_rate_low,
    token_length_histogram_markdown,
    token_length_stats,
)
from eagle3_assets.core.validation.shard_validation import ValidationRules, validate_shard
from eagle3_assets.glue.partitions import register_shards, sample_shards
from eagle3_assets.defs.validated_traces import validated_traces
from resources.target_model import TargetModel

SHARD = "shard-00000"


# -- recorded shards ---------------------------------------------------------------


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {i}+{i + 7}?"}]


def multi_turn(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "The answer is 4."},
        *question(i),
    ]


def response(sample_id: str, i: int, **overrides) -> dict:
    """A raw row as vLLM with the deepseek_r1 parser returns the tiny target's answer."""
    row = {
        "id": sample_id,
        "reasoning": f"I need to add {i} and {i + 7}. So the sum is {2 * i + 7}.\n",
        "content": f"\n\nThe answer is {2 * i + 7}.",
        "reasoning_field": "reasoning",
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "latency_s": 0.05,
        "server": "http://127.0.0.1:8000",
        "model": "tiny-target",
        "attempts": 1,
        "error": None,
    }
    row.update(overrides)
    return row


def write_shard(data_dir, prompts: list[tuple[str, list[dict]]], raw_rows: list[dict], shard: str = SHARD) -> None:
    prompt_frame = pl.DataFrame(
        [{"row_index": n, "id": sample_id, "messages": messages} for n, (sample_id, messages) in enumerate(prompts)], schema=PROMPTS_SCHEMA
    )
    write_parquet_atomic(asset_dir("prompts", data_dir) / f"{shard}.parquet", prompt_frame)
    write_parquet_atomic(asset_dir("raw_responses", data_dir) / f"{shard}.parquet", pl.DataFrame(raw_rows, schema=RAW_RESPONSES_SCHEMA))


def run(assets, tiny_target, run_config: dict | None = None, shard: str = SHARD):
    instance = DagsterInstance.ephemeral()
    register_shards(instance, [shard])
    result = materialize(
        assets,
        partition_key=shard,
        resources={"target_model": TargetModel(path=str(tiny_target))},
        run_config={"ops": {"validated_traces": {"config": run_config}}} if run_config else None,
        instance=instance,
        raise_on_error=False,
    )
    return result, instance


def checks_of(result) -> dict:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


@pytest.fixture(scope="module")
def renderer(tiny_target):
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_target))


# -- the asset ---------------------------------------------------------------------


def test_mixed_shard_keeps_good_rows_and_rejects_each_bad_one_with_its_reason(data_dir, tiny_target, renderer):
    long_reasoning = "I need to add 5 and 12. " * 40 + "So the sum is 17.\n"
    prompts = [(f"p{i}", multi_turn(i) if i == 1 else question(i)) for i in range(9)]
    prompts[5] = ("p5", question(0))  # same question as p0, answered identically below
    raw = [
        response("p0", 0),
        response("p1", 1),
        response("p2", 2, content=None, finish_reason="length"),
        response("p3", 3, reasoning=None, content=None, finish_reason=None, error="ReadTimeout after 1800 s"),
        response("p4", 4, content="</think>\n\nThe answer is 15."),
        response("p5", 0),
        response("p6", 5, reasoning=long_reasoning),
        response("p7", 7, finish_reason="abort"),
        response("p8", 8, reasoning="  \n", reasoning_field="reasoning_content"),
    ]
    write_shard(data_dir, prompts, raw)
    result, _ = run([validated_traces], tiny_target, {"max_seq_len": 150, "min_reasoning_share": 0.7, "max_request_error_share": 0.2})
    assert result.success

    kept = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.parquet")
    assert kept.schema == pl.Schema(KEPT_SCHEMA)
    assert kept["id"].to_list() == ["p0", "p1"]
    assert kept["num_tokens"].to_list() == kept["input_ids"].list.len().to_list()
    assert kept.filter(pl.col("id") == "p1")["messages"].to_list()[0] == multi_turn(1)
    rejected = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.rejected.parquet")
    assert rejected.schema == pl.Schema(REJECTED_SCHEMA)
    assert dict(zip(rejected["id"], rejected["reason"])) == {
        "p2": "truncated",
        "p3": "request_error",
        "p4": "think_markers_left",
        "p5": "duplicate_response",
        "p6": "too_long",
        "p7": "not_stopped",
        "p8": "empty_reasoning",
    }
    details = dict(zip(rejected["id"], rejected["detail"]))
    assert details["p3"] == "ReadTimeout after 1800 s" and details["p7"] == "finish_reason=abort"
    assert details["p8"] == "reasoning_field=reasoning_content" and details["p6"].endswith("> max_seq_len 150")

    # the kept rows are exactly what the renderer makes of them, mask included
    for row in kept.iter_rows(named=True):
        original = next(r for r in raw if r["id"] == row["id"])
        trace = renderer.render(row["messages"], original["reasoning"], original["content"])
        assert row["input_ids"] == trace.input_ids and row["loss_mask"] == trace.loss_mask

    checks = checks_of(result)
    for name in ("traces_present", "reasoning_present", "responses_accounted", "loss_mask_aligned", "request_errors_rare"):
        assert checks[name].passed, (name, checks[name].description)
    # reasoning is counted over the 8 rows that got a response: p3's request error is not "no reasoning"
    reasoning = checks["reasoning_present"].metadata
    assert reasoning["reasoning_share"].value == pytest.approx(7 / 8) and reasoning["threshold"].value == 0.7
    assert reasoning["offending_ids"].value == ["p8"] and reasoning["answered_rows"].value == 8
    errors = checks["request_errors_rare"]
    assert errors.metadata["request_error_share"].value == pytest.approx(1 / 9) and errors.metadata["offending_ids"].value == ["p3"]
    assert "1 of 9 requests ended in an error" in errors.description
    truncation = checks["truncation_rate_low"]
    assert not truncation.passed and truncation.metadata["truncation_rate"].value == pytest.approx(1 / 9)
    assert truncation.metadata["offending_ids"].value == ["p2"]
    markers = checks["think_markers_absent"]
    assert not markers.passed and markers.metadata["offending_ids"].value == ["p4"]

    (mat,) = result.asset_materializations_for_node("validated_traces")
    meta = mat.metadata
    assert meta["kept"].value == 2 and meta["rejected"].value == 7 and meta["raw_rows"].value == 9
    lengths = sorted(kept["num_tokens"].to_list())
    assert meta["tokens_max"].value == lengths[-1] and meta["tokens_p50"].value in lengths
    assert "█" in meta["token_length_histogram"].value
    assert meta["template_opens_think_block"].value is True and meta["think_markers"].value == ["<think>", "</think>"]
    assert mat.tags.get("dagster/data_version")


def test_allow_truncated_keeps_a_cut_answer_without_end_of_turn(data_dir, tiny_target):
    write_shard(data_dir, [("p0", question(0)), ("p1", question(1))], [response("p0", 0), response("p1", 1, content="\n\nThe ans", finish_reason="length")])
    result, _ = run([validated_traces], tiny_target, {"allow_truncated": True})
    assert result.success, checks_of(result)
    kept = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.parquet")
    assert kept["id"].to_list() == ["p0", "p1"]
    end_of_turn = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids("<|im_end|>")
    assert [ids[-1] == end_of_turn for ids in kept["input_ids"]] == [True, False]
    assert checks_of(result)["loss_mask_aligned"].passed


def test_shard_with_every_row_rejected_fails_its_gate_with_a_clear_message(data_dir, tiny_target):
    prompts = [(f"p{i}", question(i)) for i in range(3)]
    raw = [response(f"p{i}", i, reasoning=None, content=None, finish_reason=None, error="HTTP 500: engine dead") for i in range(3)]
    write_shard(data_dir, prompts, raw)
    result, _ = run([validated_traces], tiny_target)

    assert not result.success
    failures = [e for e in result.all_events if e.is_step_failure]
    assert len(failures) == 1
    error = failures[0].step_failure_data.error
    assert error.cls_name == "DagsterAssetCheckFailedError" and "traces_present" in error.message  # a gate, not a crash
    checks = checks_of(result)
    assert not checks["traces_present"].passed
    assert "every row of the shard was rejected" in checks["traces_present"].description
    assert "request_error" in checks["traces_present"].description
    assert checks["responses_accounted"].passed and checks["loss_mask_aligned"].passed  # nothing lost, nothing misaligned
    kept = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.parquet")
    assert kept.height == 0 and kept.schema == pl.Schema(KEPT_SCHEMA)
    assert pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.rejected.parquet")["reason"].to_list() == ["request_error"] * 3


def test_accounting_gate_catches_a_prompt_without_response(data_dir, tiny_target):
    write_shard(data_dir, [(f"p{i}", question(i)) for i in range(3)], [response("p0", 0), response("p2", 2)])
    result, _ = run([validated_traces], tiny_target)
    assert not result.success
    accounted = checks_of(result)["responses_accounted"]
    assert not accounted.passed
    assert accounted.metadata["offending_ids"].value == ["p1"] and accounted.metadata["missing_prompts"].value == 1
    assert "1 prompt(s) of the shard have no raw response" in accounted.description


def test_missing_raw_shard_fails_naming_the_file(data_dir, tiny_target):
    write_shard(data_dir, [("p0", question(0))], [response("p0", 0)])
    (data_dir / "raw_responses" / f"{SHARD}.parquet").unlink()
    result, _ = run([validated_traces], tiny_target)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert f"raw_responses/{SHARD}.parquet does not exist" in failure.step_failure_data.error.to_string()


# -- a blocking gate stops everything downstream of the shard ------------------------


@asset(partitions_def=sample_shards, group_name="extraction", deps=[validated_traces])
def downstream_of_traces(context: AssetExecutionContext) -> MaterializeResult:
    """Stands in for hidden_states: reads the shard's traces and writes a file of its own."""
    traces = pl.read_parquet(asset_dir("validated_traces") / f"{context.partition_key}.parquet")
    out = asset_dir("downstream_of_traces") / f"{context.partition_key}.parquet"
    write_parquet_atomic(out, traces.select("id", "num_tokens"))
    return MaterializeResult(metadata={"rows": traces.height})


def test_blocking_gate_stops_downstream_assets_in_the_same_run(data_dir, tiny_target):
    """The story's failure: the client read `reasoning_content`, the server sent `reasoning`, every reasoning empty.

    One run selects validated_traces, the real hidden_states below it and a
    further downstream asset: the gate fails, and neither is even started.
    """
    from eagle3_assets.defs.hidden_states import hidden_states
    from resources.gpu_host import GPUHost

    write_shard(data_dir, [(f"p{i}", question(i)) for i in range(4)], [response(f"p{i}", i, reasoning=None, reasoning_field="none") for i in range(4)])
    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    result = materialize(
        [validated_traces, hidden_states, downstream_of_traces],
        partition_key=SHARD,
        resources={"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()},
        instance=instance,
        raise_on_error=False,
    )

    assert not result.success
    gate = checks_of(result)["reasoning_present"]
    assert not gate.passed and gate.metadata["reasoning_share"].value == 0.0 and gate.metadata["threshold"].value == 0.98
    assert gate.metadata["offending_ids"].value == ["p0", "p1", "p2", "p3"]
    assert "{'none': 4}" in gate.description  # names the response field the rows came from
    assert result.asset_materializations_for_node("validated_traces")  # the shard is recorded for inspection...
    for below in ("hidden_states", "downstream_of_traces"):  # ...but nothing below it
        assert instance.get_latest_materialization_event(AssetKey(below)) is None, below
        assert not (data_dir / below).exists(), below
    started = [e.step_key for e in result.all_events if e.event_type_value == "STEP_START"]
    assert started == ["validated_traces"]


def test_passing_gates_let_the_same_selection_build_downstream(data_dir, tiny_target):
    """The control for the test above: the same kind of run, with reasoning, builds the asset below."""
    write_shard(data_dir, [(f"p{i}", question(i)) for i in range(4)], [response(f"p{i}", i) for i in range(4)])
    result, instance = run([validated_traces, downstream_of_traces], tiny_target)
    assert result.success
    assert instance.get_latest_materialization_event(AssetKey("downstream_of_traces")) is not None
    assert pl.read_parquet(data_dir / "downstream_of_traces" / f"{SHARD}.parquet").height == 4


# -- the core, without Dagster -------------------------------------------------------


def test_alignment_gate_reads_the_written_file_and_catches_a_shifted_mask(tmp_path, renderer):
    prompts_path, raw_path = tmp_path / "p.parquet", tmp_path / "r.parquet"
    kept_path, rejected_path = tmp_path / "k.parquet", tmp_path / "x.parquet"
    pl.DataFrame([{"row_index": i, "id": f"p{i}", "messages": multi_turn(i)} for i in range(3)], schema=PROMPTS_SCHEMA).write_parquet(prompts_path)
    pl.DataFrame([response(f"p{i}", i) for i in range(3)], schema=RAW_RESPONSES_SCHEMA).write_parquet(raw_path)
    summary = validate_shard(raw_path, prompts_path, renderer, ValidationRules(max_seq_len=4096), kept_path, rejected_path, batch_rows=2)
    assert summary.kept == 3 and summary.prompts_opening_think_block == 3
    alignment = mask_alignment_problems(kept_path, raw_path, renderer)
    assert (alignment.rows_checked, alignment.rows_checked_against_server_ids, alignment.problems) == (3, 0, {})

    kept = pl.read_parquet(kept_path)
    shifted = kept.with_columns(pl.when(pl.col("id") == "p1").then(pl.col("loss_mask").list.shift(1).list.eval(pl.element().fill_null(0))).otherwise(pl.col("loss_mask")).alias("loss_mask"))
    shifted.write_parquet(kept_path)
    alignment = mask_alignment_problems(kept_path, raw_path, renderer)
    assert alignment.rows_checked == 3 and list(alignment.problems) == ["p1"] and "supervision starts at token" in alignment.problems["p1"]


def test_prompt_the_template_refuses_is_rejected_not_fatal(tmp_path, tiny_target):
    from eagle3_assets.demo.tiny_target import CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('must start with a user turn') }}{% endif %}" + CHAT_TEMPLATE
    strict = ChatRenderer(tokenizer)
    prompts_path, raw_path = tmp_path / "p.parquet", tmp_path / "r.parquet"
    messages = [question(0), [{"role": "assistant", "content": "Hello."}, *question(1)], question(2)]
    pl.DataFrame([{"row_index": i, "id": f"p{i}", "messages": m} for i, m in enumerate(messages)], schema=PROMPTS_SCHEMA).write_parquet(prompts_path)
    pl.DataFrame([response(f"p{i}", i) for i in range(3)], schema=RAW_RESPONSES_SCHEMA).write_parquet(raw_path)
    summary = validate_shard(raw_path, prompts_path, strict, ValidationRules(max_seq_len=4096), tmp_path / "k.parquet", tmp_path / "x.parquet")
    assert summary.kept == 2 and summary.rejected_by_reason == {"template_error": 1}
    assert pl.read_parquet(tmp_path / "k.parquet")["id"].to_list() == ["p0", "p2"]
    (rejected,) = pl.read_parquet(tmp_path / "x.parquet").to_dicts()
    assert rejected["id"] == "p1" and "must start with a user turn" in rejected["detail"]


def test_bad_raw_file_is_named_with_what_is_wrong(tmp_path, renderer):
    prompts_path, raw_path = tmp_path / "p.parquet", tmp_path / "r.parquet"
    pl.DataFrame([{"row_index": 0, "id": "p0", "messages": question(0)}], schema=PROMPTS_SCHEMA).write_parquet(prompts_path)
    pl.DataFrame({"id": ["p0"], "reasoning_content": ["x"]}).write_parquet(raw_path)
    with pytest.raises(ValidationInputError, match=r"raw_responses: .*r\.parquet lacks column\(s\) \['reasoning', 'content'"):
        validate_shard(raw_path, prompts_path, renderer, ValidationRules(max_seq_len=64), tmp_path / "k.parquet", tmp_path / "x.parquet")


def test_reasoning_gate_threshold_is_inclusive_and_names_the_response_field():
    ids_without = [f"q{i}" for i in range(2)]
    assert check_reasoning_present(100, ids_without, 0.98).passed
    failed = check_reasoning_present(100, [*ids_without, "q2"], 0.98, {"reasoning": 97, "none": 3})
    assert not failed.passed and failed.figure == pytest.approx(0.97) and failed.threshold == 0.98
    assert "'none': 3" in failed.description
    assert not check_reasoning_present(0, [], 0.98).passed  # an empty shard is not a healthy one


def test_accounting_gate_catches_duplicates_foreign_and_lost_rows():
    ok = check_responses_accounted(["a", "b"], ["a", "b"], ["a"], ["b"])
    assert ok.passed and ok.figure == 0
    dup = check_responses_accounted(["a", "b", "a"], ["a", "b"], ["a", "b"], ["a"])
    assert not dup.passed and dup.counts["duplicate_ids"] == 1
    foreign = check_responses_accounted(["a", "z"], ["a"], ["a"], ["z"])
    assert not foreign.passed and foreign.offending_ids == ["z"]
    lost = check_responses_accounted(["a", "b"], ["a", "b"], ["a"], [])
    assert not lost.passed and lost.offending_ids == ["b"]


def test_offending_ids_are_capped_at_ten():
    outcome = check_truncation_rate_low(100, [f"q{i}" for i in range(30)], 0.05)
    assert not outcome.passed and len(outcome.offending_ids) == 10 and outcome.figure == pytest.approx(0.3)


def test_token_length_statistics_and_histogram():
    lengths = list(range(1, 101))
    assert token_length_stats(lengths) == {"p50": 50, "p95": 95, "max": 100, "mean": 50.5}
    table = token_length_histogram_markdown(lengths, bins=4)
    rows = table.splitlines()[2:]
    assert [r.split("|")[2].strip() for r in rows] == ["25"] * 4 and rows[0].startswith("| 1–25 |")
    assert token_length_histogram_markdown([]) == "_no kept traces_"


# -- one rule for what a rerun re-sends and what validation rejects ------------------


def test_generation_and_validation_share_one_content_failure_rule(tmp_path, renderer):
    from eagle3_assets.core.generation.response_rules import RETRYABLE_CONTENT_REASONS, content_failures

    rows = [
        response("ok", 0),
        response("cut", 1, content=None, finish_reason="length"),
        response("cut-with-answer", 2, finish_reason="length"),
        response("aborted", 3, finish_reason="abort"),
        response("no-finish", 4, finish_reason=None),
        response("no-reasoning", 5, reasoning="  ", reasoning_field="none"),
        response("no-answer", 6, content="\n"),
        response("failed", 7, reasoning=None, content=None, finish_reason=None, error="http 503: busy"),
        response("markers", 8, content="</think> 15"),
    ]
    prompts_path, raw_path = tmp_path / "p.parquet", tmp_path / "r.parquet"
    pl.DataFrame([{"row_index": i, "id": r["id"], "messages": question(i)} for i, r in enumerate(rows)], schema=PROMPTS_SCHEMA).write_parquet(prompts_path)
    pl.DataFrame(rows, schema=RAW_RESPONSES_SCHEMA).write_parquet(raw_path)
    for allow_truncated in (False, True):
        retried = content_failures(rows, allow_truncated)
        validate_shard(raw_path, prompts_path, renderer, ValidationRules(4096, allow_truncated), tmp_path / "k.parquet", tmp_path / "x.parquet")
        rejected = dict(pl.read_parquet(tmp_path / "x.parquet").select("id", "reason").iter_rows())
        # exactly the rows validation rejects for a reason a new generation can fix are the ones a rerun sends again
        assert retried == {i: r for i, r in rejected.items() if r in RETRYABLE_CONTENT_REASONS}, allow_truncated
        assert rejected["failed"] == "request_error" and rejected["markers"] == "think_markers_left"
    assert content_failures(rows, allow_truncated=False) == {
        "cut": "truncated", "cut-with-answer": "truncated", "aborted": "not_stopped", "no-finish": "not_stopped",
        "no-reasoning": "empty_reasoning", "no-answer": "empty_content",
    }  # fmt: skip
    assert content_failures(rows, allow_truncated=True) == {
        "cut": "empty_content", "aborted": "not_stopped", "no-finish": "not_stopped", "no-reasoning": "empty_reasoning", "no-answer": "empty_content",
    }  # fmt: skip


def test_prompts_too_long_are_rejected_with_their_reason_and_block_nothing_by_themselves(data_dir, tiny_target):
    too_long = "prompt_too_long: 5012 prompt tokens >= max_model_len 4096; not sent"
    prompts = [(f"p{i}", question(i)) for i in range(8)] + [(f"long{i}", question(50 + i)) for i in range(3)]
    raw = [response(f"p{i}", i) for i in range(8)]
    raw += [response(f"long{i}", 50 + i, reasoning=None, content=None, reasoning_field="none", finish_reason=None, attempts=0, server="", error=too_long) for i in range(3)]
    write_shard(data_dir, prompts, raw)
    result, _ = run([validated_traces], tiny_target)
    assert result.success  # 3 over-long prompts of 11 do not block the shard

    checks = checks_of(result)
    reasoning = checks["reasoning_present"]
    assert reasoning.passed and reasoning.metadata["answered_rows"].value == 8 and reasoning.metadata["reasoning_share"].value == 1.0
    assert checks["request_errors_rare"].passed and checks["request_errors_rare"].metadata["requests"].value == 8
    fit = checks["prompts_fit_context"]
    assert not fit.passed and fit.severity.value == "WARN" and fit.metadata["offending_ids"].value == ["long0", "long1", "long2"]
    assert "longer than the server's context" in fit.description and "--max-model-len" in fit.description
    rejected = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.rejected.parquet")
    assert dict(zip(rejected["id"], rejected["reason"])) == {f"long{i}": "prompt_too_long" for i in range(3)}
    assert set(rejected["detail"]) == {too_long}


def test_request_errors_have_their_own_gate_and_text(data_dir, tiny_target):
    prompts = [(f"p{i}", question(i)) for i in range(10)]
    raw = [response(f"p{i}", i) for i in range(8)]
    raw += [response(f"p{i}", i, reasoning=None, content=None, reasoning_field="none", finish_reason=None, error="http 503: overloaded (after 6 attempts)") for i in (8, 9)]
    write_shard(data_dir, prompts, raw)
    result, _ = run([validated_traces], tiny_target)
    assert not result.success
    checks = checks_of(result)
    assert checks["reasoning_present"].passed  # errors are not "no reasoning": the parser is not blamed
    errors = checks["request_errors_rare"]
    assert not errors.passed and errors.metadata["offending_ids"].value == ["p8", "p9"]
    assert "2 of 10 requests ended in an error" in errors.description and "{'http 503': 2}" in errors.description
    assert "not the model" in errors.description and "materialise the shard again" in errors.description


# -- the server's own ids (vLLM's return_token_ids) ----------------------------------


def test_rows_are_checked_against_the_servers_ids_where_the_raw_rows_carry_them(data_dir, tiny_target, renderer):
    """Recorded ids as vLLM returns them: the rendering must be them token by token, not just decode to the same text."""
    prompts = [(f"p{i}", question(i)) for i in range(5)]
    raw = [response(f"p{i}", i) for i in range(5)]
    for row, (_, messages) in zip(raw, prompts):
        trace = renderer.render(messages, row["reasoning"], row["content"])
        row["prompt_token_ids"], row["output_token_ids"] = trace.prompt_ids, trace.completion_ids
    # p1: the target sampled a split of the same text that re-tokenisation would not make (" sum" as " s" + "um")
    ids = raw[1]["output_token_ids"]
    sum_token = renderer.tokenizer(" sum", add_special_tokens=False)["input_ids"]
    split = renderer.tokenizer(" s", add_special_tokens=False)["input_ids"] + renderer.tokenizer("um", add_special_tokens=False)["input_ids"]
    assert len(sum_token) == 1 and len(split) == 2
    at = ids.index(sum_token[0])
    raw[1]["output_token_ids"] = ids[:at] + split + ids[at + 1 :]
    assert renderer.decode(raw[1]["output_token_ids"]) == renderer.decode(ids)  # the text cannot tell
    # p2: finished, but the ids do not end on the end-of-turn token (e.g. it stopped on a stop string)
    raw[2]["output_token_ids"] = raw[2]["output_token_ids"][:-1]
    # p3: the server rendered another prompt (e.g. a system prompt its chat template adds)
    raw[3]["prompt_token_ids"] = renderer.tokenizer("<|im_start|>system\nBe brief.<|im_end|>\n", add_special_tokens=False)["input_ids"] + raw[3]["prompt_token_ids"]
    # p4: a server that returns no ids (SGLang): the text-only path
    raw[4]["prompt_token_ids"] = raw[4]["output_token_ids"] = None
    write_shard(data_dir, prompts, raw)
    result, _ = run([validated_traces], tiny_target)
    assert result.success, checks_of(result)

    rejected = {r["id"]: r for r in pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.rejected.parquet").iter_rows(named=True)}
    assert {i: r["reason"] for i, r in rejected.items()} == {"p1": "tokens_differ", "p2": "tokens_differ", "p3": "prompt_differs"}
    assert f"completion token {at} of {len(ids) + 1} (ours: {len(ids)}): server {split[0]} ' s', ours {sum_token[0]} ' sum'" in rejected["p1"]["detail"]
    assert f"completion token {len(ids) - 1} of {len(ids) - 1} (ours: {len(ids)}): server <none: sequence ended>, ours" in rejected["p2"]["detail"]
    assert "'<|im_end|>'" in rejected["p2"]["detail"]
    assert "prompt token 1 of " in rejected["p3"]["detail"] and "server " in rejected["p3"]["detail"]
    kept = pl.read_parquet(data_dir / "validated_traces" / f"{SHARD}.parquet")
    assert kept["id"].to_list() == ["p0", "p4"]
    p0 = kept.row(0, named=True)
    assert p0["input_ids"] == raw[0]["prompt_token_ids"] + raw[0]["output_token_ids"]

    checks = checks_of(result)
    aligned = checks["loss_mask_aligned"]
    assert aligned.passed and aligned.metadata["rows_checked"].value == 2 and aligned.metadata["rows_checked_against_server_ids"].value == 1
    assert "all 2 kept rows aligned (1 of them token by token against the server's output_token_ids)" == aligned.description
    (mat,) = result.asset_materializations_for_node("validated_traces")
    assert mat.metadata["kept_with_server_ids"].value == 1
    assert set(mat.metadata["rejection_reasons"].value) == {"tokens_differ", "prompt_differs"}


def test_a_gates_outcome_reaches_dagster_through_the_one_adapter_and_over_pipes():
    from dagster import AssetCheckSeverity

    from eagle3_assets.core.reporting.checks import CheckOutcome
    from eagle3_assets.core.validation.gates import check_truncation_rate_low
    from eagle3_assets.defs.validated_traces import CHECKS

    outcome = check_truncation_rate_low(10, ["q1", "q2"], 0.05)
    assert (outcome.name, outcome.passed, outcome.figure, outcome.threshold, outcome.offending_ids) == ("truncation_rate_low", False, 0.2, 0.05, ["q1", "q2"])
    result = CHECKS.result(outcome)  # the severity is the table's: truncation_rate_low is advisory
    assert (result.check_name, result.passed, result.severity, result.description) == ("truncation_rate_low", False, AssetCheckSeverity.WARN, outcome.description)
    assert result.metadata["truncation_rate"].value == 0.2 and result.metadata["offending_ids"].value == ["q1", "q2"]
    sent = outcome.pipes_metadata()  # what a GPU stage reports
    assert sent["summary"] == outcome.description and sent["offending_ids"] == {"raw_value": ["q1", "q2"], "type": "json"}
    back = CheckOutcome.from_pipes(outcome.name, outcome.passed, {**sent, "offending_ids": ["q1", "q2"]})
    assert (back.description, back.offending_ids, back.metadata["truncated_rows"]) == (outcome.description, ["q1", "q2"], 2)


def test_a_stray_think_marker_is_rejected_but_only_a_common_one_blames_the_parser():
    """One sampled row in 64 with a marker left is the model's doing (the row is rejected either way); a parser that is
    not the target's leaves markers in most rows, and that is what the gate warns about."""
    from eagle3_assets.core.validation.gates import check_think_markers_absent

    markers = ["<think>", "</think>"]
    stray = check_think_markers_absent(64, ["r7"], markers)
    assert stray.passed and "rejected as think_markers_left" in stray.description
    assert stray.metadata["rows_with_think_markers"] == 1 and stray.offending_ids == ["r7"]
    wrong_parser = check_think_markers_absent(64, [f"r{i}" for i in range(60)], markers)
    assert not wrong_parser.passed and "is the server's reasoning parser the target's?" in wrong_parser.description
    assert wrong_parser.figure == 60 / 64 and wrong_parser.threshold == 0.05
    assert check_think_markers_absent(64, [], markers).passed
