"""The input of an extraction: a shard's validated traces and the target's facts, checked against the contract.

Dagster-free; errors name the file, the sample and what is wrong.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_assets.core.storage.shard_files import ShardFileError, read_shard_parquet
from eagle3_assets.core.target.description import TargetError, checked_layer_ids, read_config, text_config


class ExtractionInputError(ValueError):
    """The traces or the settings cannot be extracted; the message names the input and what is wrong."""


@dataclass(frozen=True, eq=False)
class Trace:
    """One validated trace: the token ids the target sees and the mask of what it generated.

    The ids and masks of a shard are views into two flat arrays (int64, int8):
    a shard of 80 M tokens takes 0.7 GB this way, and several GB as Python lists.
    """

    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int8

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def of(cls, sample_id: str, input_ids: Sequence[int], loss_mask: Sequence[int]) -> Trace:
        return cls(sample_id, torch.as_tensor(input_ids, dtype=torch.int64), torch.as_tensor(loss_mask, dtype=torch.int8))


def read_traces(path: Path, vocab_size: int | None = None) -> list[Trace]:
    """The kept rows of a ``validated_traces`` shard, checked against the contract."""
    import polars as pl

    path = Path(path)
    if not path.is_file():
        raise ExtractionInputError(f"validated_traces {path}: no such file (materialise validated_traces for this shard first)")
    try:
        frame = read_shard_parquet(path, asset="validated_traces", columns=["id", "input_ids", "loss_mask"])
    except ShardFileError as exc:  # truncated or damaged: the message names the file, the shard and the fix
        raise ExtractionInputError(str(exc)) from exc
    ids = frame["id"].to_list()
    lengths = frame["input_ids"].list.len().fill_null(0).to_list()
    mask_lengths = frame["loss_mask"].list.len().fill_null(-1).to_list()
    seen: set[str] = set()
    for sample_id, length, mask_length in zip(ids, lengths, mask_lengths):
        where = f"validated_traces {path}: sample {sample_id!r}"
        if not sample_id:
            raise ExtractionInputError(f"validated_traces {path}: a row has an empty id")
        if sample_id in seen:
            raise ExtractionInputError(f"{where}: duplicate id")
        seen.add(sample_id)
        if not length:
            raise ExtractionInputError(f"{where}: no input_ids")
        if mask_length != length:
            raise ExtractionInputError(f"{where}: loss_mask has {max(mask_length, 0)} entries for {length} input_ids")
    if not ids:
        return []
    flat_ids = torch.from_numpy(frame["input_ids"].explode().cast(pl.Int64).to_numpy().copy())
    flat_mask = torch.from_numpy(frame["loss_mask"].explode().cast(pl.Int8).to_numpy().copy())
    if vocab_size is not None and (int(flat_ids.min()) < 0 or int(flat_ids.max()) >= vocab_size):
        bad = int(((flat_ids < 0) | (flat_ids >= vocab_size)).nonzero()[0])
        owner = next(i for i, end in zip(ids, itertools.accumulate(lengths)) if bad < end)
        raise ExtractionInputError(f"validated_traces {path}: sample {owner!r}: token id outside the target's vocabulary of {vocab_size}")
    traces = []
    start = 0
    for sample_id, length in zip(ids, lengths):
        traces.append(Trace(str(sample_id), flat_ids[start : start + length], flat_mask[start : start + length]))
        start += length
    return traces


def traces_digest(traces: Sequence[Trace]) -> str:
    """A content hash of what is extracted (ids, tokens, masks): part of the extraction's identity."""
    digest = hashlib.sha256()
    for trace in traces:
        digest.update(trace.id.encode() + b"\0")
        digest.update(trace.input_ids.contiguous().numpy().tobytes())
        digest.update(trace.loss_mask.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TargetFacts:
    """What the format needs to know about the target, read from its ``config.json``."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_path(cls, target_path: Path | str) -> TargetFacts:
        try:
            text = text_config(read_config(target_path))
        except TargetError as exc:
            raise ExtractionInputError(str(exc)) from None
        return cls(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
        )


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """:func:`~eagle3_assets.core.target.description.checked_layer_ids` (the one check), as an extraction input error."""
    try:
        return checked_layer_ids(layer_ids, num_layers)
    except TargetError as exc:
        raise ExtractionInputError(str(exc)) from None


