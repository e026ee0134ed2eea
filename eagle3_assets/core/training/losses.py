"""The training losses, one entry each: to add a loss, add an entry to :data:`LOSSES`.

Nothing else is edited, but for two things: a loss with a parameter of its own
declares that setting in :class:`~eagle3_assets.core.training.config.TrainingRecipe`
(where every setting is declared once), and ``docs/configuration.md``, which
lists the losses in the ``loss`` setting's description, is regenerated
(``.venv/bin/python scripts/config_reference.py``; tests/test_docs.py fails until it is).

An entry (:class:`TrainingLoss`) is everything the rest of training reads of a
loss, so that nothing else names one:

- ``value``: each position's loss for the draft's float32 ``logits`` and the
  target's distribution ``target`` over the draft vocabulary (last dimension),
  differentiable by autograd (the loss unchunked, ``loss_chunk_tokens: 0``);
- ``gradient``: d value / d logits, written out so that the chunked loss
  (:class:`~eagle3_assets.core.training.loss.ChunkedHeadLoss`) keeps no graph;
  tests/test_training_memory.py holds each registered loss's chunked
  gradients to autograd's of ``value``;
- ``kept_tensors`` and ``chunk_backward_tensors``: its memory, in
  [tokens, draft vocabulary] float32 tensors a position, which
  :mod:`~eagle3_assets.core.training.memory` plans the micro-batch with;
- ``parameters``: the training settings it reads (each declared once, in
  :class:`~eagle3_assets.core.training.config.TrainingRecipe`), passed to
  ``value`` and ``gradient`` as keywords;
- ``description``: what the ``loss`` setting's description says of it;
- ``anchored``: it reads where the server rejected the draft (a refinement
  round's anchors, :func:`~eagle3_assets.core.refinement.anchors.anchor_mask`):
  ``value`` and ``gradient`` then take ``rejected``, a bool per position, and
  the unrolled loss refuses a batch without anchors.

The ``loss`` setting is validated against this table (its error names the
registered losses), and the setting's description lists them from it.

Written with tensor methods and no ``import torch``: the config validation and
the Dagster code location read this table, and the code location loads without
torch (tests/test_import_graph.py).

What each loss trains each position towards, p the target's distribution over
the draft vocabulary and q the draft's:

- ``kl``: forward KL(p || q), reported as the cross-entropy -sum p log q (the
  same gradient; they differ by p's entropy, a constant);
- ``ce``: cross-entropy against the target's top token alone;
- ``nla`` and ``lk_hybrid``, the LK losses (Samarin et al., arXiv 2602.23881):
  they train the acceptance rate of speculative sampling itself, alpha =
  sum min(p, q) = 1 - TV(p, q). ``nla`` is -log alpha (TV's gradient scaled by
  1 / alpha, usable from a cold start); ``lk_hybrid`` is
  lam * KL + (1 - lam) * TV with lam = exp(-eta * alpha), alpha not
  differentiated: KL's gradient while the draft is far off, TV's once it
  overlaps.

- ``opd``, on-policy distillation as Draft-OPD (arXiv 2605.29343) trains:
  forward KL (reported as ``kl`` is) where the draft would be accepted,
  reverse KL(q || p) where it would be rejected, each unrolled step decayed by
  ``step_weight`` as every loss is. Accepted here is greedy verification at
  the position: the draft's top token is the target's. That is what vLLM
  decides there at temperature 0 once the chain's earlier drafts were
  accepted, and the replay of a served draft (``core/refinement/replay.py``)
  found vLLM's per-step counts to follow it on 458 of 459 steps
  (docs/performance.md). Positions after a chain's first rejection are still
  trained, teacher-forced, as the unrolled steps train them.
- ``opd_anchored``: the same two terms placed by the server instead: reverse
  KL where vLLM's verification really rejected the draft's proposal (the
  round's anchors: each verify step's first rejection, found by the replay),
  forward KL everywhere else (the accepted runs, positions no step decided,
  and the supervised samples mixed in, which carry no anchors).

The gradients: with q = softmax(logits) and alpha = sum min(p, q),
d KL / d logits = q - p, and d alpha / d logits_j = q_j * (b_j - sum_v b_v q_v)
where b_v = 1 where q_v < p_v; with r = log q - log p and R = sum_v q_v r_v
(the reverse KL), d R / d logits_j = q_j * (r_j - R).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

ACCEPTANCE_FLOOR = 1e-5  # nla: -log alpha is clamped here (no gradient below), as speculators does
# opd: log p is taken of p clamped to float32's smallest normal, where the target's probability underflowed to 0.
PROBABILITY_FLOOR = 1.1754943508222875e-38


@dataclass(frozen=True)
class TrainingLoss:
    """One training loss: its value, its gradient, its memory and the settings it reads (see the module's docstring).

    Memory, in [tokens, draft vocabulary] float32 tensors a position
    (:mod:`~eagle3_assets.core.training.memory`): ``kept_tensors`` are kept
    for backward a step when the loss is not chunked (the log-softmax and the
    target's shifted distribution; the LK losses also the softmax, which their
    overlap min(q, p) keeps, lk_hybrid one more of its KL's);
    ``chunk_backward_tensors`` are alive at once in one chunk's backward when it
    is chunked (the logits, the target's distribution, the gradient; the LK
    losses also the overlap's mask and its gradient). Measured as
    tests/test_training_memory.py measures it (2,048 tokens, settings off):
    nla's peak was one such tensor a step over KL's (the estimate 1.03 of it
    with 3; 1.09 with the 4 it had), lk_hybrid's 1.75 (1.04 with 4). opd's, with
    4 (the log-softmax, the target's copy, q, the log-ratio), measured with
    that file's helpers on 2026-12-06: the estimate 1.007 of its peak (431 MB;
    1,024 tokens, its LOSS_DRAFT, settings off, where KL's was 333 MB and nla's
    382 MB) and 0.993 with the settings on (1,536 tokens, LONG_DRAFT: nla's
    peak to the byte).
    """

    description: str
    value: Callable[..., Tensor]  # (logits, target, **parameters) -> [...] per position
    gradient: Callable[..., Tensor]  # (logits, target, **parameters) -> d value / d logits, [..., V]
    kept_tensors: int
    chunk_backward_tensors: int
    parameters: tuple[str, ...] = ()  # TrainingRecipe settings, passed by name
    anchored: bool = False  # value and gradient take ``rejected`` (bool per position): the server's rejections


def _kl(logits: Tensor, target: Tensor) -> Tensor:
    return -(target * logits.log_softmax(-1)).sum(-1)


def _kl_grad(logits: Tensor, target: Tensor) -> Tensor:
    return logits.softmax(-1).sub_(target)


def _ce(logits: Tensor, target: Tensor) -> Tensor:
    return -logits.log_softmax(-1).gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)


def _ce_grad(logits: Tensor, target: Tensor) -> Tensor:
    q = logits.softmax(-1)
    return q.scatter_add_(-1, target.argmax(-1, keepdim=True), q.new_full((*q.shape[:-1], 1), -1.0))


def _acceptance_grad(q: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """(alpha = sum min(q, p) [..., 1], d alpha / d logits)."""
    below = (q < target).to(q.dtype)
    accept = q.minimum(target).sum(-1, keepdim=True)
    return accept, below.sub_((below * q).sum(-1, keepdim=True)).mul_(q)  # reuses below's memory


def _nla(logits: Tensor, target: Tensor) -> Tensor:
    accept = logits.log_softmax(-1).exp().minimum(target).sum(-1)
    return -accept.clamp_min(ACCEPTANCE_FLOOR).log()


def _nla_grad(logits: Tensor, target: Tensor) -> Tensor:
    accept, d_accept = _acceptance_grad(logits.softmax(-1), target)
    return d_accept.mul_(-(accept >= ACCEPTANCE_FLOOR).to(accept.dtype) / accept.clamp_min(ACCEPTANCE_FLOOR))


def _lk_hybrid(logits: Tensor, target: Tensor, *, lk_eta: float) -> Tensor:
    log_q = logits.log_softmax(-1)
    accept = log_q.exp().minimum(target).sum(-1)
    lam = (-lk_eta * accept.detach()).exp()
    kl = (target.xlogy(target) - target * log_q).sum(-1)
    return lam * kl + (1 - lam) * (1 - accept)


def _lk_hybrid_grad(logits: Tensor, target: Tensor, *, lk_eta: float) -> Tensor:
    q = logits.softmax(-1)
    accept, d_accept = _acceptance_grad(q, target)
    lam = (-lk_eta * accept).exp()
    return q.sub_(target).mul_(lam).sub_(d_accept.mul_(1 - lam))


def _greedy_accepted(logits: Tensor, target: Tensor) -> Tensor:
    """Where the draft's top token is the target's: accepted by greedy verification ([...], bool)."""
    return logits.argmax(-1) == target.argmax(-1)


def _forward_or_reverse(logits: Tensor, target: Tensor, forward_where: Tensor) -> Tensor:
    """Forward KL (as ``kl`` reports it) where ``forward_where``, reverse KL(q || p) elsewhere."""
    log_q = logits.log_softmax(-1)
    forward = -(target * log_q).sum(-1)
    reverse = (log_q.exp() * (log_q - target.clamp_min(PROBABILITY_FLOOR).log())).sum(-1)
    return forward.where(forward_where, reverse)


def _forward_or_reverse_grad(logits: Tensor, target: Tensor, forward_where: Tensor) -> Tensor:
    log_ratio = logits.log_softmax(-1).sub_(target.clamp_min(PROBABILITY_FLOOR).log())
    q = logits.softmax(-1)
    reverse = log_ratio.sub_((q * log_ratio).sum(-1, keepdim=True)).mul_(q)  # reuses log_ratio's memory
    return q.sub_(target).where(forward_where.unsqueeze(-1), reverse)


def _opd(logits: Tensor, target: Tensor) -> Tensor:
    return _forward_or_reverse(logits, target, _greedy_accepted(logits, target))


def _opd_grad(logits: Tensor, target: Tensor) -> Tensor:
    return _forward_or_reverse_grad(logits, target, _greedy_accepted(logits, target))


def _opd_anchored(logits: Tensor, target: Tensor, *, rejected: Tensor) -> Tensor:
    return _forward_or_reverse(logits, target, rejected.logical_not())


def _opd_anchored_grad(logits: Tensor, target: Tensor, *, rejected: Tensor) -> Tensor:
    return _forward_or_reverse_grad(logits, target, rejected.logical_not())


# The registry. speculators trains with forward KL by default and offers the LK losses.
LOSSES: dict[str, TrainingLoss] = {
    "kl": TrainingLoss("forward KL to the target's distribution", _kl, _kl_grad, kept_tensors=2, chunk_backward_tensors=3),
    "ce": TrainingLoss("the target's top token alone", _ce, _ce_grad, kept_tensors=2, chunk_backward_tensors=3),
    "nla": TrainingLoss("an LK loss, acceptance itself: -log acceptance", _nla, _nla_grad, kept_tensors=3, chunk_backward_tensors=5),
    "lk_hybrid": TrainingLoss(
        "an LK loss: KL blended into TV by lk_eta", _lk_hybrid, _lk_hybrid_grad, kept_tensors=4, chunk_backward_tensors=5,
        parameters=("lk_eta",),
    ),  # fmt: skip
    "opd": TrainingLoss(
        "on-policy, Draft-OPD's: forward KL where the draft's top token is the target's, reverse KL where it is not",
        _opd, _opd_grad, kept_tensors=4, chunk_backward_tensors=5,
    ),  # fmt: skip
    "opd_anchored": TrainingLoss(
        "on-policy, at the server's rejections: reverse KL where vLLM rejected the draft's proposal (a refinement round's "
        "anchors), forward KL elsewhere",
        _opd_anchored, _opd_anchored_grad, kept_tensors=4, chunk_backward_tensors=5, anchored=True,
    ),  # fmt: skip
}


def known_losses() -> str:
    """The registered losses' names, for an error or a description: ``'kl', 'ce', ...``."""
    return ", ".join(repr(name) for name in LOSSES)


def training_loss(name: str) -> TrainingLoss:
    """The entry of loss ``name``; a ``ValueError`` naming the registered ones when there is none."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"loss {name!r}: one of {known_losses()} (core/training/losses.py registers them)") from None
