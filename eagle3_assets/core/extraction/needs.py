"""What extracting a shard's hidden states needs of the GPU host: the stage's modules and the disk its states take.

Shared by ``hidden_states`` (offline mode: the states stay on disk) and the
bounded-disk training (a window of shards at a time). Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.storage.shard_files import read_shard_parquet
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.extraction.state_layout import bytes_per_token

EXTRACTION_STAGE = "extract_hidden_states"
EXTRACTION_MODULES = ["torch", "transformers", "safetensors", "polars", "dagster_pipes"]
TRACES = "validated_traces"


def shard_tokens(key: str) -> int | None:
    """Tokens of the shard's validated traces, or None when the traces are not on this machine."""
    traces = ShardPaths(TRACES, key).parquet
    if not traces.is_file():
        return None
    return int(read_shard_parquet(traces, asset=TRACES, shard=key, columns=["num_tokens"])["num_tokens"].sum() or 0)


def disk_estimate(key: str, hidden_size: int, dtype: str) -> tuple[int, str]:
    """The bytes the pre-flight must find free, and a line that says how they were counted."""
    tokens = shard_tokens(key)
    if tokens is None:
        return 0, f"{key}: traces not on this machine, no disk estimate"
    per_token = bytes_per_token(hidden_size, dtype)
    return tokens * per_token, f"{key}: {tokens} tokens x {per_token} B/token ({dtype}, H={hidden_size}) = {tokens * per_token} B"
