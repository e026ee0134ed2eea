"""The training losses (core/training/loss.py): what each one's value is, and that the LK losses train acceptance.

The LK losses (``nla``, ``lk_hybrid``) are meant to raise the acceptance rate of
speculative sampling, alpha = sum min(p, q), where forward KL only approaches it:
a draft too small to match every target distribution settles elsewhere under each
loss. The written-out gradients are held to autograd in tests/test_training_memory.py.
"""

from __future__ import annotations

import pytest
import torch

from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training import losses
from eagle3_assets.core.training.losses import LOSSES
from eagle3_assets.core.training.loss import ChunkedHeadLoss, position_loss


def acceptance(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.minimum(q, p).sum(-1)


def test_each_losss_value_at_the_targets_own_distribution_at_a_point_mass_and_far_from_it():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 50, generator=generator) * 2, dim=-1)
    entropy = -(p * p.log()).sum(-1)
    # The draft equal to the target: KL is reported as the cross-entropy (p's entropy here); the LK losses are 0.
    torch.testing.assert_close(position_loss(p.log(), p, "kl"), entropy)
    for loss in ("nla", "lk_hybrid"):
        torch.testing.assert_close(position_loss(p.log(), p, loss), torch.zeros(4), atol=1e-6, rtol=0)
    # A point-mass target: -log acceptance is the cross-entropy of its token.
    logits = torch.randn(4, 50, generator=generator)
    point = torch.nn.functional.one_hot(torch.tensor([3, 0, 49, 7]), 50).float()
    torch.testing.assert_close(position_loss(logits, point, "nla"), position_loss(logits, point, "ce"))
    # A draft nearly disjoint from the target (acceptance ~ 0): lk_hybrid's blend is all KL, KL(p || q) = CE - H(p).
    near_p = torch.softmax(torch.randn(4, 50, generator=generator).index_fill(1, torch.arange(40, 50), -30.0), dim=-1)
    far = torch.full((4, 50), -30.0).index_fill(1, torch.arange(40, 50), 0.0)
    assert float(acceptance(torch.softmax(far, -1), near_p).max()) < 1e-6
    near_entropy = -(near_p * near_p.log()).sum(-1)
    lk = position_loss(far, near_p, "lk_hybrid")
    torch.testing.assert_close(lk, position_loss(far, near_p, "kl") - near_entropy, rtol=1e-5, atol=1e-4)


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
            total, _ = ChunkedHeadLoss.apply(hidden, head, targets.log(), rows, weight, 2, loss)
            total.backward()
            optimizer.step()
        reached[loss] = float(acceptance(torch.softmax(head.detach().T, -1), targets).mean())
    print("mean acceptance reached:", reached)
    assert reached["nla"] > reached["kl"] + 0.005 and reached["lk_hybrid"] > reached["kl"] + 0.003, reached


def test_an_unknown_loss_is_refused_naming_the_known_ones():
    config = TrainConfig(hidden_state_dirs=["x"], vocab_mapping="v", target_path="t", training_dir="d", loss="tv")
    with pytest.raises(ValueError, match=r"loss 'tv': one of 'kl', 'ce', 'nla', 'lk_hybrid'"):
        config.validate()
    assert tuple(LOSSES) == ("kl", "ce", "nla", "lk_hybrid", "opd", "opd_anchored")


