"""The unrolled loss ("training-time test").

At inference the draft's second and later tokens are conditioned on its *own*
previous state, not the target's. Training only on the target's states teaches
a draft that falls apart after one token, so the draft is unrolled
``ttt_steps`` times on its own outputs and step i's loss is weighted
``step_weight ** i``.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3_assets.core.draft_model import Eagle3Draft


def shift_left(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """``out[:, t] = x[:, t + by]``, ``fill`` past the end."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1) if by < x.shape[1] else torch.full_like(x, fill)


class TrainingTimeTest(nn.Module):
    """The draft unrolled ``steps`` times; ``forward`` is the whole loss so that DDP syncs its gradients.

    Chain t starts from the target's states at position t. At step k it reads
    token x[t+1+k] (teacher-forced tokens, the draft's own hidden state) and
    predicts the target's distribution at position t+1+k, i.e. token t+2+k,
    which is supervised where ``loss_mask`` is 1 and the target's top token is
    in the draft vocabulary (elsewhere no draft can be accepted anyway).
    """

    def __init__(self, draft: Eagle3Draft, steps: int, step_weight: float):
        super().__init__()
        self.draft, self.steps, self.step_weight = draft, steps, step_weight

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, target_logits: torch.Tensor, target_top: torch.Tensor):
        draft = self.draft
        target_probs = torch.softmax(target_logits.float(), dim=-1)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = draft.fuse(aux)
        cache: list = []
        loss = torch.zeros((), device=hidden.device)
        step_losses, correct, counts = [], [], []
        for k in range(self.steps):
            logits, hidden = draft.step(shift_left(input_ids, 1 + k), hidden, positions + k, cache)
            probs_k = shift_left(target_probs, 1 + k)
            top_k = shift_left(target_top, 1 + k)
            mask = shift_left(loss_mask, 2 + k, False) & draft.t2d[top_k]
            count = mask.sum()
            token_loss = -(probs_k * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
            step_loss = (token_loss * mask).sum() / count.clamp(min=1)
            loss = loss + self.step_weight**k * step_loss
            with torch.no_grad():
                hit = draft.draft_to_target_ids(logits.argmax(-1)) == top_k
                step_losses.append(step_loss.detach())
                correct.append((hit & mask).sum())
                counts.append(count)
        stats = torch.stack([torch.stack(step_losses), torch.stack(correct).float(), torch.stack(counts).float()])
        return loss, stats  # stats: [3, steps] = per-step loss, correct, supervised positions

