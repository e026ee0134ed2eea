"""What a training run is told: inputs, the recipe, and the draft's shape (each default written once, here).

``draft_checkpoint``'s Dagster config is :class:`TrainingRecipe` itself (with the
stage's and the hidden-state source's settings mixed in); the ``train_draft``
stage gets a :class:`TrainConfig`, the recipe plus what the asset fills in,
inside its job (:mod:`eagle3_assets.core.training.job`).
"""

from __future__ import annotations

from typing import ClassVar

from eagle3_assets.core.settings.job_schema import JobSchema, given, setting
from eagle3_assets.core.training.losses import LOSSES, known_losses
from eagle3_assets.core.training.optimizers import OPTIMIZERS


class TrainingRecipe(JobSchema):
    """The training settings a run of ``draft_checkpoint`` sets in the launchpad (its Dagster config is this class).

    Published EAGLE-3 recipes, with the schedule fitted to the data where it is left unset.
    """

    init_from: str | None = setting(None, "an existing EAGLE-3 directory (on the GPU host) to fine-tune")
    # Unset: fitted to the data before training (core/training/schedule.py); the run then records what was used.
    epochs: int | None = setting(None, "passes over all samples; default: 10, more when that is under 400 optimizer steps")
    learning_rate: float | None = setting(
        None, "peak learning rate (of both optimizers under muon); default: 1e-4 for a published-size draft, scaled to the draft's width and batch"
    )
    min_lr_ratio: float = setting(0.0, "cosine decay ends at learning_rate * min_lr_ratio")
    warmup_ratio: float = setting(0.02, "share of all optimizer steps spent warming up linearly")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    # speculators' default since 0.9 is Muon; ours stays AdamW unless Muon wins beyond the seeds' spread
    # (docs/performance.md#muon-against-adamw).
    optimizer: str = setting(
        "adamw", "'adamw', or 'muon': torch.optim.Muon on the draft's fc, attention and MLP matrices, at the same "
        "learning_rate and schedule (its update scaled to AdamW's size), and AdamW on its norms and lm_head",
    )  # fmt: skip
    muon_weight_decay: float = setting(0.1, "optimizer 'muon': decoupled weight decay of the Muon matrices (speculators' default)", ge=0)
    grad_clip: float = setting(0.5, "gradient norm clip")
    ttt_steps: int = setting(7, "training-time test: draft steps unrolled on the draft's own states")
    step_weight: float = setting(0.8, "loss weight of unrolled step i is step_weight**i")
    # One of the losses registered in core/training/losses.py, which this description lists.
    loss: str = setting(
        "kl", "what each position is trained towards: " + ", ".join(f"'{name}' ({entry.description})" for name, entry in LOSSES.items())
    )
    lk_eta: float = setting(3.0, "lk_hybrid: the blend's weight of KL is exp(-lk_eta * acceptance)", gt=0)
    # speculators trains with its head frozen; ours trains it by default. Frozen: no gradient, no AdamW state for it
    # (12 bytes a weight in float32: 2.56 GiB per process at Kimi width, 7,168 x a 32,000-token draft vocabulary).
    freeze_lm_head: bool = setting(False, "keep the draft's lm_head at its initial weights (from scratch: the target's rows): no gradient, no optimizer state")
    batch_tokens: int | None = setting(
        None, "tokens per micro-batch per process (padding included when not packed); default: up to 16,384, at least 64 micro-batches an epoch"
    )
    grad_accumulation: int = setting(1, "micro-batches per process per optimizer step")
    max_seq_len: int = setting(4096, "longer samples are truncated")
    # On by default: on the built-in tiny target's stored states (3 seeds, k = 5, depth 3) it took the draft from 3.89
    # to 4.14, against speculators' 3.81. Padded, a micro-batch held samples of one length, which on templated prompts
    # are one kind of question; the padding it saves was 0.7 % there (docs/performance.md#packing-three-seeds-in-one-run).
    pack_samples: bool = setting(
        True, "lay each micro-batch's samples end to end in one row, each attending within itself: no padding, and a "
        "micro-batch holds samples of any length, in a random order; false: samples of similar length, padded",
    )  # fmt: skip
    seed: int = setting(0, "seed of the draft's initial weights and of the batch order")
    draft_form: str = setting(
        "auto",
        "the draft's architecture: 'llama' (vLLM's LlamaForCausalLMEagle3, as published drafts), 'deepseek_mla' (vLLM's "
        "Eagle3DeepseekV2ForCausalLM: DeepSeek's latent attention) or 'auto' (the form the GPU host's vLLM serves beside "
        "the target: Llama unless its attention cannot share the target's KV blocks, as for an MLA target on a CPU)",
    )
    draft_intermediate_size: int | None = setting(None, "MLP width of the draft layer (default: the target's)")
    draft_sliding_window: int | None = setting(
        None, "llama form: each position attends to the last this many only, in training and as vLLM serves the draft "
        "(config.json's sliding_window); None: full attention. Attention then costs O(T x window), not O(T^2)", ge=1,
    )
    draft_q_lora_rank: int | None = setting(None, "deepseek_mla form: the query's latent rank (default: the target's, else 1536 or the width)")
    draft_kv_lora_rank: int | None = setting(
        None, "deepseek_mla form: the KV latent rank (default: the target's, else 512; on a CPU it must be 576 - qk_rope_head_dim)"
    )
    # EAGLE 3.1 and its relatives (core/draft/model.py): config.json flags vLLM reads; all off is plain EAGLE-3.
    fc_norm: bool = setting(False, "EAGLE 3.1: an RMSNorm on each auxiliary target state before fc (both forms)")
    norm_output: bool = setting(False, "EAGLE 3.1: each unrolled step takes the previous step's post-norm state (both forms)")
    norm_before_fc: bool = setting(False, "one RMSNorm over the concatenated auxiliary states before fc (llama form only; not with fc_norm)")
    # On by default: on the built-in tiny target's stored states, 3 seeds, k = 5, it took the draft from 3.57 to 3.95 against speculators' 3.80
    # (docs/performance.md, P5c); positions 4 and 5, past the trained depth, gained most. It adds no weights.
    norm_before_residual: bool = setting(True, "the residual path starts from hidden_norm's output, not the raw fused state (both forms)")
    # Memory (core/training/memory.py plans the micro-batch with these before the first step).
    activation_checkpointing: bool = setting(
        True, "recompute each unrolled step in backward: one step's activations in memory at a time (about 1/3 more compute)"
    )
    loss_chunk_tokens: int = setting(
        2048, "positions per chunk of the draft's lm_head and loss (no full draft-vocabulary logits); 0: the whole micro-batch at once", ge=0
    )
    target_head_chunk_tokens: int = setting(
        1024, "positions per chunk of the target's full-vocabulary head (its top-1 and draft-vocabulary logits); 0: all at once", ge=0
    )
    memory_fraction: float = setting(
        0.9, "share of the device's free memory (CPU: available RAM) a training step may plan to use", gt=0, le=1
    )

    def loss_parameters(self) -> dict:
        """The settings the configured loss reads (its registered ``parameters``), by name: what its value and gradient take."""
        return {name: getattr(self, name) for name in LOSSES[self.loss].parameters}


