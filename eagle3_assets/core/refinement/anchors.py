"""Where the server's verification fell, as a mask over a stored sample's unrolled chains: the anchors of on-policy training.

The replay (:mod:`.replay`) places each verify step of a served request on the
stored sample (prompt + completion): its first proposal is for absolute
position ``s = P + o`` (``P`` prompt tokens, ``o`` the step's output
position), from the chain that starts at ``t = s - 2``. In the unrolled
training loss (:class:`~eagle3_assets.core.training.loss.TrainingTimeTest`),
chain ``t`` at unrolled step ``j`` is trained towards the target's token at
``t + 2 + j``: the step's ``j``-th proposal. So each step with ``a`` accepted
of ``d`` drafted proposals marks, in row ``t`` of a ``[T, k]`` mask,

- columns ``0 .. a - 1``: :data:`ACCEPTED` (the server accepted them), and
- column ``a`` when ``a < d``: :data:`REJECTED` (the server's first rejection
  in that step; the replay's ``rejected_token`` is the draft's proposal there,
  ``target_token`` the stored token at ``t + 2 + a``).

Everything else stays :data:`UNSERVED` (no step drafted it, or drafts past a
rejection, which the server threw away). The counts are the server's
(``server_accepted``), not the replay's: where they disagree (at most 5 % of
steps, or the round is refused), the server's is where it really stopped.
Drafts whose token lies past the stored sample (a step a stop cut) are left
out: there is no target state to train them on.

Up to and including a step's rejection, the draft's own proposals equal the
stored tokens, so the teacher-forced chain of the training loss is the chain
the server ran there (the replay's module docstring): the anchors mark exactly
the positions whose outcome the server decided.

Dagster-free, torch only.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_assets.core.refinement.replay import ReplayedStep
from eagle3_assets.core.training.data import ANCHORS_FILE
from eagle3_assets.core.training.loss import ACCEPTED, REJECTED, UNSERVED  # what the unrolled loss reads

__all__ = ["ACCEPTED", "ANCHORS_FILE", "REJECTED", "UNSERVED", "anchor_counts", "anchor_mask", "write_anchors"]


def anchor_mask(steps: Sequence[ReplayedStep], prompt_tokens: int, total_tokens: int, k: int) -> torch.Tensor:
    """``[total_tokens, k]`` int8: for chain ``t`` (states at ``t``) and unrolled step ``j`` (the token at ``t + 2 + j``),
    whether the server accepted that proposal (:data:`ACCEPTED`), rejected it first (:data:`REJECTED`), or never
    decided it (:data:`UNSERVED`). ``steps``: one request's replayed steps, in order; ``k``: the server's
    ``num_speculative_tokens`` (columns past the training's ``ttt_steps`` are simply not read)."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt of {prompt_tokens} tokens: a verify step's chain starts inside the prompt")
    mask = torch.zeros(total_tokens, k, dtype=torch.int8)
    for step in steps:
        if step.drafted > k:
            raise ValueError(f"a step drafted {step.drafted} tokens, more than k = {k}")
        chain = prompt_tokens + step.output_position - 2
        accepted = step.server_accepted
        for j in range(accepted):
            if chain + 2 + j < total_tokens:
                mask[chain, j] = ACCEPTED
        if accepted < step.drafted and chain + 2 + accepted < total_tokens:
            mask[chain, accepted] = REJECTED
    return mask


def anchor_counts(mask: torch.Tensor) -> dict[str, int]:
    """What a mask marks, for a round's report: accepted and rejected proposals, and chains with any."""
    return {
        "accepted": int((mask == ACCEPTED).sum()),
        "rejected": int((mask == REJECTED).sum()),
        "chains": int((mask != UNSERVED).any(-1).sum()),
    }


def write_anchors(shard_dir: str | Path, masks: Mapping[str, torch.Tensor]) -> Path:
    """``masks`` (sample id -> :func:`anchor_mask`) written beside the on-policy shard's parts as :data:`ANCHORS_FILE`,
    atomically; training reads it (``core/training/data.py``) and the run's fingerprint covers it.

    Refused when a sample id is not the shard's or a mask's length is not its sample's token count. Samples left out
    are trained without anchors (forward KL under ``opd_anchored``).
    """
    shard_dir = Path(shard_dir)
    meta = json.loads((shard_dir / "metadata.json").read_text())
    tokens = dict(zip(map(str, meta["sample_ids"]), meta["num_tokens"]))
    for sample_id, mask in masks.items():
        if sample_id not in tokens:
            raise ValueError(f"anchors for sample {sample_id!r}, which shard {shard_dir} does not hold")
        if mask.dim() != 2 or mask.shape[0] != tokens[sample_id]:
            raise ValueError(f"anchors of sample {sample_id!r}: shape {tuple(mask.shape)}, its sample has {tokens[sample_id]} tokens")
    fd, staging = tempfile.mkstemp(prefix=f".{ANCHORS_FILE}.", dir=shard_dir)
    os.close(fd)
    try:
        save_file({sample_id: mask.to(torch.int8).contiguous() for sample_id, mask in masks.items()}, staging)
        os.replace(staging, shard_dir / ANCHORS_FILE)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return shard_dir / ANCHORS_FILE
