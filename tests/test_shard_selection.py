"""Ramp-up and subsets: a sample cap that registers only the shards it needs, retired shards, and training on the green ones.

A shard whose validated traces failed a blocking gate is left out of
``vocab_mapping`` and ``draft_checkpoint`` (their metadata say which and why)
instead of blocking training for good; the raw shards are recorded the way
generation writes them (tests/test_validation.py), so validation and its gates
run for real without a vLLM server; the training and its export gates do run
vLLM.
"""

import json

import pytest
from dagster import AssetKey, DagsterInstance, RunConfig, build_sensor_context, materialize

from eagle3_assets.core.planning.shard_selection import BLOCKED, GREEN, MISSING, ShardSelectionError, ShardVerdict, select_shards
from eagle3_assets.core.prompts.retired import retired_shards
from eagle3_assets.glue.partitions import SAMPLE_SHARDS, register_shards
from eagle3_assets.retire import main as retire_main
from eagle3_assets.defs.retire_shards import retire_shards_job
from resources.prompt_dataset import PromptDataset
from sensors.new_shards import new_prompt_shards
from tests.test_validation import question, response, write_shard

KEYS = ["shard-00000", "shard-00001", "shard-00002"]


def write_dataset(path, rows: int):
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"question {i}?"}) + "\n" for i in range(rows)))
    return path


def tick(instance, dataset, cursor=None):
    result = new_prompt_shards(build_sensor_context(instance=instance, cursor=cursor, resources={"prompt_dataset": dataset}))
    for request in getattr(result, "dynamic_partitions_requests", None) or []:
        instance.add_dynamic_partitions(SAMPLE_SHARDS, list(request.partition_keys))
    return result


# -- the cap -------------------------------------------------------------------------------


def test_a_sample_cap_registers_only_the_shards_it_fills_and_raising_it_adds_the_next(tmp_path, monkeypatch):
    path = write_dataset(tmp_path / "d.jsonl", 20)
    assert PromptDataset(source=str(path), shard_size=4, max_samples=5).shard_keys() == ["shard-00000", "shard-00001"]  # rounded up to whole shards
    monkeypatch.setenv("EAGLE3_MAX_SAMPLES", "4")
    assert PromptDataset.from_env(source=str(path), shard_size=4).max_samples == 4

    instance = DagsterInstance.ephemeral()
    first = tick(instance, PromptDataset(source=str(path), shard_size=4, max_samples=4))
    assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == ["shard-00000"]
    # The same file, a raised cap: the sensor looks again and adds only the new shards.
    second = tick(instance, PromptDataset(source=str(path), shard_size=4, max_samples=12), first.cursor)
    assert [list(r.partition_keys) for r in second.dynamic_partitions_requests] == [["shard-00001", "shard-00002"]]
    third = tick(instance, PromptDataset(source=str(path), shard_size=4), second.cursor)  # no cap: every row
    assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == [f"shard-0000{i}" for i in range(5)]
    assert "unchanged since the last look" in tick(instance, PromptDataset(source=str(path), shard_size=4), third.cursor).skip_message

    with pytest.raises(ValueError, match="greater than 0"):
        PromptDataset(source=str(path), max_samples=0)


# -- retiring ------------------------------------------------------------------------------


def test_a_retired_shard_keeps_its_files_is_recorded_and_never_registered_again(tmp_path, data_dir):
    path = write_dataset(tmp_path / "d.jsonl", 12)
    dataset = PromptDataset(source=str(path), shard_size=4)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    kept = data_dir / "validated_traces" / "shard-00001.parquet"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"stands for the shard's files")

    # The UI's way: the retire_shards job, with the shards and the reason as its config.
    result = retire_shards_job.execute_in_process(
        instance=instance, run_config={"ops": {"retire_shards_op": {"config": {"shards": ["shard-00001"], "reason": "prompts scraped twice"}}}}
    )
    assert result.success
    assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == ["shard-00000", "shard-00002"]
    assert kept.read_bytes() == b"stands for the shard's files"
    record = retired_shards()["shard-00001"]
    assert record["reason"] == "prompts scraped twice" and record["retired_at"] and record["retired_by"]
    assert any("retired ['shard-00001'] (prompts scraped twice); files kept" in (e.user_message or "") for e in instance.all_logs(result.run_id))

    # Neither the sensor nor a registration brings it back.
    assert "no new shards" in tick(instance, dataset).skip_reason.skip_message
    assert register_shards(instance, dataset.shard_keys()) == []

    with pytest.raises(ValueError, match="needs a reason"):
        retire_shards_job.execute_in_process(instance=instance, run_config={"ops": {"retire_shards_op": {"config": {"shards": ["shard-00002"]}}}})


