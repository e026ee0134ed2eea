"""What a ``hidden_states`` shard holds per token, without torch.

The asset modules need these figures to validate their config and to size a
shard when the code location loads, in every run worker: importing torch
there would add a second to every run's start.
"""

from __future__ import annotations

DEFAULT_PART_BYTES = 2 * 1024**3
DEFAULT_DTYPE = "bfloat16"
BACKENDS = ("transformers", "vllm")
FINAL_STATES = ("post_norm", "pre_norm")
STORAGE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def state_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes of the three aux states and the final state of one token: 8·H in bf16."""
    return 4 * hidden_size * STORAGE_DTYPE_BYTES[dtype]


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Everything stored per token: the states plus ``input_ids`` (int64) and ``loss_mask`` (int8)."""
    return state_bytes_per_token(hidden_size, dtype) + 8 + 1
