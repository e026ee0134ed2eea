"""The draft's optimizers: AdamW over every trainable weight (the default), or Muon beside AdamW.

Muon (``torch.optim.Muon``) orthogonalises each update of a weight matrix by a
few Newton-Schulz iterations; it is speculators' default since 0.9. It is
defined for matrices that map one hidden space into another, so with
``optimizer = "muon"`` it takes the draft's fc, attention and MLP matrices and
AdamW keeps the rest: the norms' vectors, and the lm_head, whose rows are
per-token output embeddings rather than a map between hidden spaces (the
convention of Muon's authors and of speculators). Both take the run's
learning rate and schedule: Muon scales its update to AdamW's RMS
(``adjust_lr_fn="match_rms_adamw"``), which is what lets it share AdamW's rate.

Muon keeps one momentum buffer per weight, AdamW two moments: the memory
estimate (core/training/memory.py) counts the optimizer state that way.

torch is imported where the optimizers are built: the settings' validation
reads :data:`OPTIMIZERS`, and the code location loads without the ML packages
(tests/test_import_graph.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZERS = ("adamw", "muon")

# speculators 0.9's Muon defaults (momentum, Newton-Schulz steps): the peer's recipe, so the comparison is of the optimizer.
MUON_MOMENTUM = 0.95
MUON_NS_STEPS = 5
_NOT_FOR_MUON = ("lm_head", "embed_tokens")  # vocabulary-indexed rows, not a map between hidden spaces


def takes_muon(name: str, parameter: torch.Tensor) -> bool:
    """A trainable matrix of at least 2 x 2 that is not a vocabulary's rows."""
    return parameter.ndim == 2 and min(parameter.shape) > 1 and not any(part in name.split(".") for part in _NOT_FOR_MUON)


def build_optimizers(draft: nn.Module, *, optimizer: str, learning_rate: float, betas: tuple[float, float],
                     weight_decay: float, muon_weight_decay: float) -> list[torch.optim.Optimizer]:  # fmt: skip
    """The optimizers that step the draft's trainable weights, each weight in exactly one."""
    import torch

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    trainable = [(name, p) for name, p in draft.named_parameters() if p.requires_grad]
    if optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in trainable], lr=learning_rate, betas=betas, weight_decay=weight_decay)]
    matrices = [p for name, p in trainable if takes_muon(name, p)]
    rest = [p for name, p in trainable if not takes_muon(name, p)]
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        optimizers.append(
            torch.optim.Muon(
                matrices, lr=learning_rate, weight_decay=muon_weight_decay, momentum=MUON_MOMENTUM, nesterov=True,
                ns_steps=MUON_NS_STEPS, adjust_lr_fn="match_rms_adamw",
            )  # fmt: skip
        )
    if rest:
        optimizers.append(torch.optim.AdamW(rest, lr=learning_rate, betas=betas, weight_decay=weight_decay))
    return optimizers
