"""The training loop, one for both hidden-state modes: set up, resume, then units of optimizer steps, checkpointed.

:func:`train` reads top to bottom, like nanoGPT's ``train.py``: the data's
facts and the schedule; the target's head and the draft; the plan; the
optimizer (a :class:`Trainer`); resuming from the last complete checkpoint of
the same run; the loop; the result. The batches come from a batch source
(:mod:`.sources`): the stored shards, or a window of shards extracted as
training consumes them (:mod:`.streamed`). The loop checkpoints at the end of
each of the source's units (an epoch; a streamed shard) and every
``checkpoint_every_steps`` steps where the source asks for it; the journal of
committed steps (``trained_batches.jsonl``) lists every batch once. Under
torchrun every process runs it, each on its share of every step's
micro-batches.

:class:`Trainer` is the one optimizer step (micro-batches in, a step record
out) with its optimizer state.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eagle3_assets.core.draft.model import Eagle3Draft
from eagle3_assets.core.settings.environment import ALLOW_CPU
from eagle3_assets.core.training.schedule import Schedule, fit_schedule, lr_lambda
from eagle3_assets.core.storage.shard_paths import HISTORY_FILE, RESULT_FILE
from eagle3_assets.core.storage.files import write_bytes_atomic, write_json_atomic
from eagle3_assets.core.target.head import TargetHead, load_head_weights
from eagle3_assets.core.training.checkpoints import (
    JOURNAL,
    append_journal,
    latest_checkpoint,
    read_journal,
    restore_checkpoint,
    run_fingerprint,
    save_checkpoint,
)
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import ANCHORS_FILE, Batch, HiddenStateIndex
from eagle3_assets.core.training.initial_weights import initial_draft
from eagle3_assets.core.training.loss import TrainingTimeTest
from eagle3_assets.core.training.losses import training_loss
from eagle3_assets.core.training.memory import free_memory_bytes, plan_micro_batch
from eagle3_assets.core.training.optimizers import build_optimizers
from eagle3_assets.core.training.sources import BatchSource, DataSize, PlannedStep, StoredShards
from eagle3_assets.core.training.tensorboard_log import open_curves
from eagle3_assets.core.draft.vocab import load_vocab_mapping

Event = dict
OnEvent = Callable[[Event], None]
# The target's logits over the draft vocabulary and its top-1 token, from a batch's final states.
DraftHead = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TrainResult:
    fingerprint: str
    history: list[dict]
    epochs_done: int
    resumed_from: str | None
    init: dict
    draft_config: dict
    aux_layer_ids: list[int]
    checkpoint: str
    tokens_per_s: float
    train_tokens_per_s: float = 0.0  # tokens/s of the training alone (bounded mode: without waiting for extraction)
    world_size: int = 1  # training processes (torchrun's WORLD_SIZE)
    schedule: dict | None = None  # what was trained with: batch_tokens, epochs, learning_rate, steps, which were fitted
    source: dict | None = None  # the batch source's record: the mode, samples, storage precisions (bounded: the window)
    memory: dict | None = None  # the planned micro-batch: the estimate against the device's free memory


class Trainer:
    """The draft's loss and optimizer: :meth:`step` makes one optimizer step over the micro-batches it is given."""

    def __init__(self, draft: Eagle3Draft, head: DraftHead, config: TrainConfig, device: torch.device, total_steps: int, distributed: bool):
        self.draft, self.head, self.config, self.device, self.distributed = draft, head, config, device, distributed
        ttt = TrainingTimeTest(
            draft, config.ttt_steps, config.step_weight,
            checkpoint_steps=config.activation_checkpointing, loss_chunk_tokens=config.loss_chunk_tokens,
            loss=config.loss, loss_parameters=config.loss_parameters(),
        ).to(device)  # fmt: skip
        self.model: nn.Module = ttt
        if distributed:
            self.model = nn.parallel.DistributedDataParallel(ttt, device_ids=[device.index] if device.type == "cuda" else None)
        self.trainable = [p for p in draft.parameters() if p.requires_grad]
        # One optimizer (AdamW), or two (Muon on the matrices, AdamW on the rest), each on the one schedule.
        self.optimizers = build_optimizers(
            draft, optimizer=config.optimizer, learning_rate=config.learning_rate, betas=config.betas,
            weight_decay=config.weight_decay, muon_weight_decay=config.muon_weight_decay,
        )  # fmt: skip
        factor = lr_lambda(total_steps, config.warmup_ratio, config.min_lr_ratio)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, factor) for optimizer in self.optimizers]
        use_bf16 = device.type == "cuda" and config.bf16_autocast
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext()
        self.micro_batches = self.tokens = 0  # this process's share over this trainer's life
        self.model.train()

    def step(self, batches: Iterable[Batch], count: int, step_micro_batches: int) -> dict:
        """One optimizer step over this process's ``count`` micro-batches of the step's ``step_micro_batches`` (all processes).

        Each micro-batch's loss is its own mean, divided by ``count``; DDP
        averages the gradients over processes. Returns the step's figures over
        every process's micro-batches.
        """
        k = self.config.ttt_steps
        totals = torch.zeros(3, k, device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for i, batch in enumerate(batches):
            tokens += batch.num_tokens
            self.micro_batches += 1
            target_logits, target_top = self.head(batch.final)
            sync = self.model.no_sync() if self.distributed and i < count - 1 else nullcontext()
            with sync:
                with self.autocast:
                    loss, stats = self.model(batch.aux, batch.input_ids, batch.loss_mask, target_logits, target_top, batch.documents, batch.anchors)
                (loss / count).backward()
            loss_sum += loss.detach()
            totals += stats
        self.tokens += tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        # Per-step figures over every process's micro-batches.
        summary = torch.cat([loss_sum.view(1), totals[0], totals[1:].flatten(), torch.tensor([float(tokens)], device=self.device)])
        if self.distributed:
            dist.all_reduce(summary)
        n = step_micro_batches
        correct, counts = summary[1 + k : 1 + 2 * k], summary[1 + 2 * k : 1 + 3 * k]
        return {
            "loss": float(summary[0]) / n,
            "step_losses": [round(float(x) / n, 6) for x in summary[1 : 1 + k]],
            "accuracy": [round(float(c) / max(float(m), 1.0), 6) for c, m in zip(correct, counts)],
            "lr": self.schedulers[0].get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "tokens": int(summary[-1]),
        }


def fitted_config(
    config: TrainConfig, *, total_tokens: int, supervised_tokens: int, hidden_size: int, steps_per_epoch_for: Callable[[int], int], world: int = 1
) -> tuple[TrainConfig, Schedule]:
    """``config`` with every unset schedule setting fitted to the data (the same data always gives the same fit)."""
    schedule = fit_schedule(
        total_tokens=total_tokens,
        supervised_tokens=supervised_tokens,
        hidden_size=hidden_size,
        steps_per_epoch_for=steps_per_epoch_for,
        world_size=world,
        grad_accumulation=config.grad_accumulation,
        batch_tokens=config.batch_tokens,
        epochs=config.epochs,
        learning_rate=config.learning_rate,
    )
    resolved = config.model_copy(update={"batch_tokens": schedule.batch_tokens, "epochs": schedule.epochs, "learning_rate": schedule.learning_rate})
    return resolved, schedule


def resolve_schedule(config: TrainConfig, source: BatchSource, world: int = 1) -> tuple[TrainConfig, Schedule, HiddenStateIndex, DataSize]:
    """:func:`fitted_config` for a source's data: the fitted config, the schedule, the states' facts and the data's size."""
    index, size = source.describe(config)
    fitted, schedule = fitted_config(
        config,
        total_tokens=size.tokens,
        supervised_tokens=size.supervised_tokens,
        hidden_size=index.hidden_size,
        steps_per_epoch_for=lambda batch_tokens: source.steps_per_epoch(config.model_copy(update={"batch_tokens": batch_tokens}), world),
        world=world,
    )
    return fitted, schedule, index, size


def train(config: TrainConfig, source: BatchSource | None = None, on_event: OnEvent | None = None) -> TrainResult:
    """Train (or resume) on ``source`` (default: the stored shards of ``config.hidden_state_dirs``). Under torchrun, every process runs this."""
    config.validate()
    source = source or StoredShards(config.hidden_state_dirs)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = pick_device()
    threads = torch.get_num_threads()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    elif device.type == "cpu":
        # CPU training is for tiny targets and the tests: a tiny draft whose matrices are too small to split
        # over threads, which then mostly wait on each other.
        torch.set_num_threads(1)
    if distributed and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        return _train(config, source, on_event or (lambda event: None), device, distributed)
    finally:
        source.stop()
        torch.set_num_threads(threads)
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TrainConfig, source: BatchSource, emit: OnEvent, device: torch.device, distributed: bool) -> TrainResult:
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    # Only rank 0 reports progress; every rank reports its own share once at the end (``rank_done``),
    # so that the run log shows that each process really trained.
    emit_own = emit
    if rank:
        emit = lambda event: None  # noqa: E731

    # -- the data's facts and the schedule, before anything is loaded
    config, schedule, index, size = resolve_schedule(config, source, world)
    if training_loss(config.loss).anchored and not any(s.anchors_file for s in index.samples):
        raise ValueError(
            f"loss {config.loss!r} reads where the server rejected the draft, and no hidden-state shard has anchors "
            f"({ANCHORS_FILE}: a refinement round writes them beside its on-policy shards)"
        )
    emit({"event": "schedule", "description": schedule.describe(), "warnings": schedule.warnings, **asdict(schedule)})

    # -- the target's head and the draft
    mapping = load_vocab_mapping(Path(config.vocab_mapping))
    if mapping.target_vocab_size != index.vocab_size:
        raise ValueError(f"vocab mapping covers {mapping.target_vocab_size} target ids, the hidden states' target has {index.vocab_size}")
    target = load_head_weights(config.target_path)
    if target["lm_head"].shape[0] != index.vocab_size or target["lm_head"].shape[1] != index.hidden_size:
        raise ValueError(f"target {config.target_path}: lm_head {tuple(target['lm_head'].shape)} does not fit the hidden states")
    draft, init_report = initial_draft(config, index, mapping, target)
    draft.embed_tokens.weight.requires_grad_(False)  # the target's embedding: frozen, shared by vLLM
    if config.freeze_lm_head:
        if init_report.lm_head_rows_new:
            raise ValueError(
                f"freeze_lm_head: {init_report.lm_head_rows_new} of the draft vocabulary's lm_head rows are new to {config.init_from} "
                "(random weights) and a frozen head would never learn them; train the head or use the starting draft's vocabulary map"
            )
        draft.lm_head.weight.requires_grad_(False)  # no gradient, so no AdamW state either (the Trainer takes requires_grad ones)
    fingerprint = run_fingerprint(config, index)
    training_dir = Path(config.training_dir)
    checkpoints, journal = training_dir / "checkpoints", training_dir / JOURNAL
    resume = latest_checkpoint(checkpoints, fingerprint)

    # -- the micro-batch that fits the device, planned from the shapes before anything is on it
    recorded = json.loads((resume / "state.json").read_text()).get("memory") if resume else None
    free, total = free_memory_bytes(device)
    if distributed:  # every process must plan the same steps: the one with the least free memory decides
        least = torch.tensor([free], dtype=torch.int64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        free = int(least.item())
    memory = plan_micro_batch(
        draft.config, config, longest=size.longest, device=device, bf16=device.type == "cuda" and config.bf16_autocast,
        recorded={"batch_tokens": recorded["batch_tokens"], "grad_accumulation": recorded["grad_accumulation"], "split": recorded["split"]}
        if recorded else None,
        free=(free, total),
    )  # fmt: skip
    config = config.model_copy(update={"batch_tokens": memory.batch_tokens, "grad_accumulation": memory.grad_accumulation})
    emit({"event": "memory", "description": memory.describe(), **memory.as_dict()})

    # -- the plan: every optimizer step of every epoch, up front
    plan = source.plan(config, world)
    draft.to(device)
    target_head, draft_to_target = TargetHead.from_weights(target).to(device), mapping.draft_to_target.to(device)

    def head(final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = config.target_head_chunk_tokens or final.shape[0] * final.shape[1]
        return target_head.draft_logits(final, index.final_state, draft_to_target, chunk=chunk)

    # -- the optimizer
    trainer = Trainer(draft, head, config, device, len(plan), distributed)

    # -- resume from the last complete checkpoint of this very run
    if rank == 0:
        training_dir.mkdir(parents=True, exist_ok=True)
        if checkpoints.is_dir():
            for partial in checkpoints.glob(".*.partial"):  # left by a crash mid-checkpoint: never resumed from
                shutil.rmtree(partial, ignore_errors=True)
    step, history, saved, resumed_from = 0, [], {}, None
    if resume is not None:
        state = restore_checkpoint(resume, draft, trainer.optimizers, trainer.schedulers)
        step, history, saved, resumed_from = state["step"], state["history"], state.get("source", {}), str(resume)
        if rank == 0:
            # The checkpoint is durable, its journal lines perhaps not yet (a kill between the two): append what is missing.
            done = max((r["step"] for r in read_journal(journal)), default=0)
            append_journal(journal, [r for r in state["journal"] if r["step"] > done])
        after = plan[step - 1].batches[-1][0] if step else "the start"
        emit({"event": "resumed", "checkpoint": resumed_from, "epoch": state["epoch"], "step": step, "after_batch": after})
    elif rank == 0:
        write_bytes_atomic(journal, b"")  # a journal of another run (or of none) is not this run's
    emit(
        {
            "event": "start",
            "mode": source.mode,
            "samples": size.samples,
            "tokens": size.tokens,
            "world_size": world,
            "device": str(device),
            "total_steps": len(plan),
            "init": asdict(init_report),
            "fingerprint": fingerprint,
            **source.start_fields(),
        }
    )
    source.start(plan, step, saved, emit)
    curves = open_curves(training_dir, device, rank, step)  # TensorBoard's event files, where it is installed

    # -- the loop: unit after unit (an epoch of stored shards, or one streamed shard), a step at a time
    started, tokens_seen, waiting_s = time.monotonic(), 0, 0.0
    pending: list[dict] = []  # journal lines of steps not yet in a checkpoint
    last_checkpoint = resumed_from or ""
    every = source.checkpoint_every_steps

    def commit(planned: PlannedStep) -> None:
        nonlocal last_checkpoint, pending
        state = {
            "fingerprint": fingerprint,
            "step": planned.step,
            "epoch": planned.epoch,
            "batch": planned.batches[-1][0],
            "history": history,
            "journal": pending,
            "source": source.state(),
            "mode": source.mode,
            "memory": memory.as_dict(),
            "draft_config": asdict(draft.config),
            "init": asdict(init_report),
            "config": config.to_dict(),
        }
        if rank == 0:
            path = save_checkpoint(checkpoints, planned.step, draft, trainer.optimizers, trainer.schedulers, state, config.keep_checkpoints)
            append_journal(journal, pending)  # after the checkpoint: the journal lists only committed steps
            last_checkpoint = str(path)
            emit({"event": "checkpoint", "epoch": planned.epoch, "step": planned.step, "path": last_checkpoint})
            if curves:
                curves.flush()  # the curves reach the file with each checkpoint, not only at the end
        pending = []
        if distributed:
            dist.barrier()

    units = list(dict.fromkeys(p.unit for p in plan[step:]))
    for unit in units:
        waited = time.monotonic()
        states = source.open(unit, emit)
        waiting_s += time.monotonic() - waited
        labels = source.unit_fields(unit)
        unit_steps = [p for p in plan[step:] if p.unit == unit]
        for planned in unit_steps:
            mine = planned.batches[rank::world]
            batches = (states.load(members).to(device) for _, members in mine)
            record = {"step": planned.step, "epoch": planned.epoch, **labels, **trainer.step(batches, len(mine), len(planned.batches))}
            step = planned.step
            tokens_seen += record["tokens"]
            history.append(record)
            if curves:
                curves.step(record)
            pending.append(
                {
                    "step": step,
                    "epoch": planned.epoch,
                    **labels,
                    "batches": [b for b, _ in planned.batches],
                    "samples": [s for _, members in planned.batches for s in states.sample_ids(members)],
                    "pid": os.getpid(),
                }
            )
            if step % config.log_every == 0 or step == len(plan):
                emit({"event": "step", **record, "total_steps": len(plan), "elapsed_s": round(time.monotonic() - started, 2)})
            if planned is unit_steps[-1]:
                source.finish(unit)
                commit(planned)
            elif every and step % every == 0:
                commit(planned)
        source.close(unit, emit)

    # -- the result
    elapsed = time.monotonic() - started
    if curves:
        curves.close()
    if distributed:
        emit_own({"event": "rank_done", "rank": rank, "world_size": world, "micro_batches": trainer.micro_batches, "tokens": trainer.tokens})
        dist.barrier()  # the ranks' lines come before rank 0's "done"
    result = TrainResult(
        fingerprint=fingerprint,
        history=history,
        epochs_done=config.epochs,
        resumed_from=resumed_from,
        init=asdict(init_report),
        draft_config=asdict(draft.config),
        aux_layer_ids=index.aux_layer_ids,
        checkpoint=last_checkpoint,
        tokens_per_s=tokens_seen / elapsed if elapsed > 0 and tokens_seen else 0.0,
        # Training alone, without the time spent waiting for the next unit's states (bounded mode's extraction).
        train_tokens_per_s=tokens_seen / (elapsed - waiting_s) if elapsed > waiting_s and tokens_seen else 0.0,
        world_size=world,
        schedule=asdict(schedule),
        source=source.report(),
        memory=memory.as_dict(),
    )
    if rank == 0:
        write_json_atomic(training_dir / HISTORY_FILE, {"fingerprint": fingerprint, "history": history})
        write_json_atomic(training_dir / RESULT_FILE, asdict(result) | {"history": None})
        emit({"event": "done", "checkpoint": last_checkpoint, "tokens_per_s": result.tokens_per_s, **source.done_fields()})
    if distributed:
        dist.barrier()
    return result


def pick_device() -> torch.device:
    """This process's device: its GPU under torchrun (``LOCAL_RANK``), else the CPU where ``EAGLE3_ALLOW_CPU`` allows it."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # before NCCL starts: one GPU per process
        return device
    if not ALLOW_CPU.get():
        raise RuntimeError("no CUDA device on this host and EAGLE3_ALLOW_CPU is not 1: refusing to train on CPU")
    return torch.device("cpu")
