"""The capacity plan: the whole run's disk and GPU time, and ``hidden_states`` refusing a run that cannot fit before its first shard.

The plan's arithmetic is checked on the story's figures; the refusal through
Dagster on a real registered run too large for this machine's disk (the
number of shards is chosen from the free space measured here, so the run is
always several times the disk), with the same machinery passing once the run
is capped to what fits.
"""

import re
from dataclasses import replace

import polars as pl
import pytest
from dagster import DagsterInstance, RunConfig, build_asset_context, materialize

from eagle3_assets.glue.capacity_facts import refuse_unless_run_fits, volume_at
from eagle3_assets.defs.capacity_plan import capacity_plan
from eagle3_assets.core.extraction.state_layout import FP8_DTYPE, bytes_per_token
from eagle3_assets.core.planning.capacity import PlanSettings, ShardFacts, Volume, checkpoint_bytes, human, plan_capacity
from eagle3_assets.core.planning.gates import CAPACITY_GATES, check_run_fits
from eagle3_assets.core.planning.stage_rates import Rate, measured_rate
from eagle3_assets.core.prompts.loading import PROMPTS_SCHEMA
from eagle3_assets.core.storage.files import asset_dir, write_parquet_atomic
from eagle3_assets.demo.validated_traces import write_validated_traces
from eagle3_assets.glue.partitions import register_shards
from resources.gpu_host import GPUHost
from resources.prompt_dataset import PromptDataset
from resources.target_model import TargetModel
from tests.test_gpu_host import sshd  # noqa: F401  (the real sshd fixture)

TB = 10**12
UNKNOWN = {"generation": Rate(None, "-"), "extraction": Rate(None, "-"), "training": Rate(None, "-")}