def test_a_loss_registered_in_losses_py_alone_is_validated_planned_and_trained(monkeypatch):
    """Adding a loss is one entry in core/training/losses.py: nothing else is edited here.

    The entry, ``scaled_kl`` (lk_eta * KL, its written-out gradient, KL's memory; it borrows the setting lk_eta as its
    parameter, where a loss of one's own would declare a setting in config.py), is put in the registry by the test,
    and then the config validation accepts it, the memory plan plans it (KL's estimate: its tensors are KL's), and one
    training step of the loop's own Trainer, the loss chunked so that the entry's written-out gradient is used, reports
    lk_eta times KL's loss and gradient norm from the same weights and batch.

    Mutations, each run by hand and failing this test: memory.py's estimate reading a table of its own again
    (``{"kl": 3, "ce": 3, "nla": 5, "lk_hybrid": 5}[s.loss]`` for the chunked loss's transient) -> KeyError 'scaled_kl';
    config.validate checking a tuple of names (``("kl", "ce", "nla", "lk_hybrid")``) -> "loss 'scaled_kl': one of
    ..."; loop.py passing ``{"lk_eta": config.lk_eta}`` whatever the loss reads -> TypeError; ChunkedHeadLoss's
    backward taking KL's gradient instead of the entry's -> grad_norm 0.444, not 2.5 x.
    """
    from eagle3_assets.core.draft.model import DraftConfig, Eagle3Draft
    from eagle3_assets.core.draft.vocab import build_vocab_mapping
    from eagle3_assets.core.target.head import TargetHead
    from eagle3_assets.core.training import losses
    from eagle3_assets.core.training.data import Batch
    from eagle3_assets.core.training.loop import Trainer
    from eagle3_assets.core.training.memory import plan_micro_batch

    def scaled_kl(logits, target, *, lk_eta):
        return lk_eta * losses.LOSSES["kl"].value(logits, target)

    def scaled_kl_grad(logits, target, *, lk_eta):
        return losses.LOSSES["kl"].gradient(logits, target).mul_(lk_eta)

    entry = losses.TrainingLoss("lk_eta times KL", scaled_kl, scaled_kl_grad, kept_tensors=2, chunk_backward_tensors=3, parameters=("lk_eta",))
    monkeypatch.setitem(losses.LOSSES, "scaled_kl", entry)

    torch.set_num_threads(1)
    vocab, draft_vocab, hidden = 300, 120, 32
    generator = torch.Generator().manual_seed(0)
    mapping = build_vocab_mapping(torch.randint(0, 400, (vocab,), generator=generator), draft_vocab)
    draft_config = DraftConfig(
        hidden_size=hidden, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=hidden, aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    target = TargetHead(lm_head=torch.randn(vocab, hidden, generator=generator) * 0.1, norm_weight=torch.ones(hidden), eps=1e-5)
    length = 24
    batch = Batch(
        aux=torch.randn(2, length, 3 * hidden, generator=generator), final=torch.randn(2, length, hidden, generator=generator),
        input_ids=torch.randint(0, vocab, (2, length), generator=generator), loss_mask=torch.ones(2, length, dtype=torch.bool),
        num_tokens=2 * length,
    )  # fmt: skip

    def one_step(loss: str) -> dict:
        config = TrainConfig(
            hidden_state_dirs=["x"], vocab_mapping="v", target_path="t", training_dir="d", loss=loss, lk_eta=2.5,
            ttt_steps=2, loss_chunk_tokens=7, batch_tokens=2 * length, learning_rate=1e-3,
        )  # fmt: skip
        config.validate()
        plan = plan_micro_batch(draft_config, config, longest=length, device=torch.device("cpu"), bf16=False, free=(2**34, 2**34))
        torch.manual_seed(0)
        draft = Eagle3Draft(draft_config)
        draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
        draft.embed_tokens.weight.requires_grad_(False)
        trainer = Trainer(draft, lambda final: target.draft_logits(final, "post_norm", mapping.draft_to_target), config, torch.device("cpu"), 1, False)
        return {**trainer.step([batch], 1, 1), "plan": plan.parts}

    kl, scaled = one_step("kl"), one_step("scaled_kl")
    assert kl["loss"] > 0 and kl["grad_norm"] > 0
    assert scaled["loss"] == pytest.approx(2.5 * kl["loss"], rel=1e-5)
    assert scaled["grad_norm"] == pytest.approx(2.5 * kl["grad_norm"], rel=1e-4)
    assert scaled["plan"] == kl["plan"]


def test_opd_is_forward_kl_where_the_draft_would_be_accepted_and_reverse_kl_where_rejected_with_its_gradient():
    """Draft-OPD's loss (issue 42, item 4): per position, forward KL where the draft's top token is the target's,
    reverse KL(q || p) where it is not; the written-out gradient is autograd's of the value and the formula's.

    Fails on: the two pieces swapped (forward KL on the rejected positions), the acceptance taken from the draft's
    top token against itself or against a token other than the target's top one, the reverse KL's gradient without its
    ``- R`` term (q * r alone), and log p not clamped (a target probability that underflowed to 0 gives inf / nan).
    """
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 30, generator=generator, dtype=torch.float64) * 2
    target = torch.softmax(torch.randn(8, 30, generator=generator, dtype=torch.float64) * 3, dim=-1)
    # Rows 0-3: the target's top token made the draft's (accepted); rows 4-7 keep their own (rejected where they differ).
    top = logits.argmax(-1)
    target[:4] = target[:4].index_put((torch.arange(4), top[:4]), target[:4].max(-1).values + 0.5)
    target = target / target.sum(-1, keepdim=True)
    target[7, 0] = 0.0  # an underflowed probability: its log is clamped, not -inf
    target[7] = target[7] / target[7].sum()
    accepted = logits.argmax(-1) == target.argmax(-1)
    assert accepted[:4].all() and not accepted[4:].any()

    q = torch.softmax(logits, -1)
    forward = -(target * torch.log_softmax(logits, -1)).sum(-1)
    reverse = torch.nn.functional.kl_div(target.clamp_min(losses.PROBABILITY_FLOOR).log(), q, reduction="none").sum(-1)
    value = LOSSES["opd"].value(logits, target)
    torch.testing.assert_close(value[:4], forward[:4])
    torch.testing.assert_close(value[4:], reverse[4:])
    assert torch.isfinite(value).all() and (value[4:] > 0).all()
    # The step decay is the loop's step_weight, as for every loss: the entry itself reads no setting.
    assert LOSSES["opd"].parameters == ()

    leaf = logits.clone().requires_grad_(True)
    (autograd,) = torch.autograd.grad(LOSSES["opd"].value(leaf, target).sum(), leaf)
    written = LOSSES["opd"].gradient(logits, target)
    torch.testing.assert_close(written, autograd)
    r = torch.log_softmax(logits, -1) - target.clamp_min(losses.PROBABILITY_FLOOR).log()
    formula = torch.where(accepted[:, None], q - target, q * (r - (q * r).sum(-1, keepdim=True)))
    torch.testing.assert_close(written, formula)
    assert not torch.allclose(written[4:], q[4:] - target[4:])  # the rejected rows' gradient is not forward KL's


