"""What a ``hidden_states`` shard holds per token, without torch.

The asset modules need these figures to validate their config and to size a
shard when the code location loads, in every run worker: importing torch
there would add a second to every run's start.

Storage precisions: the float formats store each state as it is; the 8-bit
format ``float8_e4m3fn`` stores codes plus, per token and per state (3 aux +
1 final), a float32 scale that maps the row's largest magnitude to 448 (the
format's largest finite value). One scale per row keeps every row in the
format's normal range whatever its magnitude (a residual stream's norm grows
by orders of magnitude from the first layers to the last), and costs 16 bytes
per token: 0.03 % of the codes at H = 7,168.
"""

from __future__ import annotations

FORMAT_VERSION = 1  # of a shard's files: its parts' headers and its sidecar
DEFAULT_PART_BYTES = 2 * 1024**3
DEFAULT_DTYPE = "bfloat16"
FINAL_STATES = ("post_norm", "pre_norm")
FP8_DTYPE = "float8_e4m3fn"
STORAGE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, FP8_DTYPE: 1}
SCALED_DTYPES = frozenset({FP8_DTYPE})  # stored as codes times a per-token, per-state scale
SCALE_BYTES = 4  # one float32 scale per token and state
STATES_PER_TOKEN = 4  # three aux states and the final one


def is_scaled(dtype: str) -> bool:
    return dtype in SCALED_DTYPES


def state_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes of the three aux states and the final state of one token (their scales included): 8·H in bf16."""
    scales = STATES_PER_TOKEN * SCALE_BYTES if is_scaled(dtype) else 0
    return STATES_PER_TOKEN * hidden_size * STORAGE_DTYPE_BYTES[dtype] + scales


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Everything stored per token: the states plus ``input_ids`` (int64) and ``loss_mask`` (int8)."""
    return state_bytes_per_token(hidden_size, dtype) + 8 + 1
