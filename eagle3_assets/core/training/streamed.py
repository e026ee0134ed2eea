"""Bounded-disk mode's batch source: hidden states extracted as training consumes them, a window of shards on disk.

Offline mode (:class:`~eagle3_assets.core.training.sources.StoredShards`)
trains on ``hidden_states`` shards that stay on disk: 8·H bytes per token in
bf16, about 2.3 TB for the story's 40 M tokens at H = 7,168. This source never
stores the dataset. Every epoch streams the shards again:

- a producer thread extracts the next shard (the same :func:`extract_shard`
  and backends as ``hidden_states``) into ``<window_dir>/e<epoch>-<shard>/``
  and runs the same gates on it (:func:`gate_extracted_shard`: target matches
  the traces, finite, the traces' samples, final state reproduces the
  target's choices, aux states at the configured layers; per-part checksums
  are verified again when the shard is indexed). A failing gate stops
  training with an error naming the shard, the epoch and the gate;
- the loop takes the shards in the plan's order (one unit per shard and
  epoch), trains on each one's micro-batches, checkpoints, and the source
  deletes the shard's directory;
- a shard takes one of ``window_shards`` slots from before its first file is
  created until after its directory is deleted, so at most ``window_shards``
  shards of states exist at any time. With a window of 2 or more the next
  shard is extracted while the current one is trained on.

The plan is a pure function of the seed and the shards' token counts (read
from ``validated_traces``, so it is known before anything is extracted): the
shard order of each epoch is shuffled by (seed, epoch), and each shard's
micro-batches by (seed, epoch, shard), with :func:`epoch_micro_batches`.
Every batch has an id ``e<epoch>/<shard>/b<k>``. Resume, checkpoints (every
``checkpoint_every_steps`` steps and at each shard's end) and the journal are
the loop's, as for stored shards.
"""

from __future__ import annotations

import queue
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
from eagle3_assets.core.extraction.traces import TargetFacts, read_traces
from eagle3_assets.core.extraction.hidden_state_checks import check_target_matches_traces, gate_extracted_shard, keep_logits_references
from eagle3_assets.core.extraction.job import shard_check_seed
from eagle3_assets.core.training.job import BoundedRun, StreamedShard
from eagle3_assets.core.storage.files import fsync_dir, stable_hash
from eagle3_assets.core.target.head import TargetHead
from eagle3_assets.core.target.identity import identity_in_parquet, target_identity
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import Batch, HiddenStateIndex, epoch_micro_batches, index_hidden_states, load_batch
from eagle3_assets.core.training.sources import DataSize, OnEvent, PlannedStep


class StreamedGateError(RuntimeError):
    """A streamed shard failed a gate: training stops before it learns from that shard."""


@dataclass(frozen=True)
class StreamItem:
    """One shard's states for one epoch: extracted, gated, trained on, deleted (the loop's unit)."""

    position: int  # in the run's stream
    epoch: int  # 1-based
    shard: StreamedShard

    @property
    def name(self) -> str:
        return f"e{self.epoch:04d}-{self.shard.key}"


def directory_bytes(path: Path) -> int:
    """Bytes of every file below ``path`` (files and directories vanishing meanwhile count as gone)."""
    total = 0
    try:
        for file in Path(path).rglob("*"):
            try:
                if file.is_file():
                    total += file.stat().st_size
            except FileNotFoundError:
                pass
    except FileNotFoundError:  # a shard's directory deleted while it was being listed
        pass
    return total


class PeakBytes:
    """The most bytes the window directory was seen to hold (measured on each extraction batch and deletion)."""

    def __init__(self, window: Path, start: int = 0):
        self.window, self.peak, self._lock = window, start, threading.Lock()

    def measure(self) -> int:
        now = directory_bytes(self.window)
        with self._lock:
            self.peak = max(self.peak, now)
        return now


class ShardProducer(threading.Thread):
    """Extracts and gates the stream's shards ahead of the trainer, in the plan's order, one window slot per shard.

    A slot is taken before a shard's first file is created and given back
    after the shard's directory is deleted (:meth:`release`), so at most
    ``window_shards`` shards of states exist at once.
    """

    def __init__(self, items: list[StreamItem], window_shards: int, prepare: Callable[[StreamItem], dict]):
        super().__init__(name="bounded-extraction", daemon=True)
        self.items, self.prepare = items, prepare
        self.slots = threading.Semaphore(window_shards)
        self.ready: queue.Queue = queue.Queue()
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            for item in self.items:
                while not self.slots.acquire(timeout=0.2):
                    if self.stopping.is_set():
                        return
                if self.stopping.is_set():
                    return
                self.ready.put((item, self.prepare(item)))
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            self.ready.put((None, exc))

    def take(self, item: StreamItem) -> dict:
        """The next shard's record once it is extracted and gated; the producer's error if it failed."""
        got, prepared = self.ready.get()
        if got is None:
            raise prepared
        assert got.position == item.position, "the producer follows the plan's order"
        return prepared

    def release(self) -> None:
        self.slots.release()

    def close(self) -> None:
        self.stopping.set()
        self.join(timeout=600)


