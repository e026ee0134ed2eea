"""Training curves in TensorBoard: the figures each optimizer step already has, as event files.

ML engineers look at TensorBoard (speculators logs there too), so the loop writes, per step: the loss and each
position's loss, accuracy per position, the learning rate, the gradient norm, tokens per second and peak memory,
under ``<training_dir>/tensorboard`` (``draft_checkpoint/training/tensorboard`` of the data directory; ``make
tensorboard`` opens it). The UI's text plot stays as it is.

An optional extra (``pip install -e '.[tensorboard]'``; the ``test`` extra has it too): on whenever the
``tensorboard`` package is installed, off (and never imported) where it is not. The figures are Python floats the
step already computed: writing them adds no device sync; the writer itself is TensorBoard's, which appends to the
event file from a thread of its own.
"""

from __future__ import annotations

import importlib.util
import resource
import sys
import time
from pathlib import Path

import torch

TENSORBOARD_DIR = "tensorboard"  # under the run's training_dir


def tensorboard_installed() -> bool:
    """Whether the optional ``tensorboard`` package is there, without importing it."""
    return importlib.util.find_spec("tensorboard") is not None


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory so far: the CUDA allocator's peak on a GPU (a host-side counter, no sync), else the
    process's peak resident set (the CPU holds the weights, activations and optimizer state there)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class Curves:
    """The run's TensorBoard writer (rank 0 only); :meth:`step` after each optimizer step, :meth:`close` at the end."""

    def __init__(self, log_dir: Path, device: torch.device, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: only imported here

        self.log_dir = Path(log_dir)
        self.device = device
        # A resumed run rewrites the steps after its checkpoint: TensorBoard drops the earlier attempt's (purge_step).
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=first_step + 1 if first_step else None)
        self.last = time.monotonic()

    def step(self, record: dict) -> None:
        """The step's figures (the loop's history record) at its global step."""
        now = time.monotonic()
        seconds, self.last = now - self.last, now
        step, add = record["step"], self.writer.add_scalar
        add("train/loss", record["loss"], step)
        for i, (loss, accuracy) in enumerate(zip(record["step_losses"], record["accuracy"]), start=1):
            add(f"loss/position_{i}", loss, step)
            add(f"accuracy/position_{i}", accuracy, step)
        add("train/learning_rate", record["lr"], step)
        add("train/grad_norm", record["grad_norm"], step)
        if seconds > 0:
            add("throughput/tokens_per_s", record["tokens"] / seconds, step)  # the step's wall time, its data waits included
        add("memory/peak_gib", peak_memory_bytes(self.device) / 2**30, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_curves(training_dir: Path | str, device: torch.device, rank: int, first_step: int) -> Curves | None:
    """The writer of this process, or None: another rank's, or where tensorboard is not installed."""
    if rank != 0 or not tensorboard_installed():
        return None
    return Curves(Path(training_dir) / TENSORBOARD_DIR, device, first_step)
