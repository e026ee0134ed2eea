"""The unrolled loss ("training-time test"), with two ways to keep its memory down.

At inference the draft's second and later tokens are conditioned on its *own*
previous state, not the target's. Training only on the target's states teaches
a draft that falls apart after one token, so the draft is unrolled
``ttt_steps`` times on its own outputs and step i's loss is weighted
``step_weight ** i``.

Memory (:mod:`.memory` estimates it): kept naively, every unrolled step's
activations live until backward, and each step's draft-vocabulary logits
with their log-softmax and a shifted copy of the target's distribution
(three [tokens, draft vocabulary] float32 tensors a step). Two settings cut
that, each computing the same gradients (tests/test_training_memory.py):

- ``checkpoint_steps``: each unrolled step is recomputed in backward
  (``torch.utils.checkpoint``); only its inputs (the draft's state and the
  step's keys and values) stay, so one step's activations exist at a time;
- ``loss_chunk_tokens``: the draft's ``lm_head`` and the loss run over chunks
  of positions in a custom autograd function that recomputes each chunk's
  logits in backward, so no [tokens, draft vocabulary] tensor of the draft
  exists; the target's distribution is taken a chunk at a time from its
  restricted logits, by index (no shifted copy).

What each position is trained towards (``loss``): an entry of
:data:`~eagle3_assets.core.training.losses.LOSSES`, which holds each loss's
value, its written-out gradient (what the chunked loss uses), its memory and
the settings it reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3_assets.core.draft.model import Eagle3Draft
from eagle3_assets.core.training.config import TrainingRecipe
from eagle3_assets.core.training.losses import training_loss

# A refinement round's anchors ([T, k] per sample, :func:`~eagle3_assets.core.refinement.anchors.anchor_mask`): for
# chain t at unrolled step j, whether the server accepted that proposal, rejected it first, or never decided it.
UNSERVED, ACCEPTED, REJECTED = 0, 1, 2


def shift_left(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """``out[:, t] = x[:, t + by]``, ``fill`` past the end."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1) if by < x.shape[1] else torch.full_like(x, fill)


