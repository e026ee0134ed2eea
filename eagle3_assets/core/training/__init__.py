"""Train an EAGLE-3 draft on stored target hidden states ("training-time test").

By concern: ``config`` (what a run is told), ``data`` (the shards as samples,
micro-batches, an epoch's plan), ``loss`` (the draft unrolled on its own states),
``initial_weights`` (from scratch or fine-tuning), ``checkpoints`` (atomic,
resumable, exported), ``loop`` (the training loop, top to bottom), ``launch``
(this process or ``torchrun``) and ``curves`` (what the asset shows of a run).
The target's head (final norm and ``lm_head``) is :class:`eagle3_assets.core.target_head.TargetHead`.
"""
