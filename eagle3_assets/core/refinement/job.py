"""What ``refine_draft`` is told: one refinement round's job and its settings.

The user-facing settings are one model, :class:`RefinementRecipe`: the
``refinement_round`` asset's Dagster ``Config`` class is that model with
Dagster's base mixed in, and the job (:class:`RefinementJob`) adds what the
asset fills in (the round's directory, the draft it starts from, the prompts,
the target). The asset sends ``job.model_dump()`` as the Pipes extras; the
stage reads it back with ``RefinementJob.from_dict`` (strict). Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.evaluation.job import EVAL_MAX_TOKENS
from eagle3_assets.core.extraction.job import StageTarget
from eagle3_assets.core.refinement.training import DEFAULT_LOSS
from eagle3_assets.core.settings.job_schema import JobSchema, given, setting


class RefinementRecipe(JobSchema):
    """How a round serves, trains and judges: ``refinement_round``'s settings (its Dagster config is this class)."""

    prompts_per_round: int = setting(64, "held-in prompts served per round (each round takes the next ones, wrapping round)", gt=0)
    max_tokens: int = setting(2048, "completion tokens per served prompt", gt=0)
    # The user's profile serves 128 requests in flight: acceptance at that batch is what the round mines.
    concurrency: int = setting(128, "requests in flight while serving the round's prompts and the held-out gate", gt=0)
    num_speculative_tokens: int = setting(3, "k the current and the refined draft are served at (the round's and the gate's servers)", gt=0)
    allow_truncated: bool = setting(
        False, "keep served completions that hit max_tokens (validated_traces' rule of the same name); false: rejected as truncated"
    )
    extraction_backend: str = setting("transformers", "the engine that captures the kept completions' states ('vllm' for large targets)")
    extraction_dtype: str = setting("bfloat16", "storage precision of the round's states (hidden_states' dtype setting)")
    loss: str = setting(DEFAULT_LOSS, "the on-policy loss the round trains with: 'opd' (Draft-OPD), 'opd_anchored' (reverse KL where vLLM rejected)")
    supervised_share: float = setting(
        0.5, "share of the supervised hidden_states shards' samples mixed into the round's on-policy ones (0: none, 1: all)", ge=0, le=1
    )
    epochs: int = setting(2, "passes over the round's samples", gt=0)
    # Fixed, not the trainer's from-scratch fit: at a published draft's width and batch the two are equal, and on the
    # narrow built-in drafts the larger fit gained nothing over 1e-4, 3 seeds on each target (docs/performance.md).
    learning_rate: float = setting(1e-4, "peak AdamW learning rate of the round's fine-tuning", gt=0)
    warmup_ratio: float = setting(0.05, "share of the round's optimizer steps spent warming up linearly", ge=0, lt=1)
    ttt_steps: int = setting(3, "training-time test: draft steps unrolled on the draft's own states", gt=0)
    batch_tokens: int | None = setting(None, "tokens per micro-batch; default: the trainer's fit to the data", gt=0)
    max_seq_len: int = setting(8192, "longer samples are truncated in training", gt=0)
    seed: int = setting(0, "seed of the batch order and of the supervised samples drawn")
    eval_max_tokens: int = setting(EVAL_MAX_TOKENS, "completion tokens per held-out prompt in the gate's passes", gt=0)
    max_eval_prompts: int = setting(64, "at most this many held-out prompts judge the refined draft against the starting one", gt=0)
    gate_margin: float = setting(
        0.0,
        "refined_not_worse blocks the refined draft when its held-out mean acceptance length is below the starting "
        "draft's minus this (0: any loss blocks it)",
        ge=0,
    )


    def check(self) -> None:
        """Refuse a setting the stage would only trip on after a start of the target, naming it (no torch needed)."""
        from eagle3_assets.core.extraction.backends import extraction_backend
        from eagle3_assets.core.extraction.state_layout import STORAGE_DTYPE_BYTES
        from eagle3_assets.core.training.losses import LOSSES

        problems = []
        if self.loss not in LOSSES:
            problems.append(f"loss {self.loss!r}: one of {sorted(LOSSES)}")
        if self.extraction_dtype not in STORAGE_DTYPE_BYTES:
            problems.append(f"extraction_dtype {self.extraction_dtype!r}: one of {sorted(STORAGE_DTYPE_BYTES)}")
        try:
            extraction_backend(self.extraction_backend)
        except ValueError as exc:
            problems.append(f"extraction_backend: {exc}")
        if problems:
            raise ValueError("refinement_round config: " + "; ".join(problems))


class RefinementJob(RefinementRecipe):
    """One refinement round (``refine_draft``): serve, keep, extract, replay, train, gate."""

    round: int = given("the round's number (1 for the first)")
    round_dir: str = given("the round's directory: every file it writes, so a rerun resumes")
    start_draft: str = given("the exported draft the round starts from (draft_checkpoint's or an earlier round's kept draft)")
    target: StageTarget = given("the target as configured (its serving profile included)")
    vocab_mapping: str = given("vocab_mapping.safetensors the draft was trained with")
    prompts: str = given("the round's held-in prompts (Parquet: id, messages)")
    eval_prompts: str = given("the held-out prompts the gate serves (JSONL: id, messages)")
    supervised_dirs: list[str] = given("the supervised hidden_states shard directories mixed in")
    context_length: int = given("validation's max_seq_len: the longest kept trace (the target's context)")
    think_open: str | None = given("the target's start-of-thinking marker (None: found in its tokenizer)")
    think_close: str | None = given("the target's end-of-thinking marker (None: found in its tokenizer)")
    end_of_turn: str | None = given("the token that ends the assistant's turn (None: found in its template)")
