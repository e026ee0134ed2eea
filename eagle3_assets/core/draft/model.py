"""The EAGLE-3 draft model, in vLLM's native form (``llama_eagle3.py`` is the ground truth).

One draft step, as vLLM runs it::

    fused    = fc(cat(aux_1, aux_2, aux_3))      # step 0 only: target states -> draft width
    x        = cat(input_layernorm(embed(token)), hidden_norm(fused))   # [.., 2H]
    residual = fused
    a        = o_proj(attention(q/k/v_proj(x)))  # q/k/v take 2H inputs
    residual = a + residual
    m        = mlp(post_attention_layernorm(residual))
    prenorm  = m + residual                      # fed back as `fused` of the next step
    logits   = lm_head(norm(prenorm))            # over the draft vocabulary

Four config flags of vLLM's class change that, each off by default (plain
EAGLE-3); EAGLE 3.1 is ``fc_norm`` with ``norm_output``:

- ``fc_norm``: ``fc(cat(Norm_1(aux_1), Norm_2(aux_2), Norm_3(aux_3)))``, one
  RMSNorm per auxiliary state (weights ``fc_norm.{0,1,2}.weight``): the
  higher layers' larger states no longer dominate the fused one;
- ``norm_before_fc``: ``fc(Norm(cat(aux_1, aux_2, aux_3)))``, one RMSNorm over
  the concatenation (weight ``input_norm.weight``); not with ``fc_norm``, and
  read by the Llama form's class only;
- ``norm_before_residual``: ``residual = hidden_norm(fused)`` (the residual
  path starts from the normalised state);
- ``norm_output``: the next step takes ``norm(prenorm)``, not ``prenorm``: the
  state fed back no longer grows step by step.

The token embedding is the target's (vLLM shares it when the checkpoint has
none). Draft id ``i`` is target id ``i + d2t[i]``. Parameter names are the
checkpoint's names (``fc.weight``, ``midlayer.self_attn.q_proj.weight``, ...),
so ``state_dict()`` is what the exporter writes.

Attention during training runs the whole sequence at once for every unrolled
step ("training-time test"): the query of step k for the chain that starts at
position t sits at position t + k and sees the step-0 keys of positions <= t
(what the target's states gave the draft's KV cache) plus the chain's own keys
of steps 1..k, exactly what vLLM's KV cache holds when it drafts token k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3_assets.core.target.description import rms_norm_eps, text_config
from eagle3_assets.core.target.head import rms_norm


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (the embedding)
    draft_vocab_size: int  # the lm_head's
    target_hidden_size: int  # width of each auxiliary state
    aux_layer_ids: tuple[int, ...]  # vLLM's convention: hidden_states[k] enters layer k
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # Each query attends to the last ``sliding_window`` positions only (its own included), as vLLM's Llama-form draft
    # does where its config.json says ``layer_types: ["sliding_attention"]``: None, full causal attention.
    sliding_window: int | None = None
    # The norm flags vLLM's LlamaForCausalLMEagle3 reads (see the module's docstring); all off: plain EAGLE-3.
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False

    norm_flags: ClassVar[tuple[str, ...]] = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")

    def __post_init__(self):
        check_norm_flags(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (rotary embedding)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be at least 1 (or None: full attention)")

    @classmethod
    def for_target(
        cls,
        target_config: dict,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        *,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        sliding_window: int | None = None,
        **norm_flags: bool,
    ) -> DraftConfig:
        """A one-layer draft as wide as the target, shaped like one of its (dense) layers unless told otherwise."""
        text = text_config(target_config)  # multimodal wrappers nest the LM config
        hidden = int(text["hidden_size"])
        heads = int(num_attention_heads or text["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(num_key_value_heads or text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim or text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=tuple(int(i) for i in aux_layer_ids),
            rms_norm_eps=rms_norm_eps(text),
            rope_theta=rope_theta_of(text),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            sliding_window=sliding_window,
            **norm_flags,
        )


def check_norm_flags(config) -> None:
    """Refuse what vLLM would build wrongly: both input norms (it would apply both, speculators refuses them)."""
    if getattr(config, "fc_norm", False) and getattr(config, "norm_before_fc", False):
        raise ValueError("fc_norm and norm_before_fc exclude each other: one norm per auxiliary state, or one over their concatenation")


def norm_flags_of(config) -> dict[str, bool]:
    """The norm flags a draft config has, by name (its form's own: the MLA form has no ``norm_before_fc``)."""
    return {flag: bool(getattr(config, flag)) for flag in config.norm_flags}


def rope_theta_of(config: dict) -> float:
    """``rope_theta`` from a Llama-style config (transformers 5 moved it into ``rope_parameters``)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise NotImplementedError(f"rope type {kind!r}: only the default rotary embedding is implemented for drafts")
    return float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)


class RMSNorm(nn.Module):
    """Normalise in float32, scale in the input dtype (as vLLM's and transformers' RMSNorm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, "neox" layout (halves), of ``x`` [B, heads, T, d] at ``positions`` [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


KVCache = list[tuple[torch.Tensor, torch.Tensor]]


# Query rows of one sample that chain attention computes at once, each block recomputed in backward, for a sample
# longer than this; a sample of at most this many tokens takes the one-matrix path (short samples, such as the tiny target's ~55-token
# ones, train exactly as before). Why 1,024: at Kimi width (64 heads) one block's float32 scores over an 8,192-token sample
# are 64 x 1,024 x 8,198 x 4 B = 2.1 GB, and the step holds about three of them at once (scores, softmax's input,
# probabilities; in backward the probabilities, their gradient and the full-width buffer), 6.4 GB where the whole
# matrix was three times 17 GB; a block's products ([1,024 x 128] @ [128 x T] a head) stay large enough to run at a
# device's matrix rate; and the unblocked path's kept probabilities stay bounded by 1,024 keys a query.
ATTENTION_BLOCK = 1024


def chain_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float, documents: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Training-time-test attention of step ``len(keys) - 1``: ``q`` [B, heads, T, d], one key/value per head and step.

    Step 0's keys causally; then each later step's key of the same chain (the diagonal). A packed row
    (``documents`` [1, T], each token's sample) is attended one sample at a time, each within itself: the
    scores of the whole row would cost its width squared, almost all of them masked. A sample longer than
    :data:`ATTENTION_BLOCK` is attended in blocks of that many query rows, each over the keys up to its last row,
    and under autograd each block is recomputed in backward (``torch.utils.checkpoint``): no [T, T] tensor is
    built or kept, the attention's memory is one block's, O(block x T) a head.

    With a sliding ``window`` w, the query of row t at step s stands at position t + s (the step's position, as
    vLLM drafts it) and sees the keys of the last w positions: step 0's from t + s - w + 1 to t, and the chain's
    own (positions t + 1 .. t + s) within w. A block then reads only the step-0 keys its rows can see: the
    attention's cost and memory are O(T x (block + w)), not O(T^2).
    """
    step = len(keys) - 1
    if documents is not None:
        if documents.shape[0] != 1:
            raise ValueError(f"packed attention takes one row of samples, got {documents.shape[0]}")
        sizes = torch.unique_consecutive(documents[0], return_counts=True)[1].tolist()
        by_sample = zip(q.split(sizes, dim=2), zip(*(k.split(sizes, dim=2) for k in keys)), zip(*(v.split(sizes, dim=2) for v in values)))
        return torch.cat([chain_attention(qs, list(ks), list(vs), scale, window=window) for qs, ks, vs in by_sample], dim=2)
    length = q.shape[2]
    if length <= ATTENTION_BLOCK:
        return attention_rows(q, keys[0], values[0], keys[1:], values[1:], scale=scale, first_row=0, window=window)
    blocks = []
    for start in range(0, length, ATTENTION_BLOCK):
        end = min(start + ATTENTION_BLOCK, length)
        # The block's queries, the step-0 keys and values its mask can reach, and the chain's own of its rows.
        low = 0 if window is None else max(0, start + step - window + 1)
        args = (q[:, :, start:end], keys[0][:, :, low:end], values[0][:, :, low:end],
                [k[:, :, start:end] for k in keys[1:]], [v[:, :, start:end] for v in values[1:]])  # fmt: skip
        kwargs = {"scale": scale, "first_row": start, "first_key": low, "window": window}
        if torch.is_grad_enabled():
            # Nothing random inside: no RNG state to keep. Nested in the step's own checkpoint (activation_checkpointing)
            # too: non-reentrant checkpoints nest.
            out = checkpoint(attention_rows, *args, **kwargs, use_reentrant=False, preserve_rng_state=False)
        else:
            out = attention_rows(*args, **kwargs)
        blocks.append(out)
    return torch.cat(blocks, dim=2)


def attention_rows(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chain_keys: list[torch.Tensor], chain_values: list[torch.Tensor],
    *, scale: float, first_row: int, first_key: int = 0, window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Chain attention of the query rows ``first_row`` onwards of a sample: ``q`` [B, heads, rows, d] over the step-0
    ``key``/``value`` of its tokens ``first_key`` to ``first_row + rows`` (causally: row i sees keys up to
    ``first_row + i``; with a ``window``, only the last ``window`` positions of its step's) and the chain's own
    keys/values of the same rows (``chain_keys``: steps 1..k, each [B, heads, rows, d])."""
    rows, width, step = q.shape[2], key.shape[2], len(chain_keys)
    row = torch.arange(first_row, first_row + rows, device=q.device)[:, None]
    column = torch.arange(first_key, first_key + width, device=q.device)[None, :]
    allowed = column <= row
    if window is not None:
        allowed &= column > row + step - window  # the query stands at row + step
    scores = [(q @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
    # Step j's own key stands at row + j: outside the window when step - j >= window (only for windows under k).
    scores += [
        (q * chain_key).sum(-1, keepdim=True) * scale if window is None or step - j < window else torch.full_like(q[..., :1], float("-inf"))
        for j, chain_key in enumerate(chain_keys, start=1)
    ]
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :width] @ value
    for j, chain_value in enumerate(chain_values):
        out = out + probs[..., width + j : width + j + 1] * chain_value
    return out


class Attention(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim, self.theta = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_theta
        self.window = c.sliding_window
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [B, T, 2H] at ``positions`` [B, T]; appends this step's keys/values to ``cache``."""
        batch, length, _ = x.shape

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(batch, length, n, self.head_dim).transpose(1, 2)

        q = rotate(heads(self.q_proj(x), self.heads), positions, self.theta)
        k = rotate(heads(self.k_proj(x), self.kv_heads), positions, self.theta)
        v = heads(self.v_proj(x), self.kv_heads)
        cache.append((k, v))
        groups = self.heads // self.kv_heads
        keys = [kv[0].repeat_interleave(groups, dim=1) for kv in cache]
        values = [kv[1].repeat_interleave(groups, dim=1) for kv in cache]
        out = chain_attention(q, keys, values, self.head_dim**-0.5, documents, window=self.window)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """vLLM's first (here: only) EAGLE-3 layer: attention over [embedding ; fused state]."""

    attention = Attention  # the MLA form swaps this (draft_model_mla.py); the rest of the layer is the same

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache, documents: torch.Tensor | None = None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = self.self_attn(x, positions, cache, documents) + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class Eagle3Draft(nn.Module):
    form = "llama"  # vLLM's LlamaForCausalLMEagle3
    layer = DecoderLayer

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        num_aux = len(config.aux_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        # Built only when set, as vLLM does: a plain EAGLE-3 checkpoint has none of these weights. Weights 1 at first.
        self.input_norm = RMSNorm(num_aux * config.target_hidden_size, config.rms_norm_eps) if getattr(config, "norm_before_fc", False) else None
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(num_aux)) if config.fc_norm else None
        self.midlayer = self.layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # The vocabulary map travels with the weights (vLLM reads d2t; t2d is conventional).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping d2t{tuple(d2t.shape)}/t2d{tuple(t2d.shape)} does not fit a draft with "
                f"draft_vocab_size {self.config.draft_vocab_size} over a target vocabulary of {self.config.vocab_size}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """The three target states [.., 3*target_H] -> the draft's input state [.., H] (vLLM's ``combine_hidden_states``)."""
        if self.input_norm is not None:
            aux_hidden_states = self.input_norm(aux_hidden_states)
        if self.fc_norm is not None:
            chunks = aux_hidden_states.chunk(len(self.fc_norm), dim=-1)
            aux_hidden_states = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden_states)

    def step(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for every position: returns (draft-vocabulary logits, the state the next step takes)."""
        normed, next_hidden = self.step_states(input_ids, hidden, positions, cache)
        return self.lm_head(normed), next_hidden

    def step_states(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache, documents: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` without the ``lm_head``: (what the ``lm_head`` reads, the state the next step takes).

        The next step takes the pre-norm state, or under ``norm_output`` the
        post-norm one. Training applies the ``lm_head`` itself where it
        computes the loss in chunks of positions, and passes a packed row's
        ``documents`` (:func:`chain_attention`).
        """
        out, residual = self.midlayer(self.embed_tokens(input_ids), hidden, positions, cache, documents)
        prenorm = out + residual
        normed = self.norm(prenorm)
        return normed, normed if self.config.norm_output else prenorm

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft logits into the target vocabulary, ``-inf`` elsewhere (vLLM's ``compute_logits``)."""
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t] = logits
        return full
