"""Train an EAGLE-3 draft on target hidden states ("training-time test"): one loop, fed by one batch source.

By concern: ``config`` (what a run is told), ``data`` (the shards as samples,
micro-batches, an epoch's plan), ``sources`` (where batches come from: the
stored shards) and ``streamed`` (bounded-disk mode: a window of shards
extracted as training consumes them), ``loss`` (the draft unrolled on its own
states), ``losses`` (the registry of training losses: one entry each), ``memory`` (the step's peak estimated from the shapes, the
micro-batch planned to fit), ``initial_weights`` (from scratch or
fine-tuning), ``checkpoints`` (atomic, resumable, the journal, the export),
``loop`` (the training loop, top to bottom), ``launch`` and ``__main__`` (this
process or ``torchrun``), ``curves`` (what the asset shows of a run) and
``throughput`` (the step's tokens/s and TFLOP/s, for the bench and the GPU
self-test). The target's head (final norm and ``lm_head``) is
:class:`eagle3_assets.core.target.head.TargetHead`.
"""