def sample_starts(documents: torch.Tensor) -> torch.Tensor:
    """Each token's offset of its sample's first token in a packed row ``documents`` [B, T] (samples contiguous)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values


def resolved_parameters(loss: str, given: Mapping[str, float] | None = None) -> dict:
    """The settings loss ``loss`` reads, by name: ``given``, or unset their defaults (TrainingRecipe declares each once)."""
    training_loss(loss)  # an unknown loss is refused here, naming the registered ones
    return dict(given) if given is not None else TrainingRecipe(loss=loss).loss_parameters()


def _rejections(loss: str, rejected: torch.Tensor | None) -> dict:
    """The ``rejected`` keyword an anchored loss takes (refused without it); nothing for the others."""
    if not training_loss(loss).anchored:
        return {}
    if rejected is None:
        raise ValueError(f"loss {loss!r} reads where the server rejected the draft: it needs a refinement round's anchors")
    return {"rejected": rejected}


def position_loss(
    logits: torch.Tensor, target: torch.Tensor, loss: str, parameters: Mapping[str, float] | None = None, rejected: torch.Tensor | None = None
) -> torch.Tensor:
    """Each position's loss (last dimension: the draft vocabulary) for float32 ``logits`` and the target's
    distribution ``target``: loss ``loss``'s registered value; differentiable by autograd, and
    :func:`position_loss_grad` is its gradient. ``parameters``: the settings it reads (unset: their defaults);
    ``rejected``: per position, where the server rejected the draft (what an anchored loss reads)."""
    return training_loss(loss).value(logits, target, **resolved_parameters(loss, parameters), **_rejections(loss, rejected))


def position_loss_grad(
    logits: torch.Tensor, target: torch.Tensor, loss: str, parameters: Mapping[str, float] | None = None, rejected: torch.Tensor | None = None
) -> torch.Tensor:
    """d :func:`position_loss` / d ``logits``: the registered gradient, written out so that the chunked loss keeps no graph."""
    return training_loss(loss).gradient(logits, target, **resolved_parameters(loss, parameters), **_rejections(loss, rejected))


class ChunkedHeadLoss(torch.autograd.Function):
    """``sum_n weight[n] * position_loss(h[n] @ W.T, softmax(target_logits[rows[n]]))`` a chunk of positions at a time.

    Forward keeps nothing of size [tokens, vocabulary]; backward recomputes
    each chunk's logits and takes :func:`position_loss_grad` (for the default
    ``kl``: (softmax(logits) - p) * weight). Also returns each position's
    argmax (no gradient) for the accuracy figures. ``parameters``: the
    settings the loss reads, by name.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx, hidden, weight, target_logits, rows, token_weight, chunk: int, loss_name: str = "kl", parameters: Mapping | None = None,
        rejected: torch.Tensor | None = None,
    ):  # fmt: skip
        parameters = resolved_parameters(loss_name, parameters)  # once, not per chunk
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        argmax = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            logits = (hidden[start:end] @ weight.to(hidden.dtype).T).float()
            target = torch.softmax(target_logits[rows[start:end]].float(), dim=-1)
            part = rejected[start:end] if rejected is not None else None
            loss += (position_loss(logits, target, loss_name, parameters, part) * token_weight[start:end]).sum()
            argmax[start:end] = logits.argmax(-1)
        ctx.save_for_backward(hidden, weight, target_logits, rows, token_weight)
        ctx.chunk, ctx.loss_name, ctx.parameters, ctx.rejected = chunk, loss_name, parameters, rejected
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_loss, _grad_argmax):
        hidden, weight, target_logits, rows, token_weight = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            logits = (h @ w.T).float()
            target = torch.softmax(target_logits[rows[start:end]].float(), dim=-1)
            part = ctx.rejected[start:end] if ctx.rejected is not None else None
            grad_logits = position_loss_grad(logits, target, ctx.loss_name, ctx.parameters, part).mul_((token_weight[start:end] * grad_loss)[:, None])
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits.to(hidden.dtype) @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None, None, None, None, None


