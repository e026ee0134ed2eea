"""Bounded-disk training: the draft learns from hidden states as they are extracted, and the disk holds a window.

Offline mode (``core/training/``) trains on ``hidden_states`` shards that
stay on disk: 8·H bytes per token in bf16, about 2.3 TB for the story's 40 M
tokens at H = 7,168. Bounded mode never stores the dataset. Every epoch
streams the shards again:

- a producer thread extracts the next shard (the same :func:`extract_shard`
  and backends as ``hidden_states``) into ``<window_dir>/e<epoch>-<shard>/``
  and runs the same gates on it (:func:`gate_extracted_shard`) (target matches the traces, finite, the
  traces' samples, final state reproduces the target's choices, aux states
  at the configured layers; per-part checksums are verified again when the
  trainer indexes the shard). A failing gate stops training with an error
  naming the shard, the epoch and the gate;
- the trainer takes the shards in the plan's order, trains on each one's
  micro-batches, checkpoints, and deletes the shard's directory;
- a shard takes one of ``window_shards`` slots from before its first file is
  created until after its directory is deleted, so at most ``window_shards``
  shards of states exist at any time. With a window of 2 or more the next
  shard is extracted while the current one is trained on.

Extracting again each epoch costs target forward passes (an extraction per
epoch instead of one); what it buys is a disk bounded by the window, not the
dataset.

The plan is a pure function of the seed and the shards' token counts (read
from ``validated_traces``, so it is known before anything is extracted): the
shard order of each epoch is shuffled by (seed, epoch), and each shard's
micro-batches by (seed, epoch, shard), with :func:`epoch_micro_batches`.
Every batch has an id ``e<epoch>/<shard>/b<k>``.

Kill and resume: a checkpoint (``step-NNNNNNNN``, atomic and verified like
the epoch checkpoints) records the optimizer step, and with it the epoch,
the shard and the batch position, every ``checkpoint_every_steps`` steps and
at the end of each shard. ``trained_batches.jsonl`` is the journal of
committed steps: the lines of a step are appended only after the checkpoint
that holds its weights is durable (the checkpoint carries them, so a kill
between the two is repaired on resume). Steps trained after the last
checkpoint die with the process, weights and journal lines alike, and are
trained once more from the checkpoint: the journal lists every batch of the
plan exactly once per epoch, and so do the weights.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3_assets.core.extraction import ExtractionSettings, TargetFacts, extract_shard, read_traces
from eagle3_assets.core.hidden_state_checks import check_target_matches_traces, gate_extracted_shard, keep_logits_references
from eagle3_assets.core.stage_jobs import BoundedRun, StreamedShard, shard_check_seed
from eagle3_assets.core.storage import fsync_dir, stable_hash, write_bytes_atomic, write_json_atomic
from eagle3_assets.core.target_head import TargetHead, load_head_weights
from eagle3_assets.core.target_identity import identity_in_parquet, target_identity
from eagle3_assets.core.training.checkpoints import latest_checkpoint, restore_checkpoint, run_fingerprint, save_checkpoint
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import HiddenStateIndex, epoch_micro_batches, index_hidden_states, load_batch
from eagle3_assets.core.training.initial_weights import initial_draft
from eagle3_assets.core.training.loop import Trainer, _pick_device, fitted_config
from eagle3_assets.core.vocab import load_vocab_mapping

JOURNAL = "trained_batches.jsonl"
STEP_CHECKPOINT_GLOB = "step-*"
EVENT_PREFIX = "EAGLE3_BOUNDED_EVENT "

OnEvent = Callable[[dict], None]


class StreamedGateError(RuntimeError):
    """A streamed shard failed a gate: training stops before it learns from that shard."""


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class StreamItem:
    """One shard's states for one epoch: extracted, gated, trained on, deleted."""

    position: int  # in the run's stream
    epoch: int  # 1-based
    shard: StreamedShard

    @property
    def name(self) -> str:
        return f"e{self.epoch:04d}-{self.shard.key}"


@dataclass(frozen=True)
class PlannedStep:
    step: int  # 1-based, global
    item: int  # StreamItem.position
    batches: tuple[tuple[str, tuple[int, ...]], ...]  # (batch id, rows of the shard's validated_traces)