def story_shards(prompts: int = 10_000, shard_size: int = 128) -> list[ShardFacts]:
    return [ShardFacts(f"shard-{i:05d}", min(shard_size, prompts - i * shard_size)) for i in range(-(-prompts // shard_size))]


def disk(free: int, device: str = "") -> Volume:
    return Volume("GPU host", "/data", free, device=device)


# -- the plan's figures ----------------------------------------------------------------


def test_the_story_run_projects_its_states_from_tokens_and_bytes_per_token():
    settings = PlanSettings(hidden_size=7168, sample_tokens=4000, draft_parameters=1_000_000)
    plan = plan_capacity(story_shards(), settings, disk(3 * TB), Volume("data volume", "/srv", 3 * TB), UNKNOWN)
    assert plan.shards == 79 and plan.tokens == 10_000 * 4000
    assert bytes_per_token(7168, "bfloat16") == 8 * 7168 + 9
    assert plan.states_bytes == plan.states_bytes_to_write == 40_000_000 * (8 * 7168 + 9)  # 2.29 TB: the "about 2.3 TB"
    assert plan.states_to_write_8bit == 40_000_000 * bytes_per_token(7168, FP8_DTYPE) < plan.states_bytes * 0.51
    assert plan.checkpoint_bytes == checkpoint_bytes(1_000_000, 2) == 1_000_000 * (12 * 2 + 2)
    assert plan.fits and plan.states_refusal() is None
    assert plan.epochs == 10  # fitted to 40 M tokens: 16k-token batches, 2,442 steps an epoch, the default 10 epochs
    assert [n.volume.name for n in plan.needs] == ["GPU host", "data volume"]  # two disks: each its own items
    assert set(plan.needs[0].items) == {"hidden states", "checkpoints"} and set(plan.needs[1].items) == {"raw responses + traces"}


def test_measured_shards_replace_the_configured_mean_and_what_is_done_is_not_needed_again():
    shards = [
        ShardFacts("shard-00000", 10, validated_tokens=1000, completion_tokens=600, responses_bytes=20_000, states_bytes=5_000_000),
        ShardFacts("shard-00001", 10, validated_tokens=3000, completion_tokens=1800, responses_bytes=60_000),
        ShardFacts("shard-00002", 10),
    ]
    settings = PlanSettings(hidden_size=64, sample_tokens=99_999, epochs=10)
    rates = {
        "generation": measured_rate([(600, 6.0), (1800, 12.0)], "raw_responses"),
        "extraction": Rate(100.0, "configured"),
        "training": Rate(1000.0, "configured"),
    }
    plan = plan_capacity(shards, settings, disk(10**12, "d"), Volume("data volume", "/data", 10**12, device="d"), rates)
    assert plan.tokens_per_prompt == 200 and "measured over the validated traces of 2 shard(s)" in plan.tokens_per_prompt_source
    assert plan.tokens == 1000 + 3000 + 2000  # the unvalidated shard at the measured mean, not the configured one
    assert plan.tokens_to_extract == 3000 + 2000 and plan.states_bytes_on_disk == 5_000_000
    assert plan.responses_bytes_per_token == 20.0 and plan.responses_bytes_to_write == 2000 * 20
    assert plan.completion_tokens_to_generate == 10 * 120  # 2,400 generated tokens over 20 prompts
    assert rates["generation"].tokens_per_s == 2400 / 18
    assert plan.hours["generation"] == pytest.approx(1200 / (2400 / 18) / 3600)
    assert plan.hours["extraction"] == pytest.approx(5000 / 100 / 3600)
    assert plan.gpu_hours["training"] == pytest.approx(6000 * 10 / 1000 / 3600)  # every token, 10 epochs
    assert "UTC" in plan.eta() and plan.remaining_hours == pytest.approx(sum(plan.hours.values()))
    (one_disk,) = plan.needs  # the same device: one volume holds everything
    assert "one disk" in one_disk.volume.name and set(one_disk.items) == {"hidden states", "checkpoints", "raw responses + traces"}


def test_a_run_that_does_not_fit_is_refused_with_both_numbers_and_the_ways_out():
    settings = PlanSettings(hidden_size=7168, sample_tokens=4000, window_shards=2)
    plan = plan_capacity(story_shards(25_000), settings, disk(3 * TB), Volume("data volume", "/srv", 3 * TB), UNKNOWN)
    assert not plan.fits
    refusal = plan.states_refusal()
    need, free = map(int, re.search(r"\((\d+) > (\d+) bytes", refusal).groups())
    assert (need, free) == (100_000_000 * bytes_per_token(7168, "bfloat16"), 3 * TB)
    assert f"{FP8_DTYPE}" in refusal and "and fit" in refusal  # 2.87 TB in 8-bit: under 3 TB
    assert "hidden_states_mode: bounded" in refusal and "window_shards: 2" in refusal
    assert "EAGLE3_MAX_SAMPLES" in refusal and "python -m eagle3_assets.retire" in refusal


def test_a_small_run_is_fitted_more_epochs_as_training_would():
    settings = PlanSettings(hidden_size=64, sample_tokens=100)
    plan = plan_capacity(story_shards(300, 64), settings, disk(10**12), disk(10**12), {**UNKNOWN, "training": Rate(1000.0, "configured")})
    assert plan.epochs == 14  # 30,000 tokens: 1,024-token batches, 30 steps an epoch, 14 epochs for 400 steps (core/training/schedule.py)
    assert plan.gpu_hours["training"] == pytest.approx(30_000 * 14 / 1000 / 3600)


def test_a_volume_whose_free_bytes_are_unknown_refuses_the_run_unless_the_risk_is_accepted():
    """Issue 41's case: a 5.7 TB run on two volumes that could not be measured passed (``fits: True, refusal: None``).

    Fails on the mutations ``CapacityPlan.fits`` counting an unknown volume as fitting (``need.fits is not False``,
    as before) and ``states_refusal`` returning None when no measured volume is short (``return None`` for
    ``return self.unknown_refusal(states_only=True)``).
    """
    settings = PlanSettings(hidden_size=7168, sample_tokens=4000)
    gpu = Volume("GPU host", "/data/hidden_states", None, note="the host's python did not answer (exit 127)")
    data = Volume("data volume", "/srv", None, note="permission denied")
    plan = plan_capacity(story_shards(25_000), settings, gpu, data, UNKNOWN)
    assert plan.states_bytes_to_write > 5 * TB
    assert not plan.fits and plan.as_metadata()["fits"] is False
    refusal = plan.states_refusal()
    assert refusal.startswith(
        "cannot tell whether the run fits: GPU host /data/hidden_states: free bytes unknown (the host's python did not answer (exit 127)); "
        f"the run writes {human(plan.needs[0].bytes)} there"
    ), refusal
    assert "accept_unknown_capacity: true" in refusal and "EAGLE3_ACCEPT_UNKNOWN_CAPACITY=1" in refusal
    assert "/srv" not in refusal  # hidden_states' refusal is about the volume of the states
    assert "data volume /srv: free bytes unknown (permission denied)" in plan.unknown_refusal()  # the whole plan's gate names both
    assert "| GPU host `/data/hidden_states` |" in plan.markdown() and "**unknown: refused**" in plan.markdown()

    accepted = plan_capacity(story_shards(25_000), replace(settings, accept_unknown_capacity=True), gpu, data, UNKNOWN)
    assert accepted.fits and accepted.states_refusal() is None and accepted.unknown_refusal() is None
    risks = accepted.accepted_risks()
    assert [r.split(":")[1].strip() for r in risks] == ["GPU host /data/hidden_states", "data volume /srv"], risks
    assert all(r.startswith("accepted risk (accept_unknown_capacity)") and r.endswith("not checked") for r in risks)
    assert accepted.as_metadata()["accepted_risks"] == risks and "unknown: risk accepted" in accepted.markdown()
    # Accepting the unknown passes no measured volume that is short.
    short = plan_capacity(story_shards(25_000), replace(settings, accept_unknown_capacity=True), disk(3 * TB), data, UNKNOWN)
    assert not short.fits and short.states_refusal().startswith("the whole run does not fit")


def test_several_gpus_divide_the_wall_hours_not_the_gpu_hours():
    """Every other test plans one GPU per stage, where dividing and multiplying by the count agree.

    Fails on the mutations of plan_capacity: training's hours multiplied by ``training_gpus`` instead of divided
    (issue 41), the same for extraction, and generation's GPU-hours left at its wall hours (``* gpus`` dropped).
    """
    settings = PlanSettings(hidden_size=64, sample_tokens=100, epochs=10, generation_gpus=8, extraction_gpus=2, training_gpus=4)
    rates = {"generation": Rate(50.0, "configured"), "extraction": Rate(100.0, "configured"), "training": Rate(1000.0, "configured")}
    plan = plan_capacity(story_shards(300, 64), settings, disk(10**12), disk(10**12), rates)
    assert plan.tokens == 30_000 and plan.completion_tokens_to_generate == 30_000  # generated ~ a trace's length
    # Training: every token x 10 epochs at 1,000 tokens/s per GPU, on 4 GPUs.
    assert plan.gpu_hours["training"] == pytest.approx(30_000 * 10 / 1000 / 3600)
    assert plan.hours["training"] == pytest.approx(30_000 * 10 / 1000 / 3600 / 4)
    # Extraction: 100 tokens/s per GPU on 2; generation: the server's 50 tokens/s, holding its 8 GPUs the while.
    assert plan.gpu_hours["extraction"] == pytest.approx(30_000 / 100 / 3600) and plan.hours["extraction"] == pytest.approx(30_000 / 100 / 3600 / 2)
    assert plan.hours["generation"] == pytest.approx(30_000 / 50 / 3600) and plan.gpu_hours["generation"] == pytest.approx(30_000 / 50 / 3600 * 8)
    assert plan.remaining_hours == pytest.approx(sum(plan.hours.values()))


def test_the_bounded_disk_window_is_the_bytes_of_its_largest_shards():
    """No other test reads the window's bytes. Fails on the mutations: a window of one shard (``[:1]`` for
    ``[: max(1, settings.window_shards)]``, issue 41), and the first shards instead of the largest (no sort)."""
    shards = [
        ShardFacts("shard-00000", 10, validated_tokens=1000),
        ShardFacts("shard-00001", 10, validated_tokens=5000),
        ShardFacts("shard-00002", 10, validated_tokens=3000),
        ShardFacts("shard-00003", 20),  # not validated: 20 prompts at the measured 300 tokens each
    ]
    per_token = bytes_per_token(64, "bfloat16")
    plans = {w: plan_capacity(shards, PlanSettings(hidden_size=64, window_shards=w), disk(10**12), disk(10**12), UNKNOWN) for w in (2, 3)}
    assert plans[2].tokens_per_prompt == 300 and plans[2].tokens == 1000 + 5000 + 3000 + 6000
    assert plans[2].bounded_window_bytes == (6000 + 5000) * per_token
    assert plans[3].bounded_window_bytes == (6000 + 5000 + 3000) * per_token
    assert f"| bounded-disk window (2 shards) | | | at most {human((6000 + 5000) * per_token)} at a time |" in plans[2].markdown()


def test_nothing_to_project_from_is_said_not_passed():
    plan = plan_capacity(story_shards(256), PlanSettings(hidden_size=64), disk(10**12), disk(10**12), UNKNOWN)
    assert not plan.projected and plan.tokens_per_prompt is None
    assert any("validate a shard, or configure sample_tokens" in line for line in plan.unknown)
    assert "unknown" in plan.eta()
    # run_fits fails as a warning, the severity its declaration gives this way of failing (mutation: declare
    # NOTHING_TO_PROJECT "ERROR" in core/planning/gates.py, or drop the not-projected branch of check_run_fits: this fails).
    outcome = check_run_fits(plan)
    assert not outcome.passed and CAPACITY_GATES["run_fits"].severity_of(outcome) == "WARN" and "no shard is validated" in outcome.description


# -- through Dagster ---------------------------------------------------------------------


def write_first_shard(data_dir, tiny_target, count: int) -> int:
    """What validation leaves for shard-00000: its prompts and its validated traces; the traces' tokens."""
    traces = write_validated_traces(data_dir, "shard-00000", tiny_target, count=count)
    ids = pl.read_parquet(traces, columns=["id"])["id"].to_list()
    prompts = pl.DataFrame(
        [{"row_index": i, "id": sample_id, "messages": [{"role": "user", "content": "q"}]} for i, sample_id in enumerate(ids)], schema=PROMPTS_SCHEMA
    )
    write_parquet_atomic(asset_dir("prompts", data_dir) / "shard-00000.parquet", prompts)
    return int(pl.read_parquet(traces, columns=["num_tokens"])["num_tokens"].sum())


def test_hidden_states_refuses_a_run_larger_than_the_disk_before_its_first_shard(data_dir, tiny_target):
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states

    tokens = write_first_shard(data_dir, tiny_target, count=256)
    per_shard = tokens * bytes_per_token(64, "float32")
    free = volume_at("here", str(data_dir)).free_bytes
    shards = 3 * free // per_shard + 1  # three times the disk, in shards as large as the first
    instance = DagsterInstance.ephemeral()
    register_shards(instance, [f"shard-{i:05d}" for i in range(shards)])

    result = materialize(
        [hidden_states],
        partition_key="shard-00000",
        resources={"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()},
        instance=instance,
        run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1)}),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    message = failure.step_failure_data.error.to_string()
    assert "hidden_states shard-00000: the whole run does not fit" in message, message
    need, measured_free = map(int, re.search(r"\((\d+) > (\d+) bytes", message).groups())
    assert need >= shards * per_shard * 0.99 and need > 2 * measured_free
    assert f"{shards} of {shards} registered shard(s) still to extract" in message
    assert FP8_DTYPE in message and "hidden_states_mode: bounded" in message
    logs = " ".join(entry.user_message for entry in instance.all_logs(result.run_id) if entry.user_message)
    assert "pre-flight" not in logs and "stage extract_hidden_states started" not in logs  # refused before the GPU host was asked
    assert not (data_dir / "hidden_states" / "shard-00000").exists()

    # The same check passes for the run it can hold: the first shard alone (the others retired by a cap).
    small = DagsterInstance.ephemeral()
    register_shards(small, ["shard-00000"])
    refuse_unless_run_fits(build_asset_context(instance=small, partition_key="shard-00000"), TargetModel(path=str(tiny_target)), "float32", GPUHost())


def test_capacity_plan_asset_measures_the_validated_shard_and_checks_the_volume(data_dir, tiny_target, tmp_path):
    from eagle3_assets.demo.prompt_set import make_traces

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"id": "p{i}", "messages": [{{"role": "user", "content": "{q}"}}]}}\n' for i, (q, _, _) in enumerate(make_traces(200, 1))))
    dataset = PromptDataset(source=str(source), shard_size=64)
    tokens = write_first_shard(data_dir, tiny_target, count=64)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    result = materialize(
        [capacity_plan],
        resources={"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost(), "prompt_dataset": dataset},
        instance=instance,
        raise_on_error=False,
        # Nodes on a local host: planned as asked, said as a what-if (mutations in defs/capacity_plan.py: ``nodes=nodes``
        # dropped from PlanSettings, or the note of plan_nodes not added to the plan: this fails).
        run_config=RunConfig(ops={"capacity_plan": {"config": {"nodes": 2}}}),
    )
    assert result.success
    metadata = result.get_asset_materialization_events()[0].materialization.metadata
    assert metadata["shards"].value == 4 and metadata["shards_validated"].value == 1
    assert metadata["nodes"].value == {"extraction": 2, "training": 2} and "a what-if" in metadata["plan"].value
    per_prompt = tokens / 64
    assert metadata["tokens_per_prompt"].value == pytest.approx(per_prompt, abs=0.1)
    assert metadata["projected_tokens"].value == tokens + round(64 * per_prompt) * 2 + round(8 * per_prompt)  # 200 rows: 64, 64, 64, 8
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "run_fits" and check.passed
    assert "| hidden states (bfloat16, H = 64) |" in metadata["plan"].value


def test_the_gpu_hosts_free_space_is_measured_by_its_own_python_over_ssh(sshd, data_dir):
    """The GPU host behind sshd is this machine: its answer, through ssh and the host's Python, is this disk's."""
    host = sshd.host(data_dir)
    remote = volume_at("GPU host", str(data_dir / "hidden_states" / "not-yet"), host)
    local = volume_at("data volume", str(data_dir))
    assert remote.free_bytes is not None, remote.note
    assert abs(remote.free_bytes - local.free_bytes) < 1024**3  # one disk, written to by others meanwhile
    assert remote.device.startswith(host.connection().label) and remote.device != local.device  # never taken for the data volume
    broken = volume_at("GPU host", str(data_dir), sshd.host(data_dir, python="/nonexistent/python3"))
    assert broken.free_bytes is None and "/nonexistent/python3" in broken.note  # unknown, said why


def test_a_gpu_host_whose_free_space_cannot_be_read_is_refused_unless_the_risk_is_accepted(sshd, data_dir, tiny_target, tmp_path):
    """Through Dagster, on a real ssh GPU host whose Python does not run: ``run_fits`` fails naming the volume and why,
    and ``hidden_states``' refusal stops the run; with ``accept_unknown_capacity`` both go ahead, the risk stated.

    Fails on the mutations: ``unknown_refusal`` returning None, the asset's ``elif unjudged`` branch dropped, and
    ``states_refusal`` not refusing an unknown volume (``return None`` for ``return self.unknown_refusal(states_only=True)``).
    """
    from dagster import Failure

    from eagle3_assets.defs.capacity_plan import CapacityPlanConfig

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"id": "p{i}", "messages": [{{"role": "user", "content": "q{i}"}}]}}\n' for i in range(128)))
    dataset = PromptDataset(source=str(source), shard_size=64)
    host = sshd.host(data_dir, python="/nonexistent/python3")
    resources = {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": host, "prompt_dataset": dataset}
    checks = {}
    for accept in (False, True):
        instance = DagsterInstance.ephemeral()
        register_shards(instance, dataset.shard_keys())
        config = CapacityPlanConfig(sample_tokens=500, accept_unknown_capacity=accept)
        result = materialize([capacity_plan], resources=resources, instance=instance, run_config=RunConfig(ops={"capacity_plan": config}))
        (checks[accept],) = result.get_asset_check_evaluations()
    refused, passed = checks[False], checks[True]
    assert not refused.passed and refused.severity.value == "ERROR"
    assert refused.description.startswith(f"cannot tell whether the run fits: GPU host {data_dir / 'hidden_states'}: free bytes unknown ("), refused.description
    assert "/nonexistent/python3" in refused.description and "accept_unknown_capacity: true" in refused.description
    assert passed.passed and passed.description.startswith("accepted risk (accept_unknown_capacity): GPU host"), passed.description
    (risk,) = passed.metadata["accepted_risks"].value
    assert "/nonexistent/python3" in risk and risk == passed.description

    # hidden_states' own refusal, before its first shard: the same, unless the risk is accepted.
    write_first_shard(data_dir, tiny_target, count=16)  # its tokens: what the refusal projects the run from
    instance = DagsterInstance.ephemeral()
    register_shards(instance, dataset.shard_keys())
    target = TargetModel(path=str(tiny_target))
    with pytest.raises(Failure, match=r"hidden_states shard-00000: cannot tell whether the run fits: GPU host .*/nonexistent/python3"):
        refuse_unless_run_fits(build_asset_context(instance=instance, partition_key="shard-00000"), target, "bfloat16", host)
    refuse_unless_run_fits(build_asset_context(instance=instance, partition_key="shard-00000"), target, "bfloat16", host, accept_unknown_capacity=True)
