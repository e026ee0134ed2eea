"""Bounded-disk mode's window, in bytes: what the asset states before anything is extracted.

A module of its own, free of torch, because ``draft_checkpoint`` states it in the
Dagster process, and every process that loads the code location (the code
server, each run's worker) would otherwise import torch for two sums.
"""

from __future__ import annotations


def window_estimate(shard_bytes: dict[str, int], window_shards: int) -> int:
    """Bytes the window can hold at most: its ``window_shards`` largest shards."""
    return sum(sorted(shard_bytes.values(), reverse=True)[:window_shards])


def describe_estimate(shard_bytes: dict[str, int], window_shards: int, dtype: str) -> tuple[int, str]:
    """The bounded mode's pre-flight estimate and the line that names the mode and both figures."""
    window_bytes = window_estimate(shard_bytes, window_shards)
    total = sum(shard_bytes.values())
    return window_bytes, (
        f"bounded mode: a window of {min(window_shards, len(shard_bytes))} of {len(shard_bytes)} shards "
        f"= {window_bytes} B of hidden states at most ({dtype}, the window's largest shards); "
        f"offline mode would keep all {total} B"
    )
