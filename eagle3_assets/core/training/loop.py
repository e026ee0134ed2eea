"""The training loop: set up, resume, then epochs of optimizer steps, a checkpoint after each.

:func:`train` reads top to bottom, like nanoGPT's ``train.py``: the data, the
target's head and the draft; the schedule; the optimizer (a :class:`Trainer`);
resuming from the last complete checkpoint of the same run; the loop; the
result. Under torchrun every process runs it, each on its share of every
step's micro-batches.

:class:`Trainer` is the one optimizer step (micro-batches in, a step record
out) with its optimizer state, usable by any loop that brings its own batches
and checkpoint state (:func:`~eagle3_assets.core.training.checkpoints.restore_checkpoint`).
"""

from __future__ import annotations

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

from eagle3_assets.core.draft_model import Eagle3Draft
from eagle3_assets.core.environment import ALLOW_CPU
from eagle3_assets.core.schedule import Schedule, fit_schedule, lr_lambda
from eagle3_assets.core.shard_paths import HISTORY_FILE, RESULT_FILE
from eagle3_assets.core.storage import write_json_atomic
from eagle3_assets.core.target import TargetHead, load_head_weights
from eagle3_assets.core.training.checkpoints import latest_checkpoint, restore_checkpoint, run_fingerprint, save_checkpoint
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import Batch, HiddenStateIndex, epoch_steps, index_hidden_states, load_batch, supervised_token_count
from eagle3_assets.core.training.initial_weights import initial_draft
from eagle3_assets.core.training.loss import TrainingTimeTest
from eagle3_assets.core.vocab import load_vocab_mapping

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
    world_size: int = 1  # training processes (torchrun's WORLD_SIZE)
    schedule: dict | None = None  # what was trained with: batch_tokens, epochs, learning_rate, steps, which were fitted


class Trainer:
    """The draft's loss and optimizer: :meth:`step` makes one optimizer step over the micro-batches it is given."""

    def __init__(self, draft: Eagle3Draft, head: DraftHead, config: TrainConfig, device: torch.device, total_steps: int, distributed: bool):
        self.draft, self.head, self.config, self.device, self.distributed = draft, head, config, device, distributed
        ttt = TrainingTimeTest(draft, config.ttt_steps, config.step_weight).to(device)
        self.model: nn.Module = ttt
        if distributed:
            self.model = nn.parallel.DistributedDataParallel(ttt, device_ids=[device.index] if device.type == "cuda" else None)
        self.trainable = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(total_steps, config.warmup_ratio, config.min_lr_ratio))
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
                    loss, stats = self.model(batch.aux, batch.input_ids, batch.loss_mask, target_logits, target_top)
                (loss / count).backward()
            loss_sum += loss.detach()
            totals += stats
        self.tokens += tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

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
            "lr": self.scheduler.get_last_lr()[0],
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


def resolve_schedule(config: TrainConfig, index: HiddenStateIndex, lengths: list[int], world: int) -> tuple[TrainConfig, Schedule]:
    """:func:`fitted_config` for the stored hidden states of ``index``."""
    return fitted_config(
        config,
        total_tokens=sum(lengths),
        supervised_tokens=supervised_token_count(index, config.max_seq_len),
        hidden_size=index.hidden_size,
        steps_per_epoch_for=lambda batch_tokens: len(epoch_steps(lengths, config.model_copy(update={"batch_tokens": batch_tokens}), world, 0)),
        world=world,
    )