def test_the_retire_command_retires_lists_and_restores(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    (tmp_path / "dagster_home").mkdir()
    with DagsterInstance.get() as instance:
        register_shards(instance, KEYS)
    assert retire_main(["shard-00002", "--reason", "a bad batch"]) == 0
    assert "retired ['shard-00002'] (a bad batch); files kept" in capsys.readouterr().out
    assert retire_main(["--list"]) == 0
    assert capsys.readouterr().out.startswith("shard-00002\ta bad batch\t")
    with DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == KEYS[:2]
    assert retire_main(["shard-00002", "--restore"]) == 0
    with DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions(SAMPLE_SHARDS) == KEYS
    assert retired_shards() == {}
    assert retire_main(["shard-7"]) == 2 and "not a shard key" in capsys.readouterr().err
    assert retire_main(["shard-00001"]) == 2 and "needs a reason" in capsys.readouterr().err


# -- the selection rule --------------------------------------------------------------------


def test_the_green_shards_are_used_and_every_other_is_left_out_with_why():
    verdicts = {
        "shard-00000": [("validated_traces", ShardVerdict(GREEN)), ("hidden_states", ShardVerdict(GREEN))],
        "shard-00001": [("validated_traces", ShardVerdict(BLOCKED, "reasoning_present failed (3 of 3 rows lack reasoning)"))],
        "shard-00002": [("validated_traces", ShardVerdict(GREEN)), ("hidden_states", ShardVerdict(MISSING, "no output yet"))],
    }
    selection = select_shards(KEYS, verdicts, retired={"shard-00009": {"reason": "duplicate source"}})
    assert selection.used == ["shard-00000"]
    assert selection.left_out == {
        "shard-00009": "retired: duplicate source",
        "shard-00001": "validated_traces blocked: reasoning_present failed (3 of 3 rows lack reasoning)",
        "shard-00002": "hidden_states missing: no output yet",
    }
    named = select_shards(KEYS, verdicts, named=["shard-00000"])
    assert named.used == ["shard-00000"] and named.left_out["shard-00002"] == "not in the named list"
    with pytest.raises(ShardSelectionError, match="shard-00001: validated_traces blocked: reasoning_present failed"):
        select_shards(KEYS, verdicts, named=["shard-00000", "shard-00001"])
    with pytest.raises(ShardSelectionError, match="no shard is green"):
        select_shards(KEYS[1:], verdicts)


# -- through Dagster: a blocked shard left out of training --------------------------------


def validated_shards(data_dir, tiny_target) -> DagsterInstance:
    """Three recorded shards through validated_traces; shard-00001's responses all lack their reasoning (the story's bug)."""
    from eagle3_assets.defs.validated_traces import validated_traces
    from resources.target_model import TargetModel

    instance = DagsterInstance.ephemeral()
    register_shards(instance, KEYS)
    for n, key in enumerate(KEYS):
        prompts = [(f"{key}-p{i}", question(10 * n + i)) for i in range(8)]
        raw = [response(sample_id, 10 * n + i, **({"reasoning": None} if key == "shard-00001" else {})) for i, (sample_id, _) in enumerate(prompts)]
        write_shard(data_dir, prompts, raw, shard=key)
        materialize([validated_traces], partition_key=key, resources={"target_model": TargetModel(path=str(tiny_target))}, instance=instance, raise_on_error=False)
    return instance


def materialization(instance, asset: str) -> dict:
    return instance.get_latest_materialization_event(AssetKey(asset)).asset_materialization.metadata


def test_a_blocked_shard_is_left_out_of_the_vocabulary_with_its_reason(data_dir, tiny_target):
    from eagle3_assets.defs.vocab_mapping import VocabMappingConfig, vocab_mapping
    from resources.target_model import TargetModel

    instance = validated_shards(data_dir, tiny_target)
    result = materialize(
        [vocab_mapping],
        resources={"target_model": TargetModel(path=str(tiny_target))},
        instance=instance,
        run_config=RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=64)}),
        raise_on_error=False,
    )
    assert result.success
    metadata = materialization(instance, "vocab_mapping")
    assert metadata["shards_used"].value == ["shard-00000", "shard-00002"] and metadata["samples"].value == 16
    (reason,) = metadata["shards_left_out"].value.values()
    assert list(metadata["shards_left_out"].value) == ["shard-00001"]
    assert reason.startswith("validated_traces blocked: traces_present failed (every row of the shard was rejected") and "empty_reasoning" in reason
    assert "; reasoning_present failed (0 of 8 answered rows have reasoning" in reason

    # Named: exactly those; a blocked one named is refused, naming it.
    named = materialize(
        [vocab_mapping], resources={"target_model": TargetModel(path=str(tiny_target))}, instance=instance,
        run_config=RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=64, shards=["shard-00001"])}), raise_on_error=False,
    )  # fmt: skip
    assert not named.success
    (failure,) = [e for e in named.all_events if e.is_step_failure]
    assert "the named shards cannot all be trained on: shard-00001: validated_traces blocked: traces_present failed" in failure.step_failure_data.error.to_string()


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_a_blocked_shard_is_left_out_of_training_with_its_reason(data_dir, tiny_target):
    """The green shards' states are extracted and trained on; the blocked shard waits for nothing and is listed with why."""
    from eagle3_assets.defs.draft_checkpoint import DraftTrainingConfig, draft_checkpoint
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
    from eagle3_assets.defs.vocab_mapping import VocabMappingConfig, vocab_mapping
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    instance = validated_shards(data_dir, tiny_target)
    resources = {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()}
    for key in ("shard-00000", "shard-00002"):
        states = materialize(
            [hidden_states], partition_key=key, resources=resources, instance=instance,
            run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(cpu_threads=1)}), raise_on_error=False,
        )  # fmt: skip
        assert states.success, key
    training = DraftTrainingConfig(epochs=2, learning_rate=3e-3, ttt_steps=2, batch_tokens=512, max_seq_len=128, vllm_check_num_speculative_tokens=2)
    result = materialize(
        [vocab_mapping, draft_checkpoint], resources=resources, instance=instance,
        run_config=RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=64), "draft_checkpoint": training}), raise_on_error=False,
    )  # fmt: skip
    logs = [entry.user_message for entry in instance.all_logs(result.run_id) if entry.user_message]
    assert result.success, "\n".join(logs[-30:])
    metadata = materialization(instance, "draft_checkpoint")
    assert metadata["shards_used"].value == ["shard-00000", "shard-00002"] and metadata["shards"].value == 2
    assert list(metadata["shards_left_out"].value) == ["shard-00001"]
    assert "validated_traces blocked: traces_present failed" in metadata["shards_left_out"].value["shard-00001"]
    assert {e.check_name: e.passed for e in result.get_asset_check_evaluations()}["loads_in_vllm"]
