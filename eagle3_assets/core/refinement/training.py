"""A refinement round's training run: the current draft, trained on the round's on-policy samples and a share of the supervised ones.

The round's completions are the target's own traces (speculative decoding is
lossless); their states come from the existing extraction, as hidden-state
shards. Training then *continues* from the draft that served them, through the
trainer's one fine-tuning path (``init_from``:
:func:`~eagle3_assets.core.training.initial_weights.initial_draft`; the run's
``result.json`` records it as ``init.source``, which is what
:func:`~eagle3_assets.defs.draft_evaluation.resolve_baseline` ``('starting')``
judges the refined draft against), with an on-policy loss (``'opd'`` by default,
any registered one may be named) over those shards mixed with
``supervised_share`` of the supervised shards' samples
(:func:`~eagle3_assets.core.training.data.mixed_index`), so the draft keeps
what it had.

The loss and the share are training settings, so both are in the run's
fingerprint (:func:`~eagle3_assets.core.training.checkpoints.run_fingerprint`):
a round retrained with another of either does not resume the earlier one's
checkpoints.

Dagster-free.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.core.training.config import TrainConfig

DEFAULT_LOSS = "opd"


def round_training_config(
    recipe: TrainConfig,
    current_draft: str | Path,
    on_policy_dirs: list[str | Path],
    supervised_dirs: list[str | Path],
    supervised_share: float,
    loss: str = DEFAULT_LOSS,
) -> TrainConfig:
    """``recipe`` (the supervised run's settings: target, vocabulary map, shape, schedule) turned into the round's run.

    Refused (a ``ValueError`` naming the setting) for a share outside [0, 1], an unknown loss, a missing draft
    or no on-policy shards.
    """
    if not on_policy_dirs:
        raise ValueError("refinement round: no on-policy hidden-state shards (the round's completions, extracted)")
    if not (Path(current_draft) / "config.json").is_file():
        raise ValueError(f"refinement round: current draft {current_draft} has no config.json (an exported EAGLE-3 directory)")
    config = recipe.model_copy(
        update={
            "init_from": str(current_draft),
            "hidden_state_dirs": [str(d) for d in on_policy_dirs],
            "supervised_dirs": [str(d) for d in supervised_dirs],
            "supervised_share": float(supervised_share),
            "loss": loss,
        }
    )
    config.validate()
    return config
