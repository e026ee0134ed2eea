"""Train speculators' EAGLE-3 draft on the platform's stored hidden states (runs in the peer environment, .peer-venv).

``bench/peer_acceptance.py`` runs this as a subprocess, once per seed and
setting; it can also be run by hand. It drives speculators 0.9.0's own pieces:
its draft (``Eagle3DraftModel.from_training_args`` with the decoder config its
CLI builds from the verifier), its packing sampler and collate function
(documents packed into one sequence with document ids), its ``shift_batch``
alignment, its losses and its ``Trainer`` (AdamW, scheduler, gradient clip
1.0, per-epoch checkpoints saved in bf16), and writes the checkpoint it saves:
speculators' format, which vLLM 0.32 serves directly.

What it takes from the platform: the hidden-state shards (read by
``bench/peer/alignment.py``), the vocabulary map (``d2t``/``t2d``, so both
drafts share the draft vocabulary), the layer ids of the sidecars and the
target directory (the verifier: embedding, final norm, head). The final state
is normed by speculators only when the sidecar says ``pre_norm``.

``--settings defaults``: speculators' EAGLE-3 training defaults
(``norm_before_fc``, ``norm_output`` and ``norm_before_residual`` on, KL loss
with every unrolled step weighted 1, frozen lm_head, sliding-window attention
of 2,048 in the draft, weight decay 0.01); ``--settings plain``: the same with
the four norm flags off, plain EAGLE-3 as vLLM's native form has it. The
recipe (epochs, learning rate, warm-up, schedule, depth, tokens per packed
micro-batch, AdamW betas) is given by the caller: the platform's; or, with
``--recipe speculators``, speculators' own training defaults (Muon at lr 1e-3,
linear schedule, 1% warm-up, 8,192 tokens per packed batch: ``SPECULATORS_RECIPE``);
``--recipe speculators-optimizer``: its optimizer and schedule on the caller's
batches and epochs (the optimizer apart from the step count its batch size gives).

On a CPU: eager attention and speculators' eager losses (FlexAttention's
backward and the fused losses need CUDA); its trainer is run on the CPU with
two shims (:func:`cpu_shims`), and in float32 (its autocast is CUDA's, so off
here, as the platform's CPU training is float32 too). On CUDA:
``--device cuda`` uses FlexAttention and the fused losses, bf16 autocast.

    .peer-venv/bin/python bench/peer/train_speculators.py --hidden-states data/hidden_states/shard-00000 \\
        --vocab-mapping data/vocab_mapping/vocab_mapping.safetensors --out /tmp/peer-draft --seed 0
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# speculators' EAGLE-3 draft flags: its CLI's defaults, and plain EAGLE-3 (vLLM's native form: no extra norm).
SETTINGS = {
    "defaults": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True, "fc_norm": False},
    "plain": {"norm_before_fc": False, "norm_output": False, "norm_before_residual": False, "fc_norm": False},
}
# speculators' CLI defaults this script keeps (speculators/train/config/schema.py, 0.9.0).
SPECULATORS_DEFAULTS = {"weight_decay": 0.01, "sliding_window": 2048, "loss_fn": "kl_div", "ttt_step_loss_decay": 1.0, "grad_clip": 1.0}
# ``--recipe speculators``: the training recipe speculators' CLI runs when given none (schema.py, 0.9.0): Muon on the
# 2D weights at --lr (its CLI sets muon_lr to lr; the Trainer's own 0.02 is never what the CLI runs), AdamW with
# torch's betas on the rest, a linear schedule warmed up over 1% of its steps (warmup_ratio None), 20 epochs,
# 8,192 tokens per packed batch, 3 unrolled steps.
SPECULATORS_RECIPE = {
    "optimizer": "muon", "lr": 1e-3, "epochs": 20, "scheduler": "linear", "warmup_ratio": None, "total_seq_len": 8192,
    "ttt_steps": 3, "betas": None,
}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-states", nargs="+", required=True, help="hidden_states shard directories (each with metadata.json)")
    p.add_argument("--vocab-mapping", required=True, help="the platform's vocab_mapping.safetensors (d2t, t2d)")
    p.add_argument("--target", help="the target's HF directory (default: the sidecars' target_path)")
    p.add_argument("--out", required=True, help="where the trained draft (speculators' format) is written")
    p.add_argument("--settings", choices=sorted(SETTINGS), default="defaults")
    p.add_argument(
        "--recipe", choices=["caller", "speculators", "speculators-optimizer"], default="caller",
        help="caller: the flags below (the platform's recipe); speculators: its CLI's own training defaults, the flags ignored; "
        "speculators-optimizer: its optimizer and schedule, on the caller's --total-seq-len and --epochs",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--scheduler", choices=["cosine", "linear", "none"], default="cosine")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--total-seq-len", type=int, default=1024, help="tokens per packed micro-batch")
    p.add_argument("--max-seq-len", type=int, default=512, help="longer samples are cut to this many tokens (as the platform's training)")
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95], help="AdamW betas")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="speculators' own default is muon; the recipe's is AdamW")
    p.add_argument("--weight-decay", type=float, default=SPECULATORS_DEFAULTS["weight_decay"])
    p.add_argument("--device", default="cpu", help="cpu (eager attention and losses) or cuda (FlexAttention, fused losses, bf16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    p.add_argument(
        "--sliding-window", type=int, default=SPECULATORS_DEFAULTS["sliding_window"],
        help="the draft's attention window (speculators' default 2,048; the caller's recipe where it sets one)",
    )  # fmt: skip
    return p


def cpu_shims() -> None:
    """Let speculators' CUDA-minded ``Trainer`` run on a CPU without changing what it computes.

    - it moves the model and batches to ``get_local_rank()`` (0: cuda:0): the CPU instead;
    - its step timer calls ``torch.accelerator.synchronize()``, which raises without an accelerator:
      there is nothing to wait for on a CPU.
    """
    import torch
    import speculators.train.trainer as trainer_module

    trainer_module.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None


class StoredStatesDataset:
    """speculators' dataset contract over the platform's shards: raw (unshifted) samples, ``approx_lengths``."""

    def __init__(self, samples, max_len: int):
        import alignment

        self._alignment = alignment
        self.samples, self.max_len = samples, max_len
        self.approx_lengths = [min(s.length, max_len) for s in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self._alignment.with_lengths(self._alignment.read_sample(self.samples[index], self.max_len))


def check_alignment(dataset: StoredStatesDataset, shift_batch) -> None:
    """speculators' ``shift_batch`` and ``alignment.speculators_layout`` must agree on real samples (one of each length class)."""
    import torch
    import alignment

    for index in sorted({0, len(dataset) // 2, len(dataset) - 1}):
        raw = dataset[index]
        theirs, ours = shift_batch(dict(raw)), alignment.speculators_layout(dict(raw))
        for key in theirs:
            if not torch.equal(theirs[key], ours[key]):
                sys.exit(f"alignment: speculators' shift_batch and bench/peer/alignment.py differ on {key!r} (sample {index})")


def resolved_recipe(args: argparse.Namespace) -> dict:
    """The recipe this run trains with: the caller's flags, or speculators' own defaults in their place."""
    if args.recipe == "speculators":
        return dict(SPECULATORS_RECIPE)
    if args.recipe == "speculators-optimizer":  # the optimizer alone: as many steps over the same batches as the caller's
        return {**SPECULATORS_RECIPE, "total_seq_len": args.total_seq_len, "epochs": args.epochs}
    return {
        "optimizer": args.optimizer, "lr": args.lr, "epochs": args.epochs, "scheduler": args.scheduler, "warmup_ratio": args.warmup_ratio,
        "total_seq_len": args.total_seq_len, "ttt_steps": args.ttt_steps, "betas": list(args.betas),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    recipe = resolved_recipe(args)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    sys.path.insert(0, str(HERE))
    import torch
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    import alignment
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config, set_seed
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.trainer import Trainer, TrainerConfig

    on_cuda = args.device.startswith("cuda")
    if not on_cuda:
        torch.set_num_threads(args.threads)
        cpu_shims()
    out = Path(args.out)
    work = out.with_name(out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: speculators' trainer would otherwise resume from what it finds
    set_seed(args.seed)  # first, as speculators' CLI: the draft's initial weights follow from it

    stored = alignment.index_shards(args.hidden_states)
    target = args.target or stored.target_path
    mapping = load_file(args.vocab_mapping)
    d2t, t2d = mapping["d2t"].to(torch.long), mapping["t2d"].to(torch.bool)

    flags = SETTINGS[args.settings]
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=target, num_layers=1, draft_arch="llama", hidden_act=None,
        sliding_window=args.sliding_window, full_attention_indices=[],
    )  # fmt: skip
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=int(d2t.numel()), ttt_steps=recipe["ttt_steps"],
        verifier_name_or_path=target, target_layer_ids=stored.aux_layer_ids, embed_requires_grad=False,
        draft_attn_impl="simple_flex_attention" if on_cuda else "eager", **flags,
    )  # fmt: skip
    if not alignment.verifier_norm_needed(stored.final_state):
        model.verifier_norm = torch.nn.Identity()  # the stored final state is already after the target's final norm

    dataset = StoredStatesDataset(stored.samples, args.max_seq_len)
    check_alignment(dataset, shift_batch)
    states_dtype = torch.bfloat16 if on_cuda else torch.float32
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=recipe["total_seq_len"], lengths=dataset.approx_lengths, num_replicas=1, rank=0, seed=args.seed
    )
    loader = DataLoader(
        dataset, batch_sampler=sampler, num_workers=0,
        collate_fn=CollateFn(recipe["total_seq_len"], stored.hidden_size, num_target_layers=alignment.AUX_STATES, dtype=states_dtype, preprocess=shift_batch),
    )  # fmt: skip
    call_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=SPECULATORS_DEFAULTS["loss_fn"], loss_implementation="fused" if on_cuda else "eager",
        ttt_steps=recipe["ttt_steps"], ttt_step_loss_decay=SPECULATORS_DEFAULTS["ttt_step_loss_decay"],
    )  # fmt: skip
    config = TrainerConfig(
        lr=recipe["lr"], muon_lr=recipe["lr"], num_epochs=recipe["epochs"], save_path=str(work / "checkpoints"), resume_from_checkpoint=False,
        train_call_kwargs=call_kwargs, val_call_kwargs=call_kwargs, optimizer=recipe["optimizer"], weight_decay=args.weight_decay,
        scheduler_type=recipe["scheduler"], scheduler_warmup_ratio=recipe["warmup_ratio"], checkpoint_freq=recipe["epochs"],
        hidden_states_dtype=states_dtype, log_freq=1,
    )  # fmt: skip
    metrics = MetricsLog(total_steps=len(loader) * recipe["epochs"])
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.setLevel(logging.INFO)
    metric_logger.addHandler(metrics)
    trainer = Trainer(model, config, loader, None)
    for optimizer in trainer.optimizers:  # the recipe's AdamW betas (speculators builds AdamW with torch's defaults)
        if recipe["betas"] is not None and isinstance(optimizer, torch.optim.AdamW):
            for group in optimizer.param_groups:
                group["betas"] = tuple(recipe["betas"])
    started = time.monotonic()
    trainer.run_training()
    seconds = time.monotonic() - started

    saved = work / "checkpoints" / str(recipe["epochs"] - 1)
    if not (saved / "model.safetensors").is_file():
        sys.exit(f"speculators' trainer left no checkpoint at {saved}")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(saved / name, staging / name)
    facts = {
        "trainer": "speculators 0.9.0", "settings": args.settings, "flags": flags, "seed": args.seed, "train_s": round(seconds, 1),
        "optimizer_steps": trainer.global_step, "recipe_from": args.recipe, **recipe,
        "betas": recipe["betas"] or [0.9, 0.999], "muon_lr": recipe["lr"] if recipe["optimizer"] == "muon" else None, "weight_decay": args.weight_decay, "final_state": stored.final_state,
        "verifier_norm_applied": alignment.verifier_norm_needed(stored.final_state), "samples": len(dataset),
        "device": args.device, "attention": "simple_flex_attention" if on_cuda else "eager", **{k: v for k, v in SPECULATORS_DEFAULTS.items() if k != "weight_decay"},
        "last_steps": metrics.last(5),
    }  # fmt: skip
    (staging / "peer_run.json").write_text(json.dumps(facts, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"draft": str(out), **facts}))


class MetricsLog(logging.Handler):
    """speculators' per-step training metrics (its ``speculators.metrics`` logger), kept for the run's record."""

    def __init__(self, total_steps: int, every: int = 10):
        super().__init__()
        self.steps: list[dict] = []
        self.total_steps, self.every, self.started = total_steps, every, time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and "train" in record.msg:
            train = record.msg["train"]
            self.steps.append({"step": record.msg.get("global_step"), **{k: round(float(v), 4) for k, v in train.items() if k.startswith(("loss", "full_acc"))}})
            done = len(self.steps)
            if done % self.every == 0 or done == self.total_steps:  # long runs show progress (the bench's log of this seed)
                loss = self.steps[-1].get("loss", float("nan"))
                print(f"speculators: step {done}/{self.total_steps} loss {loss:.4f} ({time.monotonic() - self.started:.0f}s)", file=sys.stderr, flush=True)

    def last(self, n: int) -> list[dict]:
        return self.steps[-n:]


if __name__ == "__main__":
    main()