def train(config: TrainConfig, on_event: OnEvent | None = None) -> TrainResult:
    """Train (or resume) and checkpoint every epoch. Under torchrun, every process runs this."""
    config.validate()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = _pick_device()
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
        return _train(config, on_event or (lambda event: None), device, distributed)
    finally:
        torch.set_num_threads(threads)
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TrainConfig, emit: OnEvent, device: torch.device, distributed: bool) -> TrainResult:
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    # Only rank 0 reports progress; every rank reports its own share once at the end (``rank_done``),
    # so that the run log shows that each process really trained.
    emit_own = emit
    if rank:
        emit = lambda event: None  # noqa: E731

    # -- the data, the target's head, the draft
    index = index_hidden_states(config.hidden_state_dirs)
    mapping = load_vocab_mapping(Path(config.vocab_mapping))
    if mapping.target_vocab_size != index.vocab_size:
        raise ValueError(f"vocab mapping covers {mapping.target_vocab_size} target ids, the hidden states' target has {index.vocab_size}")
    target = load_head_weights(config.target_path)
    if target["lm_head"].shape[0] != index.vocab_size or target["lm_head"].shape[1] != index.hidden_size:
        raise ValueError(f"target {config.target_path}: lm_head {tuple(target['lm_head'].shape)} does not fit the hidden states")
    draft, init_report = initial_draft(config, index, mapping, target)
    draft.embed_tokens.weight.requires_grad_(False)  # the target's embedding: frozen, shared by vLLM
    draft.to(device)
    target_head, draft_to_target = TargetHead.from_weights(target).to(device), mapping.draft_to_target.to(device)
    head = lambda final: target_head.draft_logits(final, index.final_state, draft_to_target)  # noqa: E731

    # -- the schedule: every epoch's optimizer steps, planned up front
    lengths = [min(s.length, config.max_seq_len) for s in index.samples]
    config, schedule = resolve_schedule(config, index, lengths, world)
    emit({"event": "schedule", "description": schedule.describe(), "warnings": schedule.warnings, **asdict(schedule)})
    plans = [epoch_steps(lengths, config, world, epoch) for epoch in range(config.epochs)]
    total_steps = sum(len(p) for p in plans)

    # -- the optimizer
    trainer = Trainer(draft, head, config, device, total_steps, distributed)

    # -- resume from the last complete checkpoint of this very run
    fingerprint = run_fingerprint(config, index)
    training_dir = Path(config.training_dir)
    checkpoints = training_dir / "checkpoints"
    if rank == 0 and checkpoints.is_dir():
        for partial in checkpoints.glob(".*.partial"):  # left by a crash mid-checkpoint: never resumed from
            shutil.rmtree(partial, ignore_errors=True)
    start_epoch, step, history, resumed_from = 0, 0, [], None
    resume = latest_checkpoint(checkpoints, fingerprint)
    if resume is not None:
        state = restore_checkpoint(resume, draft, trainer.optimizer, trainer.scheduler)
        start_epoch, step, history, resumed_from = state["epoch"], state["step"], state["history"], str(resume)
        emit({"event": "resumed", "checkpoint": str(resume), "epoch": start_epoch, "step": step})
    emit(
        {
            "event": "start",
            "samples": len(index.samples),
            "tokens": sum(lengths),
            "world_size": world,
            "device": str(device),
            "total_steps": total_steps,
            "init": asdict(init_report),
            "fingerprint": fingerprint,
        }
    )

    # -- the loop
    started, tokens_seen = time.monotonic(), 0
    last_checkpoint = str(resume) if resume else ""
    for epoch in range(start_epoch, config.epochs):
        for micro_batches in plans[epoch]:
            mine = micro_batches[rank::world]
            batches = (load_batch([index.samples[j] for j in members], config.max_seq_len).to(device) for members in mine)
            record = trainer.step(batches, len(mine), len(micro_batches))
            step += 1
            tokens_seen += record["tokens"]
            history.append({"step": step, "epoch": epoch + 1, **record})
            if step % config.log_every == 0 or step == total_steps:
                emit({"event": "step", **history[-1], "total_steps": total_steps, "elapsed_s": round(time.monotonic() - started, 2)})

        state = {
            "fingerprint": fingerprint,
            "epoch": epoch + 1,
            "step": step,
            "history": history,
            "draft_config": asdict(draft.config),
            "init": asdict(init_report),
            "config": config.to_dict(),
        }
        if rank == 0:
            saved = save_checkpoint(checkpoints, epoch + 1, draft, trainer.optimizer, trainer.scheduler, state, config.keep_checkpoints)
            last_checkpoint = str(saved)
            emit({"event": "checkpoint", "epoch": epoch + 1, "step": step, "path": last_checkpoint})
        if distributed:
            dist.barrier()

    # -- the result
    elapsed = time.monotonic() - started
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
        world_size=world,
        schedule=asdict(schedule),
    )
    if rank == 0:
        write_json_atomic(training_dir / HISTORY_FILE, {"fingerprint": fingerprint, "history": history})
        write_json_atomic(training_dir / RESULT_FILE, asdict(result) | {"history": None})
        emit({"event": "done", "checkpoint": last_checkpoint, "tokens_per_s": result.tokens_per_s})
    if distributed:
        dist.barrier()
    return result


def _pick_device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # before NCCL starts: one GPU per process
        return device
    if not ALLOW_CPU.get():
        raise RuntimeError("no CUDA device on this host and EAGLE3_ALLOW_CPU is not 1: refusing to train on CPU")
    return torch.device("cpu")