class TrainingTimeTest(nn.Module):
    """The draft unrolled ``steps`` times; ``forward`` is the whole loss so that DDP syncs its gradients.

    Chain t starts from the target's states at position t. At step k it reads
    token x[t+1+k] (teacher-forced tokens, the draft's own hidden state) and
    predicts the target's distribution at position t+1+k, i.e. token t+2+k,
    which is supervised where ``loss_mask`` is 1 and the target's top token is
    in the draft vocabulary (elsewhere no draft can be accepted anyway).

    ``checkpoint_steps`` and ``loss_chunk_tokens`` (0: the whole micro-batch
    at once) change the memory, not the result.

    ``anchors`` ([B, T, k] int8, a refinement round's: :data:`REJECTED` where
    the server's verification first rejected chain t's proposal at step j):
    what an anchored loss (``opd_anchored``) reads; steps past ``k`` read
    :data:`UNSERVED`, and so does a batch without anchors (supervised samples
    only: the loop refuses an anchored loss on data with no anchors at all).
    """

    def __init__(
        self, draft: Eagle3Draft, steps: int, step_weight: float, *,
        checkpoint_steps: bool = False, loss_chunk_tokens: int = 0, loss: str = "kl", loss_parameters: Mapping[str, float] | None = None,
    ):  # fmt: skip
        super().__init__()
        self.draft, self.steps, self.step_weight = draft, steps, step_weight
        self.checkpoint_steps, self.loss_chunk_tokens = checkpoint_steps, loss_chunk_tokens
        # An unknown loss is refused here; the settings it reads (lk_hybrid: lk_eta) resolved once.
        self.loss, self.loss_parameters = loss, resolved_parameters(loss, loss_parameters)

    def forward(
        self, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, target_logits: torch.Tensor, target_top: torch.Tensor,
        documents: torch.Tensor | None = None, anchors: torch.Tensor | None = None,
    ):  # fmt: skip
        """``documents`` (a packed row's sample per token, :func:`~eagle3_assets.core.training.data.load_batch`): each
        sample then counts its positions from 0, attends only within itself, and no chain runs past its end."""
        draft = self.draft
        batch, length = input_ids.shape
        anchored = training_loss(self.loss).anchored
        positions = torch.arange(length, device=input_ids.device).expand_as(input_ids)
        if documents is not None:
            positions = positions - sample_starts(documents)
        if self.loss_chunk_tokens:
            flat_targets = target_logits.reshape(batch * length, -1)
        else:
            target_probs = torch.softmax(target_logits.float(), dim=-1)
        hidden = draft.fuse(aux)
        kv: list[torch.Tensor] = []  # keys and values of the steps so far, flat: k0, v0, k1, v1, ...
        loss = torch.zeros((), device=hidden.device)
        step_losses, correct, counts = [], [], []
        for k in range(self.steps):
            top_k = shift_left(target_top, 1 + k)
            mask = shift_left(loss_mask, 2 + k, False) & draft.t2d[top_k]
            if documents is not None:  # the position predicted is in the chain's own sample
                mask = mask & (shift_left(documents, 2 + k, -1) == documents)
            count = mask.sum()
            ids_k = shift_left(input_ids, 1 + k)
            rejected = None
            if anchored:
                in_anchors = anchors is not None and k < anchors.shape[-1]
                rejected = anchors[..., k] == REJECTED if in_anchors else torch.zeros_like(loss_mask, dtype=torch.bool)

            def one_step(hidden: torch.Tensor, *cache_flat: torch.Tensor, k=k, ids_k=ids_k, mask=mask, count=count, rejected=rejected):
                """Step k from the draft's state and the cache: (weighted loss, next state, this step's key, value, argmax)."""
                cache = [(cache_flat[i], cache_flat[i + 1]) for i in range(0, len(cache_flat), 2)]
                normed, next_hidden = draft.step_states(ids_k, hidden, positions + k, cache, documents)
                if self.loss_chunk_tokens:
                    # Position (b, t) is trained towards the target's distribution at (b, t + 1 + k): a row index,
                    # clamped where the mask is 0 anyway.
                    rows = (torch.arange(batch * length, device=hidden.device) + 1 + k).clamp(max=batch * length - 1)
                    token_weight = mask.reshape(-1).float() / count.clamp(min=1)
                    step_loss, argmax = ChunkedHeadLoss.apply(
                        normed.reshape(batch * length, -1), draft.lm_head.weight, flat_targets, rows, token_weight,
                        self.loss_chunk_tokens, self.loss, self.loss_parameters,
                        rejected.reshape(-1) if rejected is not None else None,
                    )  # fmt: skip
                    argmax = argmax.view(batch, length)
                else:
                    logits = draft.lm_head(normed)
                    token_loss = position_loss(logits.float(), shift_left(target_probs, 1 + k), self.loss, self.loss_parameters, rejected)
                    step_loss = (token_loss * mask).sum() / count.clamp(min=1)
                    argmax = logits.detach().argmax(-1)
                return step_loss, next_hidden, cache[-1][0], cache[-1][1], argmax

            if self.checkpoint_steps and torch.is_grad_enabled():
                step_loss, hidden, key, value, argmax = checkpoint(one_step, hidden, *kv, use_reentrant=False)
            else:
                step_loss, hidden, key, value, argmax = one_step(hidden, *kv)
            kv += [key, value]
            loss = loss + self.step_weight**k * step_loss
            with torch.no_grad():
                hit = draft.draft_to_target_ids(argmax) == top_k
                step_losses.append(step_loss.detach())
                correct.append((hit & mask).sum())
                counts.append(count)
        stats = torch.stack([torch.stack(step_losses), torch.stack(correct).float(), torch.stack(counts).float()])
        return loss, stats  # stats: [3, steps] = per-step loss, correct, supervised positions