class TrainConfig(TrainingRecipe):
    """A training run: the recipe, the inputs the asset fills in, and the recipe constants and run mechanics a
    launchpad user has no reason to change (the CLI and tests can)."""

    hidden_state_dirs: list[str] = given("one directory per shard (the hidden_states contract)")
    vocab_mapping: str = given("vocab_mapping.safetensors (or its directory)")
    target_path: str = given("the target's HF directory: its lm_head, final norm and embedding")
    training_dir: str = given("where checkpoints, history.json and result.json go")
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas")
    head_from_target: bool = setting(True, "from scratch: start norm + lm_head as the target's (restricted to the draft's rows)")
    bf16_autocast: bool = setting(True, "bfloat16 autocast on CUDA; a CPU run is in float32")
    draft_num_attention_heads: int | None = setting(None, "attention heads of the draft layer (default: the target's)")
    draft_num_key_value_heads: int | None = setting(None, "key/value heads of the draft layer (default: the target's)")
    draft_head_dim: int | None = setting(None, "head width of the draft layer (default: the target's)")
    log_every: int = setting(10, "optimizer steps between progress events")
    keep_checkpoints: int = setting(2, "step checkpoints kept (the newest)")
    torch_threads: int | None = setting(None, "torch threads; default: torch's on GPU hosts, 1 on CPU")
    # A refinement round (core/refinement/training.py): hidden_state_dirs hold the round's on-policy samples, these
    # the supervised ones it mixes in so the draft keeps what it had. By content in the fingerprint (the index's).
    supervised_dirs: list[str] = setting([], "supervised hidden-state shards mixed into hidden_state_dirs' samples (a refinement round)")
    supervised_share: float = setting(
        0.0, "share of supervised_dirs' samples mixed in, drawn with the run's seed: 0 none, 1 all of them"
    )

    # Fields that do not change what is computed (memory settings: up to float rounding), so resuming across them is fine.
    _NOT_IN_FINGERPRINT: ClassVar[tuple[str, ...]] = (
        "training_dir", "log_every", "keep_checkpoints", "torch_threads",
        "activation_checkpointing", "loss_chunk_tokens", "target_head_chunk_tokens", "memory_fraction",
    )  # fmt: skip

    # Settings added after benches had kept drafts, at the value every draft trained before them had implicitly: a
    # kept draft's key leaves them out at that value, so that adding a setting does not make it another draft.
    _AS_BEFORE_IT_EXISTED: ClassVar[dict[str, object]] = {"optimizer": "adamw"}
    # Settings that change nothing unless another setting has a value: (that setting, its value).
    _ONLY_WITH: ClassVar[dict[str, tuple[str, object]]] = {"muon_weight_decay": ("optimizer", "muon")}

    def validate(self) -> None:
        problems = []
        if self.epochs is not None and self.epochs < 1:
            problems.append(f"epochs {self.epochs} < 1")
        if self.ttt_steps < 1:
            problems.append(f"ttt_steps {self.ttt_steps} < 1")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            problems.append(f"batch_tokens {self.batch_tokens} < 1")
        if self.learning_rate is not None and self.learning_rate <= 0:
            problems.append(f"learning_rate {self.learning_rate} <= 0")
        if self.grad_accumulation < 1:
            problems.append(f"grad_accumulation {self.grad_accumulation} < 1")
        if self.fc_norm and self.norm_before_fc:
            problems.append("fc_norm and norm_before_fc both set: one norm per auxiliary state or one over their concatenation, not both")
        if self.freeze_lm_head and not self.head_from_target and self.init_from is None:
            problems.append("freeze_lm_head with head_from_target false: the draft's lm_head would stay at its random initial weights")
        if self.loss not in LOSSES:
            problems.append(f"loss {self.loss!r}: one of {known_losses()} (core/training/losses.py registers them)")
        else:
            unknown = [name for name in LOSSES[self.loss].parameters if name not in type(self).model_fields]
            if unknown:
                problems.append(f"loss {self.loss!r} reads {unknown}, which are no training settings (declare each in core/training/config.py)")
        if not 0.0 <= self.supervised_share <= 1.0:
            problems.append(f"supervised_share {self.supervised_share} outside [0, 1]: the share of supervised_dirs' samples mixed in")
        if self.supervised_share > 0 and not self.supervised_dirs:
            problems.append(f"supervised_share {self.supervised_share} with no supervised_dirs: no supervised samples to mix in")
        if set(self.supervised_dirs) & set(self.hidden_state_dirs):
            problems.append(f"supervised_dirs and hidden_state_dirs share {sorted(set(self.supervised_dirs) & set(self.hidden_state_dirs))}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer {self.optimizer!r}: one of {', '.join(repr(o) for o in OPTIMIZERS)}")
        if self.draft_form not in ("auto", "llama", "deepseek_mla"):
            problems.append(f"draft_form {self.draft_form!r}: one of 'auto', 'llama', 'deepseek_mla'")
        if problems:
            raise ValueError("training settings: " + "; ".join(problems))


def trained_settings(settings: dict) -> dict:
    """Every setting that changes what a run trains: ``settings`` over :class:`TrainConfig`'s defaults of the day.

    What a bench keys a kept draft by, so that a draft trained before a default changed is not taken for one
    trained after it. A setting added since at the value that trains as before it existed, and one that changes
    nothing under the others, are left out: the same draft keeps its key.
    """
    defaults = {
        name: field.get_default(call_default_factory=True)
        for name, field in TrainConfig.model_fields.items()
        if not field.is_required() and name not in TrainConfig._NOT_IN_FINGERPRINT
    }
    merged = {**defaults, **settings}
    inert = {name for name, (other, value) in TrainConfig._ONLY_WITH.items() if merged.get(other) != value}
    inert |= {name for name, before in TrainConfig._AS_BEFORE_IT_EXISTED.items() if merged.get(name) == before}
    return {name: value for name, value in merged.items() if name not in inert}