class _ShardStates:
    def __init__(self, shard_dir: Path, rows: list[str], max_seq_len: int, packed: bool):
        self.samples = {s.sample_id: s for s in index_hidden_states([shard_dir]).samples}  # verifies each part's checksum
        self.rows, self.max_seq_len, self.packed = rows, max_seq_len, packed

    def load(self, members: tuple[int, ...]) -> Batch:
        return load_batch([self.samples[self.rows[r]] for r in members], self.max_seq_len, self.packed)

    def sample_ids(self, members: tuple[int, ...]) -> list[str]:
        return [self.rows[r] for r in members]


class StreamedWindow:
    """The bounded-disk source: ``run`` says what to stream, ``backend`` extracts (open for the whole run).

    ``reference_states`` is an optional transformers forward for the aux-layer
    gate, as the ``hidden_states`` stage passes it.
    """

    mode = "bounded"

    def __init__(self, run: BoundedRun, backend, reference_states=None):
        run.validate()
        self.run, self.backend, self.reference_states = run, backend, reference_states
        self.checkpoint_every_steps = run.checkpoint_every_steps
        self.window = Path(run.window_dir)
        self.items: list[StreamItem] = []
        self.streamed: list[dict] = []
        self.prepared: dict[int, dict] = {}
        self.producer: ShardProducer | None = None
        self.peak: PeakBytes | None = None

    # -- before training: the data's size and the plan, from the traces alone

    def describe(self, config: TrainConfig) -> tuple[HiddenStateIndex, DataSize]:
        if config.supervised_dirs:
            raise ValueError("training settings: supervised_dirs (a refinement round's supervised mix) need stored shards, hidden_states_mode offline")
        run = self.run
        self.facts = facts = TargetFacts.from_path(config.target_path)
        self.settings = ExtractionSettings(
            target_path=config.target_path,
            target_config_hash=run.target.config_hash,
            aux_layer_ids=tuple(run.target.aux_layer_ids),
            dtype=run.extraction.dtype,
            part_bytes=run.extraction.part_size_bytes,
        )
        self.max_seq_len, self.packed = config.max_seq_len, config.pack_samples
        self.lengths, self.ids_by_row, supervised = {}, {}, 0
        for shard in run.shards:
            traces = read_traces(Path(shard.traces), facts.vocab_size)
            self.lengths[shard.key] = [min(t.num_tokens, config.max_seq_len) for t in traces]
            self.ids_by_row[shard.key] = [t.id for t in traces]
            supervised += sum(int(t.loss_mask[: config.max_seq_len].sum()) for t in traces)
        # What training needs of the states before any exists: the target and the backend say it.
        identity = {
            "mode": self.mode,
            "shards": [(s.key, s.data_version) for s in sorted(run.shards, key=lambda s: s.key)],
            "dtype": run.extraction.dtype,
            "aux_layer_ids": list(self.settings.aux_layer_ids),
            "backend": self.backend.name,
            "final_state": self.backend.final_state,
            "target_config_hash": run.target.config_hash,
        }
        index = HiddenStateIndex(
            samples=[],
            aux_layer_ids=list(self.settings.aux_layer_ids),
            num_layers=facts.num_layers,
            hidden_size=facts.hidden_size,
            vocab_size=facts.vocab_size,
            final_state=self.backend.final_state,
            target_config_hash=run.target.config_hash,
            fingerprint=stable_hash(identity),
            dtypes=[run.extraction.dtype],
        )
        all_lengths = [n for v in self.lengths.values() for n in v]
        return index, DataSize(len(all_lengths), sum(all_lengths), supervised, max(all_lengths))

    def steps_per_epoch(self, config: TrainConfig, world: int) -> int:
        micro = [epoch_micro_batches(v, config.batch_tokens, config.seed, 0, config.pack_samples) for v in self.lengths.values()]
        return sum(-(-len(m) // config.grad_accumulation) for m in micro)

    def plan(self, config: TrainConfig, world: int) -> list[PlannedStep]:
        """Every epoch's shard order and every shard's optimizer steps: a pure function of the seed and the lengths."""
        if world != 1:
            raise ValueError("bounded mode trains in one process")
        self.items, steps = [], []
        for epoch in range(config.epochs):
            order = sorted(self.run.shards, key=lambda s: s.key)
            random.Random(f"{config.seed}:{epoch}:shards").shuffle(order)
            for shard in order:
                item = StreamItem(len(self.items), epoch + 1, shard)
                self.items.append(item)
                # The epoch "number" is a string here: the shard's batches shuffle by (seed, epoch, shard).
                micro = epoch_micro_batches(self.lengths[shard.key], config.batch_tokens, config.seed, f"{epoch}:{shard.key}", config.pack_samples)  # type: ignore[arg-type]
                named = [(f"e{epoch + 1}/{shard.key}/b{k:05d}", tuple(rows)) for k, rows in enumerate(micro)]
                for i in range(0, len(named), config.grad_accumulation):
                    steps.append(PlannedStep(len(steps) + 1, epoch + 1, item.position, tuple(named[i : i + config.grad_accumulation])))
        return steps

    def unit_fields(self, unit: int) -> dict:
        return {"shard": self.items[unit].shard.key}

    def start_fields(self) -> dict:
        return {"shards": len(self.run.shards), "window_shards": self.run.window_shards}

    def done_fields(self) -> dict:
        return {"peak_window_bytes": self.peak.peak if self.peak else 0}

    # -- training: the producer runs ahead, the loop opens and closes one shard at a time

    def start(self, plan: list[PlannedStep], done_steps: int, saved: dict, emit: OnEvent) -> None:
        self.streamed = list(saved.get("streamed", []))
        self.window.mkdir(parents=True, exist_ok=True)
        upcoming = self.items[plan[done_steps].unit :] if done_steps < len(plan) else []
        keep = {item.name for item in upcoming[: self.run.window_shards]}
        for stale in sorted(self.window.iterdir()):
            if stale.name not in keep:  # finished before the kill, or never in this plan: not this window's
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
                emit({"event": "removed", "path": str(stale)})
        self.peak = PeakBytes(self.window, int(saved.get("peak_window_bytes", 0)))
        self.gate_head = TargetHead.from_checkpoint(self.settings.target_path)  # the gates run on the CPU, as the stage's do
        self.identity = target_identity(self.settings.target_path)
        self.producer = ShardProducer(upcoming, self.run.window_shards, self._prepare)
        self.producer.start()

    def _prepare(self, item: StreamItem) -> dict:
        """Extract one shard into the window, then gate it (the producer thread)."""
        assert self.peak is not None
        run, facts, peak = self.run, self.facts, self.peak
        shard_dir = self.window / item.name
        traces = read_traces(Path(item.shard.traces), facts.vocab_size)
        outcomes = [check_target_matches_traces(self.identity, identity_in_parquet(Path(item.shard.traces)))]
        started = time.monotonic()
        if outcomes[0].passed:  # nothing is extracted for a target that did not render the traces
            keep_logits_references(self.backend, traces, run.extraction.logits_check_samples, shard_check_seed(item.shard.key))
            report = extract_shard(traces, shard_dir, self.settings, self.backend, on_event=lambda e: e["event"] in ("batch", "part") and peak.measure())
            outcomes += gate_extracted_shard(
                shard_dir, traces, self.gate_head, self.backend.reference_argmax, self.settings.aux_layer_ids, facts,
                self.reference_states, run.extraction, shard_check_seed(item.shard.key),
            )  # fmt: skip
        failed = [o for o in outcomes if not o.passed]
        if failed:
            raise StreamedGateError(
                f"streamed shard {item.shard.key} (epoch {item.epoch}): gate {failed[0].name} failed: {failed[0].description}; "
                f"training stopped before learning from it (its states are in {shard_dir})"
            )
        return {
            "epoch": item.epoch,
            "shard": item.shard.key,
            "data_version": item.shard.data_version,
            "samples": report.samples,
            "tokens": report.tokens,
            "bytes": report.bytes_on_disk,
            "parts_reused": report.parts_reused,
            "extract_s": round(time.monotonic() - started, 2),
            "gates": {o.name: o.passed for o in outcomes},
        }

    def open(self, unit: int, emit: OnEvent) -> _ShardStates:
        assert self.producer is not None
        item = self.items[unit]
        self.prepared[unit] = prepared = self.producer.take(item)
        emit({"event": "extracted", **prepared})
        return _ShardStates(self.window / item.name, self.ids_by_row[item.shard.key], self.max_seq_len, self.packed)

    def finish(self, unit: int) -> None:
        self.streamed.append(self.prepared.pop(unit))

    def close(self, unit: int, emit: OnEvent) -> None:
        """Committed: the shard's states are no longer needed, and its slot goes to the next shard."""
        assert self.peak is not None and self.producer is not None
        item = self.items[unit]
        self.peak.measure()
        shutil.rmtree(self.window / item.name)
        fsync_dir(self.window)
        self.producer.release()
        emit({"event": "streamed", "epoch": item.epoch, "shard": item.shard.key, "window_bytes": self.peak.measure(), "peak_window_bytes": self.peak.peak})

    def state(self) -> dict:
        return {"streamed": self.streamed, "peak_window_bytes": self.peak.peak if self.peak else 0}

    def report(self) -> dict:
        return {
            "hidden_states_mode": self.mode,
            "samples": sum(len(v) for v in self.lengths.values()),
            "hidden_state_dtypes": [self.run.extraction.dtype],
            "window_shards": self.run.window_shards,
            "peak_window_bytes": self.peak.peak if self.peak else 0,
            "streamed_shards": self.streamed,
        }

    def stop(self) -> None:
        if self.producer is not None:
            self.producer.close()