def plan_stream(shards: list[StreamedShard], lengths: dict[str, list[int]], config: TrainConfig) -> tuple[list[StreamItem], list[PlannedStep]]:
    """Every epoch's shard order and every shard's optimizer steps: a pure function of the seed and the lengths."""
    items: list[StreamItem] = []
    steps: list[PlannedStep] = []
    for epoch in range(config.epochs):
        order = sorted(shards, key=lambda s: s.key)
        random.Random(f"{config.seed}:{epoch}:shards").shuffle(order)
        for shard in order:
            item = StreamItem(len(items), epoch + 1, shard)
            items.append(item)
            # The epoch "number" is a string here: the shard's batches shuffle by (seed, epoch, shard).
            micro = epoch_micro_batches(lengths[shard.key], config.batch_tokens, config.seed, f"{epoch}:{shard.key}")  # type: ignore[arg-type]
            named = [(f"e{epoch + 1}/{shard.key}/b{k:05d}", tuple(rows)) for k, rows in enumerate(micro)]
            for i in range(0, len(named), config.grad_accumulation):
                steps.append(PlannedStep(len(steps) + 1, item.position, tuple(named[i : i + config.grad_accumulation])))
    return items, steps


# --------------------------------------------------------------------------- the window


def directory_bytes(path: Path) -> int:
    """Bytes of every file below ``path`` (files vanishing meanwhile count as gone)."""
    total = 0
    for file in Path(path).rglob("*"):
        try:
            if file.is_file():
                total += file.stat().st_size
        except FileNotFoundError:
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

    A slot is taken before a shard's first file is created and given back by
    the trainer after it deleted the shard's directory (:meth:`release`), so
    at most ``window_shards`` shards of states exist at once.
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


# --------------------------------------------------------------------------- the journal


