"""The embedded default as a plug-in: the platform's resources and run config, specialised for the built-in targets.

The platform knows nothing of what is here: ``definitions.py`` picks these
resources when the environment names no target or no prompts, and ``make
demo`` (``pipeline.py``) runs the graph with them as any user would, through
the resources' and configs' public fields.

- :class:`DemoTargetModel`: ``path`` ``demo`` is the tiny target, built in
  code on first use; it brings its own held-out evaluation prompts, whose
  operands its training never saw;
- :class:`DemoPromptDataset`: ``source`` ``demo`` is the built-in prompt set,
  cut into a handful of shards, none of it held out (the target's own
  evaluation set serves);
- :data:`SAMPLING`, :data:`TRAINING_CONFIG`, :data:`VOCAB_MAPPING_CONFIG`: the
  generation settings and run config that fit the tiny targets on a CPU.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from eagle3_assets.glue.stage_configs import DraftTrainingConfig, VocabMappingConfig
from resources.prompt_dataset import PromptDataset, shard_size_from_env
from resources.target_model import TargetModel

# What target_model.path / prompt_dataset.source say (and EAGLE3_TARGET_MODEL / EAGLE3_PROMPTS) for the built-in ones.
BUILT_IN = "demo"

SHARD_SIZE = 64  # the built-in set is a few hundred prompts: a handful of shards

# How the tiny targets are sampled: their servers' context is 4,096 tokens, so the production
# max_tokens (8192) would fail the pre-flight; short answers, and 64 requests in flight suit 2 CPU cores.
MAX_TOKENS = 256
TEMPERATURE = 0.7
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "concurrency": 64}

# The tiny draft over the built-in ~300 traces (~17k tokens): 20 epochs, not 12, because the longer run
# reaches a clearly longer acceptance at 3 speculative tokens through vLLM for under twice the training time.
TRAINING_CONFIG = DraftTrainingConfig(epochs=20, learning_rate=3e-3, warmup_ratio=0.05, ttt_steps=3, batch_tokens=1024, max_seq_len=512)

# The long-trace target (long_target.py): the user's 8,192 completion tokens, 128 requests in flight (vLLM's CPU
# max_num_seqs; its demo's 64 prompts all at once, and the server's KV cache holds 128 at that length:
# targets.LONG_SERVING), at temperature 0.6, the generation's own default and what reasoning models are sampled at.
# Of its 64 prompts it kept its format in 62 at 0.6 and 53 at 1, where 3 ran to the 8,192 cap, near
# truncation_rate_low's 5 % (measured with bench/long_traces.py --generate: docs/performance.md#the-long-trace-target).
LONG_MAX_TOKENS = 8192
LONG_TEMPERATURE = 0.6
LONG_SAMPLING = {"max_tokens": LONG_MAX_TOKENS, "temperature": LONG_TEMPERATURE, "concurrency": 128}
# Its draft at the user's max_seq_len: every trace whole (the longest prompt and completion are under 8,192 tokens).
# The draft attends to the last 128 positions, as the target itself does (long_target.py): full attention ran at
# 306 tokens/s at 8,192 tokens, the window at 1,893 (bench/training.py --windows, one thread), so six epochs (168 steps)
# take about what one took (one epoch reached only 1.14 at k = 5: docs/performance.md#the-long-trace-target).
LONG_TRAINING_CONFIG = DraftTrainingConfig(
    epochs=6, learning_rate=3e-3, warmup_ratio=0.05, ttt_steps=3, batch_tokens=8192, max_seq_len=8192, draft_sliding_window=128
)

# The tiny targets write ~170 distinct tokens of their 640.
VOCAB_MAPPING_CONFIG = VocabMappingConfig(draft_vocab_size=256)


class DemoTargetModel(TargetModel):
    """The target, where ``path`` may also be ``demo``: the tiny target, built (once, cached) when first resolved."""

    path: str = Field(
        default=BUILT_IN,
        description=f"'{BUILT_IN}' for the built-in tiny target (built on first use), or an HF model directory on the hosts that run the stages",
    )

    def model_dir(self) -> Path:
        if self.path == BUILT_IN:
            from eagle3_assets.demo.stack import tiny_target_dir

            return tiny_target_dir()
        return super().model_dir()

    def builtin_eval_prompts(self) -> str | None:
        if self.path != BUILT_IN:
            return None
        from eagle3_assets.demo.stack import demo_eval_prompts_path

        return str(demo_eval_prompts_path())


class DemoPromptDataset(PromptDataset):
    """The prompts, where ``source`` may also be ``demo``: the built-in set, written (once) under the data directory."""

    source: str = Field(
        default=BUILT_IN,
        description=f"'{BUILT_IN}' for the built-in set, a JSONL/Parquet path, or hub dataset name ('org/name' or 'org/name:split')",
    )
    shard_size: int = Field(default=shard_size_from_env() or SHARD_SIZE, gt=0, description="rows per sample shard; changing it re-keys every shard")
    # The built-in prompts come with the tiny target's own held-out set: nothing of theirs is held out.
    holdout_share: float = Field(default=0.0, ge=0, lt=1, description=PromptDataset.model_fields["holdout_share"].description)
    # The demo's held-out sets are sized by their own settings (targets.py): their measured figures stand on them.
    holdout_min_prompts: int = Field(default=0, ge=0, description=PromptDataset.model_fields["holdout_min_prompts"].description)

    def resolved_source(self) -> str:
        if self.source == BUILT_IN:
            from eagle3_assets.demo.stack import demo_prompts_path

            return str(demo_prompts_path())
        return super().resolved_source()
