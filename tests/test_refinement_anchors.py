"""The server's accepts and first rejections as a mask over a stored sample's unrolled chains (issue 42 item 4, anchored).
Hand-made replay records: no draft, no vLLM, milliseconds."""

from __future__ import annotations

import pytest
import torch

from eagle3_assets.core.evaluation.output_position import RequestSteps
from eagle3_assets.core.refinement.anchors import ACCEPTED, REJECTED, UNSERVED, anchor_counts, anchor_mask
from eagle3_assets.core.refinement.replay import ReplayedStep
from eagle3_assets.core.training.loss import shift_left

K = 3


def test_each_step_marks_its_accepted_run_and_its_first_rejection_where_the_unrolled_loss_trains_that_token():
    """Fails on an off-by-one in the chain (``P + o - 1`` or ``- 3``) or in the rejection's column (``a + 1``), on the
    replay's count taken for the server's (step 2 disagrees), on drafts past a rejection marked, and on a draft whose
    token lies past the stored sample marked."""
    prompt = 2
    tokens = [10, 11, 20, 21, 22, 23, 24, 25, 26, 27]  # 2 prompt tokens, 8 completion tokens
    served = RequestSteps(completion_tokens=8, accepted=(2, 1, 0, 3), drafted=(3, 3, 3, 3))
    assert served.adds_up() and served.starts() == [1, 4, 6, 7]
    steps = [
        # output 1 (absolute 3): 21, 22 accepted, 99 rejected for 23
        ReplayedStep(1, 3, 2, 2, (21, 22, 99), rejected_token=99, target_token=23),
        # output 4 (absolute 6): 24 accepted, 7 rejected for 25
        ReplayedStep(4, 3, 1, 1, (24, 7, 26), rejected_token=7, target_token=25),
        # output 6 (absolute 8): the server rejected the first (for 26); the replay counted one (a disagreeing step)
        ReplayedStep(6, 3, 0, 1, (26, 5, 5), rejected_token=5, target_token=27),
        # output 7 (absolute 9): the stop cut it: 27 accepted, the next two past the sample's end
        ReplayedStep(7, 3, 3, None, (27, 1, 1)),
    ]
    mask = anchor_mask(steps, prompt, len(tokens), K)
    expected = torch.zeros(len(tokens), K, dtype=torch.int8)
    expected[1] = torch.tensor([ACCEPTED, ACCEPTED, REJECTED])
    expected[4] = torch.tensor([ACCEPTED, REJECTED, UNSERVED])
    expected[6] = torch.tensor([REJECTED, UNSERVED, UNSERVED])
    expected[7] = torch.tensor([ACCEPTED, UNSERVED, UNSERVED])
    assert torch.equal(mask, expected), mask
    # The training loss's convention (TrainingTimeTest): chain t at unrolled step j is trained towards the token at
    # t + 2 + j, which shift_left(input_ids, 2 + j) puts at t. The rejections land on the stored tokens the server
    # verified against (target_token), the accepted proposals on the tokens they proposed.
    ids = torch.tensor([tokens])
    for step in steps:
        chain = prompt + step.output_position - 2
        for j in range(K):
            at = int(shift_left(ids, 2 + j, -1)[0, chain])
            if mask[chain, j] == ACCEPTED:
                assert at == step.proposals[j]
            elif mask[chain, j] == REJECTED:
                assert (step.server_accepted, at) == (j, step.target_token if step.agrees else tokens[chain + 2 + j])
    assert anchor_counts(mask) == {"accepted": 4, "rejected": 3, "chains": 4}


def test_a_step_drafting_more_than_k_or_an_empty_prompt_is_refused():
    """Fails if a record from a server with a larger k is silently cut to k columns."""
    with pytest.raises(ValueError, match="more than k = 3"):
        anchor_mask([ReplayedStep(1, 4, 1, 1, (1, 2, 3, 4))], 2, 10, K)
    with pytest.raises(ValueError, match="prompt of 0 tokens"):
        anchor_mask([], 0, 10, K)