def read_journal(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_journal(path: Path, records: list[dict]) -> None:
    if not records:
        return
    with open(path, "a") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- training


def _lengths_and_supervised(shards: list[StreamedShard], vocab_size: int, max_seq_len: int) -> tuple[dict, dict, int]:
    """Per shard: trace lengths (truncated as training truncates) and ids by row; all supervised tokens."""
    lengths, ids, supervised = {}, {}, 0
    for shard in shards:
        traces = read_traces(Path(shard.traces), vocab_size)
        lengths[shard.key] = [min(t.num_tokens, max_seq_len) for t in traces]
        ids[shard.key] = [t.id for t in traces]
        supervised += sum(int(t.loss_mask[:max_seq_len].sum()) for t in traces)
    return lengths, ids, supervised


def train_bounded(run: BoundedRun, backend, *, reference_states=None, on_event: OnEvent | None = None) -> dict:
    """Stream, gate, train and delete, shard after shard, epoch after epoch; result.json's content.

    ``backend`` is an extraction backend (:mod:`core.extraction`), open for
    the whole run; ``reference_states`` an optional transformers forward for
    the aux-layer gate (as the hidden_states stage passes it).
    """
    run.validate()
    emit = on_event or (lambda event: None)
    config = run.train
    device = _pick_device()
    threads = torch.get_num_threads()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    elif device.type == "cpu":
        torch.set_num_threads(1)  # as offline training on CPU: the tiny draft's matrices are too small to split
    try:
        return _train_bounded(run, backend, reference_states, emit, device)
    finally:
        torch.set_num_threads(threads)


def _train_bounded(run: BoundedRun, backend, reference_states, emit: OnEvent, device: torch.device) -> dict:
    config = run.train
    facts = TargetFacts.from_path(config.target_path)
    settings = ExtractionSettings(
        target_path=config.target_path,
        target_config_hash=run.target.config_hash,
        aux_layer_ids=tuple(run.target.aux_layer_ids),
        dtype=run.extraction.dtype,
        part_bytes=run.extraction.part_size_bytes,
    )
    lengths, ids_by_row, supervised = _lengths_and_supervised(run.shards, facts.vocab_size, config.max_seq_len)

    def steps_per_epoch(batch_tokens: int) -> int:
        return sum(-(-len(epoch_micro_batches(v, batch_tokens, config.seed, 0)) // config.grad_accumulation) for v in lengths.values())

    config, schedule = fitted_config(
        config,
        total_tokens=sum(map(sum, lengths.values())),
        supervised_tokens=supervised,
        hidden_size=facts.hidden_size,
        steps_per_epoch_for=steps_per_epoch,
    )
    emit({"event": "schedule", "description": schedule.describe(), "warnings": schedule.warnings, **asdict(schedule)})
    items, steps = plan_stream(run.shards, lengths, config)

    # What training needs of the states before any exists: the target and the backend say it.
    stream_identity = {
        "mode": "bounded",
        "shards": [(s.key, s.data_version) for s in sorted(run.shards, key=lambda s: s.key)],
        "dtype": run.extraction.dtype,
        "aux_layer_ids": list(settings.aux_layer_ids),
        "backend": backend.name,
        "final_state": backend.final_state,
        "target_config_hash": run.target.config_hash,
    }
    stub = HiddenStateIndex(
        samples=[],
        aux_layer_ids=list(settings.aux_layer_ids),
        num_layers=facts.num_layers,
        hidden_size=facts.hidden_size,
        vocab_size=facts.vocab_size,
        final_state=backend.final_state,
        target_config_hash=run.target.config_hash,
        fingerprint=stable_hash(stream_identity),
    )
    mapping = load_vocab_mapping(Path(config.vocab_mapping))
    if mapping.target_vocab_size != facts.vocab_size:
        raise ValueError(f"vocab mapping covers {mapping.target_vocab_size} target ids, the target has {facts.vocab_size}")
    target = load_head_weights(config.target_path)
    draft, init_report = initial_draft(config, stub, mapping, target)
    draft.embed_tokens.weight.requires_grad_(False)
    draft.to(device)
    target_head, draft_to_target = TargetHead.from_weights(target).to(device), mapping.draft_to_target.to(device)
    head = lambda final: target_head.draft_logits(final, backend.final_state, draft_to_target)  # noqa: E731
    # The offline loop's optimizer step (one process: bounded mode streams to a single trainer).
    trainer = Trainer(draft, head, config, device, len(steps), distributed=False)
    optimizer, scheduler = trainer.optimizer, trainer.scheduler
    fingerprint = run_fingerprint(config, stub)

    training_dir = Path(config.training_dir)
    checkpoints = training_dir / "checkpoints"
    journal = training_dir / JOURNAL
    training_dir.mkdir(parents=True, exist_ok=True)
    if checkpoints.is_dir():
        for partial in checkpoints.glob(".*.partial"):  # a crash mid-checkpoint: never resumed from
            shutil.rmtree(partial, ignore_errors=True)
    step, history, streamed, peak_start, resumed_from = 0, [], [], 0, None
    resume = latest_checkpoint(checkpoints, fingerprint, pattern=STEP_CHECKPOINT_GLOB)
    if resume is not None:
        state = restore_checkpoint(resume, draft, optimizer, scheduler)
        step, history, streamed, peak_start = state["step"], state["history"], state["streamed"], state["peak_window_bytes"]
        resumed_from = str(resume)
        # The checkpoint is durable, its journal lines perhaps not yet (a kill between the two): append what is missing.
        done = max((r["step"] for r in read_journal(journal)), default=0)
        append_journal(journal, [r for r in state["journal"] if r["step"] > done])
        position = steps[step - 1].batches[-1][0] if step else "the start"
        emit({"event": "resumed", "checkpoint": str(resume), "step": step, "after_batch": position})
    else:
        write_bytes_atomic(journal, b"")  # a journal of another run (or of none) is not this run's

    window = Path(run.window_dir)
    window.mkdir(parents=True, exist_ok=True)
    upcoming = items[steps[step].item :] if step < len(steps) else []
    keep = {item.name for item in upcoming[: run.window_shards]}
    for stale in sorted(window.iterdir()):
        if stale.name not in keep:  # finished before the kill, or never in this plan: not this window's
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            emit({"event": "removed", "path": str(stale)})
    peak = PeakBytes(window, peak_start)
    emit(
        {
            "event": "start",
            "samples": sum(len(v) for v in lengths.values()),
            "tokens": sum(map(sum, lengths.values())),
            "shards": len(run.shards),
            "window_shards": run.window_shards,
            "total_steps": len(steps),
            "device": str(device),
            "init": asdict(init_report),
            "fingerprint": fingerprint,
        }
    )

    # -- what the producer does with each shard: extract it into the window, then gate it (on the CPU, as the stage does)
    gate_head = TargetHead.from_checkpoint(config.target_path)
    identity = target_identity(config.target_path)

    def prepare(item: StreamItem) -> dict:
        shard_dir = window / item.name
        traces = read_traces(Path(item.shard.traces), facts.vocab_size)
        where = f"streamed shard {item.shard.key} (epoch {item.epoch})"
        outcomes = [check_target_matches_traces(identity, identity_in_parquet(Path(item.shard.traces)))]
        started = time.monotonic()
        if outcomes[0].passed:  # nothing is extracted for a target that did not render the traces
            keep_logits_references(backend, traces, run.extraction.logits_check_samples, shard_check_seed(item.shard.key))
            report = extract_shard(traces, shard_dir, settings, backend, on_event=lambda e: e["event"] in ("batch", "part") and peak.measure())
            outcomes += gate_extracted_shard(
                shard_dir, traces, gate_head, backend.reference_argmax, settings.aux_layer_ids, facts, reference_states,
                run.extraction, shard_check_seed(item.shard.key),
            )  # fmt: skip
        failed = [o for o in outcomes if not o.passed]
        if failed:
            raise StreamedGateError(
                f"{where}: gate {failed[0].name} failed: {failed[0].description}; training stopped before learning from it "
                f"(its states are in {shard_dir})"
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

    producer = ShardProducer(upcoming, run.window_shards, prepare)
    producer.start()

    started, tokens_seen, waiting_s = time.monotonic(), 0, 0.0
    pending: list[dict] = []  # journal lines of steps not yet in a checkpoint
    last_checkpoint = resumed_from or ""
    pid = os.getpid()

    def commit(item: StreamItem) -> None:
        nonlocal last_checkpoint, pending
        state = {
            "fingerprint": fingerprint,
            "step": step,
            "epoch": item.epoch,
            "shard": item.shard.key,
            "batch": steps[step - 1].batches[-1][0],
            "history": history,
            "streamed": streamed,
            "peak_window_bytes": peak.peak,
            "journal": pending,
            "draft_config": asdict(draft.config),
            "init": asdict(init_report),
            "config": config.to_dict(),
            "mode": "bounded",
        }
        path = save_checkpoint(
            checkpoints, step, draft, optimizer, scheduler, state, config.keep_checkpoints, name=f"step-{step:08d}", pattern=STEP_CHECKPOINT_GLOB
        )
        append_journal(journal, pending)  # after the checkpoint: the journal lists only committed steps
        pending = []
        last_checkpoint = str(path)
        emit({"event": "checkpoint", "epoch": item.epoch, "step": step, "path": last_checkpoint})

    try:
        for item in upcoming:
            waited = time.monotonic()
            prepared = producer.take(item)
            waiting_s += time.monotonic() - waited
            emit({"event": "extracted", **prepared})
            shard_dir = window / item.name
            samples = {s.sample_id: s for s in index_hidden_states([shard_dir]).samples}  # verifies each part's checksum
            rows = ids_by_row[item.shard.key]
            for planned in (p for p in steps[step:] if p.item == item.position):
                n = len(planned.batches)
                batches = (load_batch([samples[rows[r]] for r in members], config.max_seq_len).to(device) for _, members in planned.batches)
                record = {"step": planned.step, "epoch": item.epoch, "shard": item.shard.key, **trainer.step(batches, n, n)}
                step = planned.step
                tokens_seen += record["tokens"]
                history.append(record)
                pending.append(
                    {
                        "step": step,
                        "epoch": item.epoch,
                        "shard": item.shard.key,
                        "batches": [b for b, _ in planned.batches],
                        "samples": [rows[r] for _, members in planned.batches for r in members],
                        "pid": pid,
                    }
                )
                if step % config.log_every == 0 or step == len(steps):
                    emit({"event": "step", **record, "total_steps": len(steps), "elapsed_s": round(time.monotonic() - started, 2)})
                last_of_item = step == len(steps) or steps[step].item != item.position
                if last_of_item:
                    streamed.append(prepared)
                if last_of_item or step % run.checkpoint_every_steps == 0:
                    commit(item)
            # Committed: the shard's states are no longer needed, and its slot goes to the next shard.
            peak.measure()
            shutil.rmtree(shard_dir)
            fsync_dir(window)
            producer.release()
            emit({"event": "streamed", "epoch": item.epoch, "shard": item.shard.key, "window_bytes": peak.measure(), "peak_window_bytes": peak.peak})
    finally:
        producer.close()

    elapsed = time.monotonic() - started
    result = {
        "fingerprint": fingerprint,
        "checkpoint": last_checkpoint,
        "resumed_from": resumed_from,
        "init": asdict(init_report),
        "draft_config": asdict(draft.config),
        "aux_layer_ids": list(settings.aux_layer_ids),
        "tokens_per_s": tokens_seen / elapsed if elapsed > 0 and tokens_seen else 0.0,
        # Training alone, without the time spent waiting for the next shard's extraction.
        "train_tokens_per_s": tokens_seen / (elapsed - waiting_s) if elapsed > waiting_s and tokens_seen else 0.0,
        "world_size": 1,
        "schedule": asdict(schedule),
        "mode": "bounded",
        "window_shards": run.window_shards,
        "peak_window_bytes": peak.peak,
        "streamed": streamed,
        "epochs_done": config.epochs,
        "history": None,
    }
    write_json_atomic(training_dir / "history.json", {"fingerprint": fingerprint, "history": history})
    write_json_atomic(training_dir / "result.json", result)
    emit({"event": "done", "checkpoint": last_checkpoint, "tokens_per_s": result["tokens_per_s"], "peak_window_bytes": peak.peak})
    return result


def print_event(event: dict) -> None:
    print(EVENT_PREFIX + json.dumps(event, default=str), flush=True)


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
