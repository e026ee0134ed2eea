"""The training step's peak memory, estimated from the shapes, and the micro-batch planned to fit before the first step.

The estimate counts what the step holds at its peak (the last unrolled step
of a micro-batch, its attention or its loss's backward, with the gradients
and the optimizer state already there):

- the draft's weights, gradients and optimizer state (float32: 4 + 4 + 8 bytes a
  trainable parameter under AdamW; Muon keeps 4 bytes, one momentum, for each
  weight of the matrices it takes; under bf16 autocast a 2-byte copy of each
  weight too),
  its frozen embedding (and, with ``freeze_lm_head``, its head's weights alone),
  and the target's ``lm_head`` and norm;
- the micro-batch: the three auxiliary states and the final one in float32
  (a packed one is counted as its padded shape, ``batch_tokens`` tokens whose
  attention spans the longest sample: its samples attend one at a time, each
  within itself, so that bounds it);
- the attention, two ways (:func:`~eagle3_assets.core.draft.model.chain_attention`):
  samples of at most ``ATTENTION_BLOCK`` (1,024) tokens keep their
  probabilities for backward (one matrix a sample), longer ones are attended a
  block of query rows at a time, each block recomputed in backward, and keep
  nothing of it. So a micro-batch of many one-block samples can hold more than
  one of a single long sample: :func:`estimate_step_bytes` (what the planner
  uses) is the larger over the sample lengths up to ``seq_len`` where each
  regime peaks;
- the target's head: its draft-vocabulary logits (kept for every unrolled
  step), its distribution over them (kept unless the loss runs in chunks),
  and one chunk of its full-vocabulary logits while they are computed;
- per unrolled step and token, the activations autograd keeps, counted from
  :mod:`eagle3_assets.core.draft.model` and :mod:`.loss` (norms, the 2·H
  attention input, q/k/v and their rotations, the keys and values of every
  earlier step copied for the grouped heads, the attention probabilities over
  T + k keys (a sample of one block or less), the MLP's four I-wide tensors, the logits' log-softmax and the
  target distribution's shifted copy). With ``activation_checkpointing`` only
  each step's inputs stay (its state, key and value), plus one step's
  activations while it is recomputed; with ``loss_chunk_tokens`` the
  vocabulary-wide tensors are one chunk's;
- the last step's own transient, at whichever of two moments is larger: at
  its attention, two more tensors of its probabilities' size (the masked
  scores and softmax's input in forward; the probabilities' gradient and its
  slices' full-width buffer in backward; a blocked sample: three of its
  widest block's, nothing being kept) while its MLP and loss are not yet
  (or no longer) alive; at its loss, its vocabulary-wide transients (the
  logits and a product; chunked, one chunk's logits, distribution and
  gradient).

Each of these is a named term (:func:`estimate_terms`); :func:`peak_of` adds
them up. It is an estimate (allocator rounding and fragmentation are not in
it): tests/test_training_memory.py holds it to the peak measured on the CPU at
64 to 2,048 tokens, and fails when any term worth 5 % of the estimate at Kimi
width is dropped (but the four its NOT_SHOWN_NEEDED names, with why);
bench/training_memory.py measures 2,048 to 8,192 tokens.
:func:`plan_micro_batch` compares it with the device's free memory (CUDA:
``torch.cuda.mem_get_info``; CPU: the available RAM) times
``memory_fraction``, splits the micro-batch (raising ``grad_accumulation`` so
that an optimizer step sees the same tokens) until it fits, and refuses before
training when even the longest sequence alone cannot fit, with both numbers
and the settings that would make it fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from eagle3_assets.core.draft.model import ATTENTION_BLOCK, DraftConfig
from eagle3_assets.core.draft.model_mla import MLADraftConfig
from eagle3_assets.core.training.losses import training_loss

FLOAT32 = 4
# Each loss's vocabulary-wide tensors (kept unchunked, alive in a chunk's backward chunked) are in its entry in
# core/training/losses.py: this module names no loss.


@dataclass(frozen=True)
class StepShape:
    """What the estimate reads: the draft's shape, the micro-batch and the memory settings."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    target_hidden: int
    vocab: int  # the target's
    draft_vocab: int
    tokens: int  # padded tokens of the micro-batch
    seq_len: int  # its samples' length, its padded width (attention is seq_len wide per token; blocked past ATTENTION_BLOCK)
    ttt_steps: int
    activation_bytes: int = FLOAT32  # 2 under bf16 autocast
    activation_checkpointing: bool = False
    loss_chunk_tokens: int = 0
    target_head_chunk_tokens: int = 0
    attention_parameters: int = 0  # the MLA form's projections (0: grouped-query attention's, from the widths above)
    latent_width: int = 0  # the MLA form's query and KV latents per token
    frozen_lm_head: bool = False  # freeze_lm_head: the head's weights only, no gradient or optimizer state
    loss: str = "kl"  # the training loss (its vocabulary-wide tensors: its entry in core/training/losses.py)
    optimizer: str = "adamw"  # 'muon': one float of state for each weight of fc, attention and MLP, two for the rest

    @classmethod
    def of(cls, draft: DraftConfig | MLADraftConfig, tokens: int, seq_len: int, ttt_steps: int, *, bf16: bool, **settings) -> StepShape:
        if isinstance(draft, MLADraftConfig):
            # The MLA form up-projects its latents to a query, key and value per head: their activations are those
            # of multi-head attention of its widest head, plus the latents; its weights are its own projections'.
            kv_heads, head_dim = draft.num_attention_heads, max(draft.qk_nope_head_dim + draft.qk_rope_head_dim, draft.v_head_dim)
            mla = dict(attention_parameters=mla_attention_parameters(draft), latent_width=draft.q_lora_rank + draft.latent_head_size)
        else:
            kv_heads, head_dim, mla = draft.num_key_value_heads, draft.head_dim, {}
        return cls(
            hidden=draft.hidden_size, intermediate=draft.intermediate_size, heads=draft.num_attention_heads,
            kv_heads=kv_heads, head_dim=head_dim, target_hidden=draft.target_hidden_size, **mla,
            vocab=draft.vocab_size, draft_vocab=draft.draft_vocab_size, tokens=tokens, seq_len=min(seq_len, tokens),
            ttt_steps=ttt_steps, activation_bytes=2 if bf16 else FLOAT32, **settings,
        )  # fmt: skip

    @property
    def trainable_parameters(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (
            3 * self.target_hidden * h  # fc
            + (self.attention_parameters or 2 * h * (q + 2 * kv) + q * h)  # q/k/v over [embedding ; state], o
            + 3 * h * self.intermediate  # MLP
            + self.norm_parameters
            + (0 if self.frozen_lm_head else self.lm_head_parameters)
        )

    @property
    def norm_parameters(self) -> int:
        return 4 * self.hidden  # four norms of the hidden width

    @property
    def optimizer_state_floats(self) -> int:
        """AdamW's two moments for every trainable weight; under Muon one momentum for its matrices (all but the
        norms and the head, core/training/optimizers.py), AdamW's two for the rest."""
        if self.optimizer != "muon":
            return 2 * self.trainable_parameters
        adamw = self.norm_parameters + (0 if self.frozen_lm_head else self.lm_head_parameters)
        return (self.trainable_parameters - adamw) + 2 * adamw

    @property
    def lm_head_parameters(self) -> int:
        return self.draft_vocab * self.hidden

    @property
    def blocked_attention(self) -> bool:
        """Its samples are attended a block of query rows at a time, each recomputed in backward: no probabilities kept."""
        return self.seq_len > ATTENTION_BLOCK


def mla_attention_parameters(draft: MLADraftConfig) -> int:
    """The MLA form's attention weights: low-rank query, joint KV latent with the shared rotary key, their norms, o."""
    h, heads, q_rank, kv_rank = draft.hidden_size, draft.num_attention_heads, draft.q_lora_rank, draft.kv_lora_rank
    qk = draft.qk_nope_head_dim + draft.qk_rope_head_dim
    return (
        2 * h * q_rank + q_rank + q_rank * heads * qk  # q_a over [embedding ; state], its norm, q_b
        + 2 * h * draft.latent_head_size + kv_rank + kv_rank * heads * (draft.qk_nope_head_dim + draft.v_head_dim)  # kv_a, norm, kv_b
        + heads * draft.v_head_dim * h  # o
    )


def step_activation_terms(shape: StepShape, k: int, tokens: int | None = None) -> dict[str, int]:
    """Bytes autograd keeps for unrolled step ``k`` (0-based) of a micro-batch, without checkpointing, by term."""
    s, n, a = shape, tokens if tokens is not None else shape.tokens, shape.activation_bytes
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_token = {
        # norms keep their float32 input and normalised value; the 2·H attention input; residual, MLP input, state
        "norms": 11 * s.hidden * FLOAT32,
        # the rotated q and k, v, the attention output before o_proj (the rotations keep only their cos and sin: a
        # product with a tensor that takes no gradient keeps that tensor, not the other; measured, issue 39)
        "attention_projections": (2 * q + 2 * kv) * a,
        # every earlier step's key and value copied to the query heads (grouped-query attention)
        "grouped_kv_copies": 2 * (k + 1) * q * a,
        # the attention probabilities over the sequence and the chain's k earlier keys, in float32 (a blocked sample
        # keeps none: each block is recomputed in backward)
        "attention_probabilities": 0 if s.blocked_attention else s.heads * (s.seq_len + k) * FLOAT32,
        # the negated causal mask the masked scores keep for backward: one byte a key, for all heads (blocked: none)
        "causal_mask": 0 if s.blocked_attention else s.seq_len,
        # the MLP: gate, its SiLU, up, their product
        "mlp": 4 * s.intermediate * a,
        # the MLA form's latents: the projection's output and its norm's float32 input and value
        "mla_latents": s.latent_width * (a + 2 * FLOAT32),
        # the loss's vocabulary-wide tensors (none kept when it runs in chunks)
        "loss_vocabulary": 0 if s.loss_chunk_tokens else training_loss(s.loss).kept_tensors * s.draft_vocab * FLOAT32,
    }
    return {name: each * n for name, each in per_token.items()}


def step_activation_bytes(shape: StepShape, k: int, tokens: int | None = None) -> int:
    """Bytes autograd keeps for unrolled step ``k`` (0-based) of a micro-batch, without checkpointing."""
    return sum(step_activation_terms(shape, k, tokens).values())


# Which part of :func:`estimate_step_bytes` each term of :func:`estimate_terms` is in.
FIXED_PARTS = ("weights", "gradients", "optimizer", "target_head", "batch")
TRAINING_PARTS = ("target_logits", "activations", "backward_transient")
STEP_TERMS = (
    "norms", "attention_projections", "grouped_kv_copies", "attention_probabilities", "causal_mask", "mlp", "mla_latents", "loss_vocabulary",
)  # fmt: skip
TERM_PART = {
    "draft_weights": "weights", "embedding": "weights", "bf16_weight_copies": "weights",
    "gradients": "gradients", "optimizer_state": "optimizer", "target_head": "target_head", "batch": "batch",
    "target_head_chunk": "target_head_transient", "target_head_draft_logits": "target_head_transient",
    "target_logits": "target_logits", "target_distribution": "target_logits",
    **{name: "activations" for name in STEP_TERMS}, "checkpointed_step_inputs": "activations",
    "attention_transient": "backward_transient", "loss_transient": "backward_transient",
}  # fmt: skip


def estimate_terms(shape: StepShape) -> dict[str, int]:
    """Every term of the estimate (bytes); :data:`TERM_PART` says which part of :func:`estimate_step_bytes` each is in."""
    s, n, a = shape, shape.tokens, shape.activation_bytes
    params = s.trainable_parameters
    held = params + (s.lm_head_parameters if s.frozen_lm_head else 0)  # every weight of the draft but the embedding
    terms = {
        "draft_weights": held * FLOAT32,
        "embedding": s.vocab * s.hidden * FLOAT32,
        "bf16_weight_copies": held * 2 if a == 2 else 0,
        "gradients": params * FLOAT32,
        "optimizer_state": s.optimizer_state_floats * FLOAT32,
        "target_head": s.vocab * s.target_hidden * FLOAT32,
        "batch": n * 4 * s.target_hidden * FLOAT32,
    }
    # The target's head runs before the draft: its full-vocabulary chunk is gone when the activations grow.
    chunk = min(s.target_head_chunk_tokens or n, n)
    terms["target_head_chunk"] = chunk * (s.vocab + s.draft_vocab) * FLOAT32
    terms["target_head_draft_logits"] = n * s.draft_vocab * FLOAT32
    terms["target_logits"] = n * s.draft_vocab * FLOAT32
    terms["target_distribution"] = 0 if s.loss_chunk_tokens else n * s.draft_vocab * FLOAT32  # chunked: taken a chunk at a time
    steps = [step_activation_terms(s, k) for k in range(s.ttt_steps)]
    if s.activation_checkpointing:
        # Each step's inputs stay (the state, its key and value); the last step's activations are recomputed in backward.
        terms.update(steps[-1])
        terms["checkpointed_step_inputs"] = s.ttt_steps * n * (s.hidden + 2 * s.kv_heads * s.head_dim) * a
    else:
        terms.update({name: sum(step[name] for step in steps) for name in STEP_TERMS})
        terms["checkpointed_step_inputs"] = 0
    # Two moments of the last step may be the peak. At its attention (forward, or backward once its MLP and loss are
    # freed) two more tensors of its probabilities' size are alive beside them: in forward its masked scores and their
    # concatenation with the chain's keys' (softmax's input), in backward the probabilities' gradient and the
    # full-width buffer its slices' gradients are copied into; and the causal mask (a byte a key). Its MLP's and loss's
    # activations are not alive then. At its loss, its vocabulary-wide transients (one loss chunk's when chunked)
    # are. peak_of takes the larger.
    # (What is not alive is counted here from the shape, not from the terms above: each term stays on its own, so
    # that the test of what each is worth can drop one and see the estimate fall by it.)
    # A blocked sample keeps nothing of its attention; the moment holds its widest block's three tensors (in forward the
    # masked scores, softmax's input and the probabilities; in backward the recomputed probabilities, their gradient and
    # the full-width buffer) for every row of the micro-batch, and the block's mask and its negation (a byte a key).
    last = s.ttt_steps - 1
    if s.blocked_attention:
        rows, (block_rows, block_keys) = math.ceil(n / s.seq_len), widest_attention_block(s.seq_len)
        attention = 3 * rows * s.heads * block_rows * (block_keys + last) * FLOAT32 + 2 * block_rows * block_keys
    else:
        attention = 2 * n * s.heads * (s.seq_len + last) * FLOAT32 + n * s.seq_len
    loss = training_loss(s.loss)
    after_attention = n * (4 * s.intermediate * a + (0 if s.loss_chunk_tokens else loss.kept_tensors * s.draft_vocab * FLOAT32))
    terms["attention_transient"] = max(0, attention - after_attention)
    loss_chunk = min(s.loss_chunk_tokens or n, n)
    # Unchunked, the loss's peak is in its last step's forward: its logits and one product beside what it keeps.
    terms["loss_transient"] = (loss.chunk_backward_tensors if s.loss_chunk_tokens else 2) * loss_chunk * s.draft_vocab * FLOAT32
    return terms


def peak_of(terms: dict[str, int]) -> dict[str, int]:
    """The parts of the estimate from its terms; ``total`` is the fixed parts plus the larger of the two phases.

    The two phases: the target's head (one full-vocabulary chunk) and the draft's forward and backward.
    """
    parts = {part: 0 for part in (*FIXED_PARTS, "target_head_transient", *TRAINING_PARTS)}
    for name, value in terms.items():
        parts[TERM_PART[name]] += value
    parts["backward_transient"] = max(terms["attention_transient"], terms["loss_transient"])  # two moments, not both at once
    fixed = sum(parts[part] for part in FIXED_PARTS)
    parts["total"] = fixed + max(parts["target_head_transient"], sum(parts[part] for part in TRAINING_PARTS))
    return parts


def widest_attention_block(seq_len: int) -> tuple[int, int]:
    """(query rows, step-0 keys) of the block of a blocked ``seq_len``-token sample whose scores are the largest."""
    blocks = [(min(ATTENTION_BLOCK, seq_len - start), min(start + ATTENTION_BLOCK, seq_len)) for start in range(0, seq_len, ATTENTION_BLOCK)]
    return max(blocks, key=lambda block: block[0] * block[1])


def estimate_step_bytes(shape: StepShape) -> dict[str, int]:
    """The peak of a step over ``shape.tokens`` tokens of samples up to ``shape.seq_len`` long, by part (bytes).

    ``total`` is the fixed parts plus the larger of the two phases: the target's head (one full-vocabulary chunk) and
    the draft's forward and backward. Past ATTENTION_BLOCK the attention of longer samples costs less than that of
    one-block samples (which keep their probabilities): the estimate is the larger of samples of ``seq_len`` tokens,
    of one block, and of one token more (the blocked regime's widest per token), each a :func:`peak_of` its
    :func:`estimate_terms`.
    """
    lengths = sorted({shape.seq_len, min(shape.seq_len, ATTENTION_BLOCK), min(shape.seq_len, ATTENTION_BLOCK + 1)})
    estimates = [peak_of(estimate_terms(replace_shape(shape, seq_len=length))) for length in lengths]
    return max(estimates, key=lambda parts: parts["total"])


def free_memory_bytes(device) -> tuple[int, int]:
    """(free, total) bytes of the device: CUDA's own figures; on the CPU, the available and the total RAM."""
    import torch

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    info = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]


