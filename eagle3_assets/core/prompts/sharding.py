"""Sample shards: fixed-size runs of dataset rows, keyed by position.

A row's shard is ``row_index // shard_size``, where ``row_index`` counts every row
of the dataset in file order, bad rows included. Appending rows therefore never
moves an existing row: it only fills the last shard and opens new ones, which
become new partition keys. Reading the same file again gives the same shards.
"""

from __future__ import annotations

import re

DEFAULT_SHARD_SIZE = 128

# The partitions of the per-sample assets, and those assets, materialised together one shard at a time.
SAMPLE_SHARDS = "sample_shards"
PER_SHARD_ASSETS = ("prompts", "raw_responses", "validated_traces", "hidden_states")
_KEY = re.compile(r"^shard-(\d{5,})$")


def shard_key(shard_index: int) -> str:
    return f"shard-{shard_index:05d}"


def shard_index(key: str) -> int:
    match = _KEY.match(key)
    if not match:
        raise ValueError(f"not a shard key: {key!r} (expected 'shard-NNNNN')")
    return int(match.group(1))


def shard_keys_for(num_rows: int, shard_size: int, max_samples: int | None = None) -> list[str]:
    """Every shard key a dataset of ``num_rows`` rows spans; with ``max_samples``, only the shards its first rows fill.

    A cap rounds up to whole shards: a shard's rows never depend on the cap, so
    raising it only adds keys (a ramp 64 -> 1,000 -> 10,000 keeps every shard
    already done).
    """
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    if max_samples is not None and max_samples <= 0:
        raise ValueError(f"max_samples must be positive, got {max_samples}")
    rows = num_rows if max_samples is None else min(num_rows, max_samples)
    return [shard_key(i) for i in range((rows + shard_size - 1) // shard_size)]


def rows_per_shard(num_rows: int, shard_size: int, keys: list[str]) -> dict[str, int]:
    """The dataset rows each of ``keys`` holds (the last shard may hold fewer); a key past the end holds 0."""
    return {key: max(0, min(shard_size, num_rows - shard_index(key) * shard_size)) for key in keys}


def row_range(key: str, shard_size: int) -> range:
    start = shard_index(key) * shard_size
    return range(start, start + shard_size)
