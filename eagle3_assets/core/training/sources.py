"""Where a training run's batches come from: the one loop (:mod:`.loop`) takes a batch source.

Two sources exist:

- :class:`StoredShards` (``hidden_states_mode: offline``): the materialised
  ``hidden_states`` shards, read from disk every epoch;
- :class:`~eagle3_assets.core.training.streamed.StreamedWindow`
  (``hidden_states_mode: bounded``): each shard's states extracted again every
  epoch into a window of at most ``window_shards`` shards, gated, trained on
  and deleted.

A source plans the run as optimizer steps grouped into *units* (the states
one step reads: an epoch of the stored shards, or one streamed shard of one
epoch), opens a unit before its first step and closes it after the unit's
last checkpoint. Everything else (the schedule, resume, checkpoints, the
journal, events, the result) is the loop's, the same for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import (
    Batch, HiddenStateIndex, epoch_steps, index_hidden_states, load_batch, mixed_index, supervised_token_count,
)  # fmt: skip

OnEvent = Callable[[dict], None]


@dataclass(frozen=True)
class PlannedStep:
    """One optimizer step of the plan: which unit's states it reads and every process's micro-batches."""

    step: int  # 1-based, over the whole run
    epoch: int  # 1-based
    unit: int  # the unit (a source's group of steps over the same states) it belongs to
    batches: tuple[tuple[str, tuple[int, ...]], ...]  # (batch id, members), members as the source names its samples


@dataclass(frozen=True)
class DataSize:
    """What the schedule is fitted to, known before the first step."""

    samples: int
    tokens: int  # after truncation to max_seq_len
    supervised_tokens: int
    longest: int  # the longest sample after truncation: the least one micro-batch must hold


class UnitStates(Protocol):
    def load(self, members: tuple[int, ...]) -> Batch: ...

    def sample_ids(self, members: tuple[int, ...]) -> list[str]: ...


class BatchSource(Protocol):
    """What the loop asks of a source, in the order it asks."""

    mode: str  # "offline" | "bounded"
    checkpoint_every_steps: int | None  # checkpoints between units' ends too (None: at each unit's end only)

    def describe(self, config: TrainConfig) -> tuple[HiddenStateIndex, DataSize]:
        """The states' facts (an index without samples when nothing is extracted yet) and the data's size."""

    def steps_per_epoch(self, config: TrainConfig, world: int) -> int: ...

    def plan(self, config: TrainConfig, world: int) -> list[PlannedStep]: ...

    def unit_fields(self, unit: int) -> dict:
        """What names a unit in the step records and the journal (e.g. the shard)."""

    def start_fields(self) -> dict:
        """What the ``start`` event says of the source beyond the loop's figures."""

    def done_fields(self) -> dict:
        """What the ``done`` event says of the source."""

    def start(self, plan: list[PlannedStep], done_steps: int, saved: dict, emit: OnEvent) -> None:
        """Before the first step (of a fresh or resumed run); ``saved`` is the source's part of the checkpoint."""

    def open(self, unit: int, emit: OnEvent) -> UnitStates: ...

    def finish(self, unit: int) -> None:
        """After the unit's last step, before its last checkpoint."""

    def close(self, unit: int, emit: OnEvent) -> None:
        """After the unit's last checkpoint: its states are no longer needed."""

    def state(self) -> dict:
        """The source's part of a checkpoint."""

    def report(self) -> dict:
        """What the materialisation records of the source."""

    def stop(self) -> None: ...


class _StoredUnit:
    def __init__(self, index: HiddenStateIndex, max_seq_len: int, packed: bool):
        self.index, self.max_seq_len, self.packed = index, max_seq_len, packed

    def load(self, members: tuple[int, ...]) -> Batch:
        return load_batch([self.index.samples[j] for j in members], self.max_seq_len, self.packed)

    def sample_ids(self, members: tuple[int, ...]) -> list[str]:
        return [self.index.samples[j].sample_id for j in members]


class StoredShards:
    """The materialised ``hidden_states`` shards: one unit per epoch, the same files every epoch."""

    mode = "offline"
    checkpoint_every_steps = None  # one checkpoint at each epoch's end

    def __init__(self, shard_dirs: list[str]):
        if not shard_dirs:
            raise ValueError("training settings: no hidden-state shard directories (hidden_state_dirs is empty)")
        self.shard_dirs = shard_dirs
        self.index: HiddenStateIndex | None = None
        self.lengths: list[int] = []
        self.max_seq_len = 0
        self.packed = False

    def describe(self, config: TrainConfig) -> tuple[HiddenStateIndex, DataSize]:
        if config.supervised_dirs:
            self.index = mixed_index(self.shard_dirs, config.supervised_dirs, config.supervised_share, config.seed)
        else:
            self.index = index_hidden_states(self.shard_dirs)
        self.max_seq_len, self.packed = config.max_seq_len, config.pack_samples
        self.lengths = [min(s.length, config.max_seq_len) for s in self.index.samples]
        size = DataSize(len(self.lengths), sum(self.lengths), supervised_token_count(self.index, config.max_seq_len), max(self.lengths))
        return self.index, size

    def steps_per_epoch(self, config: TrainConfig, world: int) -> int:
        return len(epoch_steps(self.lengths, config, world, 0))

    def plan(self, config: TrainConfig, world: int) -> list[PlannedStep]:
        steps: list[PlannedStep] = []
        for epoch in range(config.epochs):
            position = 0  # a batch id is its position in the epoch (the last step's fill-up repeats samples, not ids)
            for micro_batches in epoch_steps(self.lengths, config, world, epoch):
                named = tuple((f"e{epoch + 1}/b{position + k:05d}", tuple(members)) for k, members in enumerate(micro_batches))
                position += len(named)
                steps.append(PlannedStep(len(steps) + 1, epoch + 1, epoch, named))
        return steps

    def unit_fields(self, unit: int) -> dict:
        return {}

    def start_fields(self) -> dict:
        return {}

    def done_fields(self) -> dict:
        return {}

    def start(self, plan: list[PlannedStep], done_steps: int, saved: dict, emit: OnEvent) -> None:
        pass

    def open(self, unit: int, emit: OnEvent) -> UnitStates:
        assert self.index is not None
        return _StoredUnit(self.index, self.max_seq_len, self.packed)

    def finish(self, unit: int) -> None:
        pass

    def close(self, unit: int, emit: OnEvent) -> None:
        pass

    def state(self) -> dict:
        return {}

    def report(self) -> dict:
        assert self.index is not None
        mix = {"mix": self.index.mix} if self.index.mix else {}
        return {"hidden_states_mode": self.mode, "samples": len(self.index.samples), "hidden_state_dtypes": self.index.dtypes, **mix}

    def stop(self) -> None:
        pass