class MemoryPlanError(RuntimeError):
    """Even one sequence does not fit: the message has both numbers and the settings that would make it fit."""


@dataclass
class MemoryPlan:
    batch_tokens: int
    grad_accumulation: int
    estimate_bytes: int
    budget_bytes: int
    free_bytes: int
    device_total_bytes: int
    split: int  # the configured micro-batch was split in this many
    parts: dict
    source: str  # "planned" or "resumed" (the checkpoint's micro-batch)

    def describe(self) -> str:
        gib = 2**30
        split = f", the configured micro-batch split in {self.split} (grad_accumulation {self.grad_accumulation})" if self.split > 1 else ""
        return (
            f"{self.batch_tokens} tokens per micro-batch, estimated peak {self.estimate_bytes / gib:.2f} GiB of "
            f"{self.budget_bytes / gib:.2f} GiB allowed ({self.free_bytes / gib:.2f} GiB free){split}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def fix_suggestions(shape: StepShape, budget: int) -> list[str]:
    """The settings that, alone or together, would make one sequence fit ``budget``."""
    ideas, settings = [], {}
    if not shape.activation_checkpointing:
        settings["activation_checkpointing"] = True
    if not shape.loss_chunk_tokens:
        settings["loss_chunk_tokens"] = 2048
    if not shape.target_head_chunk_tokens:
        settings["target_head_chunk_tokens"] = 1024
    trial = replace_shape(shape, **settings)
    if settings and estimate_step_bytes(trial)["total"] <= budget:
        ideas.append(", ".join(f"{k}: {v}" for k, v in settings.items()))
    for seq_len in (shape.seq_len // 2, shape.seq_len // 4):
        if seq_len >= 16 and estimate_step_bytes(replace_shape(trial, tokens=seq_len, seq_len=seq_len))["total"] <= budget:
            ideas.append(f"max_seq_len: {seq_len}" + (" with the above" if settings else ""))
            break
    for depth in range(shape.ttt_steps - 1, 0, -1):
        if estimate_step_bytes(replace_shape(trial, ttt_steps=depth))["total"] <= budget:
            ideas.append(f"ttt_steps: {depth}")
            break
    ideas.append("a device with more free memory")
    return ideas


def replace_shape(shape: StepShape, **changes) -> StepShape:
    return StepShape(**{**asdict(shape), **changes})


def plan_micro_batch(
    draft: DraftConfig, config, *, longest: int, device, bf16: bool, recorded: dict | None = None, free: tuple[int, int] | None = None
) -> MemoryPlan:
    """The micro-batch (and gradient accumulation) that fits the device; ``recorded`` is a resumed run's plan, kept as it was."""
    free_bytes, total_bytes = free or free_memory_bytes(device)
    budget = int(free_bytes * config.memory_fraction)
    settings = dict(
        activation_checkpointing=config.activation_checkpointing,
        loss_chunk_tokens=config.loss_chunk_tokens,
        target_head_chunk_tokens=config.target_head_chunk_tokens,
        frozen_lm_head=config.freeze_lm_head,
        loss=config.loss,
        optimizer=config.optimizer,
    )
    seq_len = min(longest, config.max_seq_len)

    def estimate(tokens: int) -> dict:
        return estimate_step_bytes(StepShape.of(draft, max(tokens, seq_len), seq_len, config.ttt_steps, bf16=bf16, **settings))

    if recorded:
        # A resumed run keeps its micro-batch: another one would be another plan of steps.
        parts = estimate(recorded["batch_tokens"])
        if parts["total"] > budget:
            raise MemoryPlanError(
                f"training memory: the resumed run's micro-batch of {recorded['batch_tokens']} tokens needs an estimated "
                f"{parts['total']} B, the device has {free_bytes} B free ({budget} B at memory_fraction {config.memory_fraction}); "
                "free the device, or start a fresh run (other settings or data)"
            )
        return MemoryPlan(**{**recorded, "estimate_bytes": parts["total"], "budget_bytes": budget, "free_bytes": free_bytes,
                             "device_total_bytes": total_bytes, "parts": parts, "source": "resumed"})  # fmt: skip

    one = estimate(seq_len)
    if one["total"] > budget:
        shape = StepShape.of(draft, seq_len, seq_len, config.ttt_steps, bf16=bf16, **settings)
        raise MemoryPlanError(
            f"training memory: one sequence of {seq_len} tokens needs an estimated {one['total']} B "
            f"({', '.join(f'{k} {v}' for k, v in one.items() if k != 'total')}), the device has {free_bytes} B free "
            f"({budget} B at memory_fraction {config.memory_fraction}); what would fit: " + "; or ".join(fix_suggestions(shape, budget))
        )
    split = 1
    while estimate(math.ceil(config.batch_tokens / split))["total"] > budget:
        split += 1
    batch_tokens = math.ceil(config.batch_tokens / split)
    parts = estimate(batch_tokens)
    return MemoryPlan(
        batch_tokens=batch_tokens, grad_accumulation=config.grad_accumulation * split, estimate_bytes=parts["total"],
        budget_bytes=budget, free_bytes=free_bytes, device_total_bytes=total_bytes, split=split, parts=parts, source="planned",
    )  # fmt: skip



def allocated_peak_during(fn) -> int:
    """The most bytes of tensors ``fn`` had allocated at once beyond those alive before it (CPU), from the profiler.

    ``torch.profiler`` with ``profile_memory`` records each op's own
    allocations and frees (``self_cpu_memory_usage``, what the CPU allocator
    reports); summing them in the order the ops started gives the live bytes
    over time, and their maximum is the peak. What an op allocates and frees
    inside one kernel is not seen, nor allocator rounding.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if event.self_cpu_memory_usage:
            live += event.self_cpu_memory_usage
            peak = max(peak, live)
    return peak