def test_opd_anchored_is_reverse_kl_where_the_server_rejected_and_forward_kl_elsewhere_whatever_the_draft_prefers():
    """The anchored variant (issue 42 item 4): the pieces are placed by the round's anchors, not by the draft's argmax;
    its written-out gradient is autograd's. Fails on the pieces swapped, on the argmax used in place of the anchors, and
    on a loss that runs without anchors (it would train plain forward KL under another name)."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 30, generator=generator, dtype=torch.float64) * 2
    target = torch.softmax(torch.randn(8, 30, generator=generator, dtype=torch.float64) * 3, dim=-1)
    greedy_accepted = logits.argmax(-1) == target.argmax(-1)
    rejected = torch.tensor([True, False] * 4)
    assert (rejected & greedy_accepted).any() or (~rejected & ~greedy_accepted).any()  # the anchors differ from the argmax
    q = torch.softmax(logits, -1)
    forward = -(target * torch.log_softmax(logits, -1)).sum(-1)
    reverse = torch.nn.functional.kl_div(target.clamp_min(losses.PROBABILITY_FLOOR).log(), q, reduction="none").sum(-1)
    value = position_loss(logits, target, "opd_anchored", rejected=rejected)
    torch.testing.assert_close(value, torch.where(rejected, reverse, forward))
    leaf = logits.clone().requires_grad_(True)
    (autograd,) = torch.autograd.grad(LOSSES["opd_anchored"].value(leaf, target, rejected=rejected).sum(), leaf)
    torch.testing.assert_close(LOSSES["opd_anchored"].gradient(logits, target, rejected=rejected), autograd)
    with pytest.raises(ValueError, match="needs a refinement round's anchors"):
        position_loss(logits, target, "opd_anchored")


def test_the_unrolled_loss_reads_step_js_anchors_at_step_j():
    """TrainingTimeTest: with no rejection anchored (or no anchors: a batch of supervised samples), opd_anchored is kl
    step for step; rejections anchored in column 1 alone change step 1's loss alone (fails on the column read off by
    one, or on every step reading column 0)."""
    from eagle3_assets.core.training.loss import REJECTED, TrainingTimeTest
    from tests.test_training_memory import random_batch, small_draft

    torch.set_num_threads(1)
    draft, head, mapping = small_draft()
    aux, final, ids, mask = random_batch(draft.config, rows=2, length=16)
    target_logits, target_top = head.draft_logits(final, "post_norm", mapping.draft_to_target, chunk=32)

    def step_losses(loss: str, anchors=None) -> torch.Tensor:
        with torch.no_grad():
            return TrainingTimeTest(draft, 3, 0.8, loss=loss)(aux, ids, mask, target_logits, target_top, None, anchors)[1][0]

    none = torch.zeros(2, 16, 3, dtype=torch.int8)
    torch.testing.assert_close(step_losses("opd_anchored", none), step_losses("kl"))
    column_1 = none.clone()
    column_1[..., 1] = REJECTED
    anchored, kl = step_losses("opd_anchored", column_1), step_losses("kl")
    torch.testing.assert_close(anchored[[0, 2]], kl[[0, 2]])
    assert not torch.isclose(anchored[1], kl[1])
    torch.testing.assert_close(step_losses("opd_anchored"), kl)
