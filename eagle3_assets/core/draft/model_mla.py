"""The EAGLE-3 draft in vLLM's MLA form (``deepseek_eagle3.py`` is the ground truth).

The same draft as :mod:`eagle3_assets.core.draft.model` (``fc``,
``hidden_norm``, ``input_layernorm``, the residual, the dense MLP, ``norm``,
``lm_head``, ``d2t``, the training-time-test unroll, the norm flags but
``norm_before_fc``, which vLLM's MLA class does not read), with DeepSeek's
multi-head latent attention in place of Llama's: vLLM's
``Eagle3DeepseekV2ForCausalLM``. Its first layer's ``q_a_proj`` and
``kv_a_proj_with_mqa`` take the 2H inputs (embedding and fused state
concatenated). One attention step, as vLLM's ``DeepseekV2MLAAttention``
computes it (its prefill form; the decode kernel absorbs ``kv_b_proj`` into the
query, which is the same product)::

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))       # [.., heads, nope + rope]
    latent, k_pe = split(kv_a_proj_with_mqa(x), [kv_lora_rank, rope])
    k_nope, v    = split(kv_b_proj(kv_a_layernorm(latent)), [nope, v])   # per head
    q_pe, k_pe   = rotary(q_pe), rotary(k_pe)                 # GPT-J (interleaved) layout; one k_pe for all heads
    out          = o_proj(softmax([q_nope ; q_pe] . [k_nope ; k_pe] / sqrt(nope + rope)) v)

Why a draft of this form at all: the KV cache vLLM keeps for it is one latent
row of ``kv_lora_rank + qk_rope_head_dim`` per token, the same layout as the
target's, so it runs on the target's own MLA attention backend. Where that
backend and a Llama draft's attention backend share no KV block size (vLLM's
CPU backends: MLA takes blocks of exactly 16, standard attention multiples
of 32) this is the only EAGLE-3 draft vLLM serves beside an MLA target
(docs/targets.md). On a CPU the latent head must be 576 (512 + 64), the only
size vLLM's CPU MLA decode kernel is built for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from eagle3_assets.core.draft.model import DecoderLayer, Eagle3Draft, KVCache, RMSNorm, chain_attention
from eagle3_assets.core.target.description import rms_norm_eps, text_config

# DeepSeek-V3's and Kimi-K2's latent ranks: a draft of a target without MLA takes these unless told otherwise.
DEFAULT_KV_LORA_RANK, DEFAULT_QK_ROPE_HEAD_DIM, DEFAULT_Q_LORA_RANK = 512, 64, 1536


@dataclass(frozen=True)
class MLADraftConfig:
    hidden_size: int
    intermediate_size: int  # the dense MLP's (vLLM's EAGLE-3 layer never routes to experts)
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # The norm flags vLLM's Eagle3DeepseekV2ForCausalLM reads: the Llama form's but norm_before_fc (it builds no input_norm).
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False

    norm_flags: ClassVar[tuple[str, ...]] = ("fc_norm", "norm_output", "norm_before_residual")

    def __post_init__(self):
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (rotary embedding)")

    @property
    def latent_head_size(self) -> int:
        """What vLLM caches per token and layer: the latent KV and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def for_target(
        cls,
        target_config: dict,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        *,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        q_lora_rank: int | None = None,
        kv_lora_rank: int | None = None,
        **norm_flags: bool,
    ) -> MLADraftConfig:
        """A one-layer draft as wide as the target, with the target's latent ranks when it has them (DeepSeek-V3's else)."""
        text = text_config(target_config)
        hidden = int(text["hidden_size"])
        heads = int(num_attention_heads or text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        # The draft's rotary embedding is its own, vLLM's default one: a target's long-context scaling (Kimi-K2's
        # YaRN) changes the frequencies beyond its original context, which a one-layer draft does not need to copy.
        params = text.get("rope_parameters") or {}
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or text["intermediate_size"]),
            num_attention_heads=heads,
            q_lora_rank=int(q_lora_rank or text.get("q_lora_rank") or min(DEFAULT_Q_LORA_RANK, hidden)),
            kv_lora_rank=int(kv_lora_rank or text.get("kv_lora_rank") or DEFAULT_KV_LORA_RANK),
            qk_nope_head_dim=int(text.get("qk_nope_head_dim") or head_dim),
            qk_rope_head_dim=int(text.get("qk_rope_head_dim") or DEFAULT_QK_ROPE_HEAD_DIM),
            v_head_dim=int(text.get("v_head_dim") or head_dim),
            vocab_size=int(text["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=tuple(int(i) for i in aux_layer_ids),
            rms_norm_eps=rms_norm_eps(text),
            rope_theta=float(text.get("rope_theta") or params.get("rope_theta") or 10000.0),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            **norm_flags,
        )


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, GPT-J layout (pairs of neighbours, DeepSeek's ``is_neox_style=False``), of ``x`` [B, heads, T, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, d/2]
    cos, sin = angles.cos(), angles.sin()
    even, odd = x.float()[..., ::2], x.float()[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2).to(x.dtype)


class MLAttention(nn.Module):
    """vLLM's ``DeepseekV2MLAAttention`` of an EAGLE-3 first layer (``input_size`` 2H, ``q_lora_rank`` set)."""

    def __init__(self, config: MLADraftConfig):
        super().__init__()
        c = config
        self.heads, self.nope, self.rope, self.v_dim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rank, self.theta = c.kv_lora_rank, c.rope_theta
        self.q_a_proj = nn.Linear(2 * c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [B, T, 2H] at ``positions`` [B, T]; appends this step's per-head keys/values to ``cache``."""
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        q_nope, q_pe = heads(self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        k_nope, v = heads(self.kv_b_proj(self.kv_a_layernorm(latent))).split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, rotate_interleaved(q_pe, positions, self.theta)], dim=-1)
        k_pe = rotate_interleaved(k_pe[:, None], positions, self.theta).expand(-1, self.heads, -1, -1)
        cache.append((torch.cat([k_nope, k_pe], dim=-1), v))
        out = chain_attention(q, [kv[0] for kv in cache], [kv[1] for kv in cache], (self.nope + self.rope) ** -0.5, documents)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.v_dim))


class MLADecoderLayer(DecoderLayer):
    """vLLM's ``DeepseekV2Eagle3DecoderLayer``: the Llama form's layer with MLA attention and the same dense MLP."""

    attention = MLAttention


class Eagle3MLADraft(Eagle3Draft):
    form = "deepseek_mla"  # vLLM's Eagle3DeepseekV2ForCausalLM
    layer = MLADecoderLayer
