"""The training losses (core/training/loss.py): what each one's value is, and that the LK losses train acceptance.

The LK losses (``nla``, ``lk_hybrid``) are meant to raise the acceptance rate of
speculative sampling, alpha = sum min(p, q), where forward KL only approaches it:
a draft too small to match every target distribution settles elsewhere under each
loss. The written-out gradients are held to autograd in tests/test_training_memory.py.
"""

from __future__ import annotations

import pytest
import torch

from eagle3_assets.core.training.config import LOSSES, TrainConfig
from eagle3_assets.core.training.loss import ChunkedHeadLoss, position_loss


def acceptance(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.minimum(q, p).sum(-1)


def test_each_losss_value_at_the_targets_own_distribution_at_a_point_mass_and_far_from_it():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 50, generator=generator) * 2, dim=-1)
    entropy = -(p * p.log()).sum(-1)
    # The draft equal to the target: KL is reported as the cross-entropy (p's entropy here); the LK losses are 0.
    torch.testing.assert_close(position_loss(p.log(), p, "kl", 3.0), entropy)
    for loss in ("nla", "lk_hybrid"):
        torch.testing.assert_close(position_loss(p.log(), p, loss, 3.0), torch.zeros(4), atol=1e-6, rtol=0)
    # A point-mass target: -log acceptance is the cross-entropy of its token.
    logits = torch.randn(4, 50, generator=generator)
    point = torch.nn.functional.one_hot(torch.tensor([3, 0, 49, 7]), 50).float()
    torch.testing.assert_close(position_loss(logits, point, "nla", 3.0), position_loss(logits, point, "ce", 3.0))
    # A draft nearly disjoint from the target (acceptance ~ 0): lk_hybrid's blend is all KL, KL(p || q) = CE - H(p).
    near_p = torch.softmax(torch.randn(4, 50, generator=generator).index_fill(1, torch.arange(40, 50), -30.0), dim=-1)
    far = torch.full((4, 50), -30.0).index_fill(1, torch.arange(40, 50), 0.0)
    assert float(acceptance(torch.softmax(far, -1), near_p).max()) < 1e-6
    near_entropy = -(near_p * near_p.log()).sum(-1)
    lk = position_loss(far, near_p, "lk_hybrid", 3.0)
    torch.testing.assert_close(lk, position_loss(far, near_p, "kl", 3.0) - near_entropy, rtol=1e-5, atol=1e-4)


def test_a_draft_that_cannot_match_every_target_reaches_more_acceptance_under_the_lk_losses_than_under_kl():
    """Five positions the draft cannot tell apart (one shared distribution), each with its own target."""
    torch.set_num_threads(1)  # tensors of 8 values: threads would only wait on each other
    generator = torch.Generator().manual_seed(0)
    targets = torch.softmax(torch.randn(5, 8, generator=generator) * 3, dim=-1)
    hidden, rows, weight = torch.ones(5, 1), torch.arange(5), torch.full((5,), 0.2)
    reached = {}
    for loss in ("kl", "nla", "lk_hybrid"):
        head = torch.zeros(8, 1, requires_grad=True)
        optimizer = torch.optim.Adam([head], lr=0.1)
        for _ in range(600):  # through the chunked loss's written-out backward, two positions a chunk
            optimizer.zero_grad()
            total, _ = ChunkedHeadLoss.apply(hidden, head, targets.log(), rows, weight, 2, loss, 3.0)
            total.backward()
            optimizer.step()
        reached[loss] = float(acceptance(torch.softmax(head.detach().T, -1), targets).mean())
    print("mean acceptance reached:", reached)
    assert reached["nla"] > reached["kl"] + 0.005 and reached["lk_hybrid"] > reached["kl"] + 0.003, reached


def test_an_unknown_loss_is_refused_naming_the_known_ones():
    config = TrainConfig(hidden_state_dirs=["x"], vocab_mapping="v", target_path="t", training_dir="d", loss="tv")
    with pytest.raises(ValueError, match=r"loss 'tv': one of 'kl', 'ce', 'nla', 'lk_hybrid'"):
        config.validate()
    assert LOSSES == ("kl", "ce", "nla", "lk_hybrid")
