"""Train an EAGLE-3 draft on stored target hidden states ("training-time test").

Read top to bottom: the configuration; the hidden-state shards as an index of
samples; token-budget batches; the target's head (its final norm and
``lm_head``, restricted to the draft vocabulary); the unrolled loss; the
draft's initial weights (from scratch, or an existing draft with its
``lm_head`` rows remapped by target id); atomic per-epoch checkpoints; the
loop; and the launcher that runs it in this process or under ``torchrun``.

Why training-time test: at inference the draft's second and later tokens are
conditioned on its *own* previous state, not the target's. Training only on
the target's states teaches a draft that falls apart after one token, so the
draft is unrolled ``ttt_steps`` times on its own outputs and step i's loss is
weighted ``step_weight ** i``.

The batch plan of an epoch is a pure function of (seed, epoch), and a
micro-batch's loss is its own mean: a run with W processes and A accumulation
micro-batches per step sees exactly the batches of a run with 1 process and
W*A micro-batches, so 1 process and W processes follow the same loss curve.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3_assets.core.draft_model import DraftConfig, Eagle3Draft
from eagle3_assets.core.export import draft_config_from_hf, export_draft, read_draft_dir
from eagle3_assets.core.extraction import PartStates, open_part, verify_part
from eagle3_assets.core.schedule import Schedule, fit_schedule
from eagle3_assets.core.storage import file_hash, fsync_dir, stable_hash, staging_dir, write_json_atomic
from eagle3_assets.core.vocab import VocabMapping, load_vocab_mapping

EVENT_PREFIX = "EAGLE3_TRAIN_EVENT "
Event = dict
OnEvent = Callable[[Event], None]


# --------------------------------------------------------------------------- configuration


@dataclass
class TrainConfig:
    hidden_state_dirs: list[str]  # one directory per shard (hidden_states contract)
    vocab_mapping: str  # vocab_mapping.safetensors (or its directory)
    target_path: str  # the target's HF directory: its lm_head, final norm and embedding
    training_dir: str  # checkpoints, history.json
    init_from: str | None = None  # an existing EAGLE-3 directory to fine-tune
    # None: fitted to the data before training (core/schedule.py); the run then records what was used.
    epochs: int | None = None
    learning_rate: float | None = None
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio
    warmup_ratio: float = 0.02  # share of all optimizer steps spent warming up linearly
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    ttt_steps: int = 7
    step_weight: float = 0.8
    batch_tokens: int | None = None  # padded tokens per micro-batch (per process); None: fitted to the data
    grad_accumulation: int = 1  # micro-batches per process per optimizer step
    max_seq_len: int = 4096  # longer samples are truncated
    seed: int = 0
    head_from_target: bool = True  # from scratch: start norm + lm_head as the target's (restricted rows)
    bf16_autocast: bool = True  # on CUDA only; CPU runs in float32
    draft_intermediate_size: int | None = None  # draft shape overrides (default: like a target layer)
    draft_num_attention_heads: int | None = None
    draft_num_key_value_heads: int | None = None
    draft_head_dim: int | None = None
    log_every: int = 10
    keep_checkpoints: int = 2
    torch_threads: int | None = None  # default: torch's on GPU hosts, 1 on CPU

    # Fields that do not change what is computed, so resuming across them is fine.
    _NOT_IN_FINGERPRINT = ("training_dir", "log_every", "keep_checkpoints", "torch_threads")

    @classmethod
    def from_dict(cls, raw: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}; known: {sorted(known)}")
        raw = dict(raw)
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        return cls(**raw)

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> None:
        problems = []
        if self.epochs is not None and self.epochs < 1:
            problems.append(f"epochs {self.epochs} < 1")
        if self.ttt_steps < 1:
            problems.append(f"ttt_steps {self.ttt_steps} < 1")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            problems.append(f"batch_tokens {self.batch_tokens} < 1")
        if self.learning_rate is not None and self.learning_rate <= 0:
            problems.append(f"learning_rate {self.learning_rate} <= 0")
        if self.grad_accumulation < 1:
            problems.append(f"grad_accumulation {self.grad_accumulation} < 1")
        if not self.hidden_state_dirs:
            problems.append("no hidden-state shard directories")
        if problems:
            raise ValueError("training settings: " + "; ".join(problems))


# --------------------------------------------------------------------------- hidden states


@dataclass(frozen=True)
class Sample:
    file: str
    start: int  # token offsets inside the file
    end: int
    sample_id: str

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class HiddenStateIndex:
    samples: list[Sample]
    aux_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    vocab_size: int
    final_state: str  # "post_norm" | "pre_norm"
    target_config_hash: str
    fingerprint: str  # of every sidecar: changes when any shard is re-extracted


def index_hidden_states(shard_dirs: list[str | Path]) -> HiddenStateIndex:
    """Every sample of every shard, from the sidecars; shards must agree on how they were extracted."""
    samples: list[Sample] = []
    sidecars = []
    for shard in map(Path, shard_dirs):
        meta_path = shard / "metadata.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"hidden states {shard}: no metadata.json, the shard is incomplete (re-run hidden_states)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != 1:
            raise ValueError(f"hidden states {meta_path}: format {meta.get('format')!r}, expected 1")
        if meta.get("final_state") not in ("post_norm", "pre_norm"):
            raise ValueError(f"hidden states {meta_path}: final_state {meta.get('final_state')!r}, expected post_norm or pre_norm")
        sidecars.append(meta)
        for entry in meta["files"]:
            path = shard / entry["name"]
            verify_part(path, entry.get("sha256"))  # once, here: a damaged part fails naming the file, not mid-epoch
            with open_part(path) as fh:
                offsets = fh.get_tensor("sample_offsets").tolist()
            if len(offsets) != entry["num_samples"] + 1:
                raise ValueError(f"hidden states {path}: {len(offsets) - 1} samples in sample_offsets, sidecar says {entry['num_samples']}")
            ids = meta["sample_ids"][entry["first_sample"] : entry["first_sample"] + entry["num_samples"]]
            samples += [Sample(str(path), offsets[i], offsets[i + 1], str(ids[i])) for i in range(entry["num_samples"])]
    first = sidecars[0]
    for key in ("aux_layer_ids", "hidden_size", "num_layers", "vocab_size", "final_state", "target_config_hash"):
        values = {json.dumps(m.get(key)) for m in sidecars}
        if len(values) > 1:
            raise ValueError(f"hidden-state shards disagree on {key}: {sorted(values)}; re-extract them with one target and one setting")
    if not samples:
        raise ValueError(f"hidden states {[str(s) for s in shard_dirs]} hold no samples")
    return HiddenStateIndex(
        samples=samples,
        aux_layer_ids=[int(i) for i in first["aux_layer_ids"]],
        num_layers=int(first["num_layers"]),
        hidden_size=int(first["hidden_size"]),
        vocab_size=int(first["vocab_size"]),
        final_state=first["final_state"],
        target_config_hash=str(first.get("target_config_hash")),
        fingerprint=stable_hash(sidecars),
    )


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, 3*H] float32
    final: torch.Tensor  # [B, T, H]
    input_ids: torch.Tensor  # [B, T] int64, 0 after a sample's end
    loss_mask: torch.Tensor  # [B, T] bool, False after a sample's end
    num_tokens: int

    def to(self, device: torch.device) -> Batch:
        return Batch(self.aux.to(device), self.final.to(device), self.input_ids.to(device), self.loss_mask.to(device), self.num_tokens)


def load_batch(samples: list[Sample], max_seq_len: int) -> Batch:
    """Read the samples' tensors (slices only, never whole files) into right-padded tensors."""
    lengths = [min(s.length, max_seq_len) for s in samples]
    width = max(lengths)
    rows: dict[str, list] = {"aux": [], "final": [], "ids": [], "mask": []}
    by_file: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_file.setdefault(s.file, []).append(i)
    loaded: dict[int, tuple] = {}
    for path, members in by_file.items():
        with open_part(Path(path)) as fh:
            states = PartStates(fh)  # 8-bit parts come back dequantised to float32
            ids, mask = fh.get_slice("input_ids"), fh.get_slice("loss_mask")
            for i in members:
                a, b = samples[i].start, samples[i].start + lengths[i]
                loaded[i] = (states.aux(a, b), states.final(a, b), ids[a:b], mask[a:b])
    for i in range(len(samples)):
        aux, final, ids, mask = loaded[i]
        pad = width - lengths[i]
        rows["aux"].append(F.pad(aux.float(), (0, 0, 0, pad)))
        rows["final"].append(F.pad(final.float(), (0, 0, 0, pad)))
        rows["ids"].append(F.pad(ids.long(), (0, pad)))
        rows["mask"].append(F.pad(mask.long(), (0, pad)) == 1)
    return Batch(
        torch.stack(rows["aux"]), torch.stack(rows["final"]), torch.stack(rows["ids"]), torch.stack(rows["mask"]), sum(lengths)
    )


# --------------------------------------------------------------------------- batch plan


def epoch_micro_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Samples packed into micro-batches of at most ``batch_tokens`` padded tokens, in a shuffled order.

    Similar lengths go together (little padding); ties are broken randomly so
    that an epoch's batches differ from the last one's.
    """
    rng = random.Random(f"{seed}:{epoch}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max([lengths[j] for j in current] + [lengths[i]])
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def epoch_steps(lengths: list[int], config: TrainConfig, world_size: int, epoch: int) -> list[list[list[int]]]:
    """The epoch's optimizer steps, each a list of ``world_size * grad_accumulation`` micro-batches.

    The last step is filled up with the epoch's first micro-batches, so that
    every process runs the same number of steps and no sample is dropped.
    """
    micro = epoch_micro_batches(lengths, config.batch_tokens, config.seed, epoch)
    per_step = world_size * config.grad_accumulation
    epoch_order = list(micro)
    while len(micro) % per_step:
        micro.append(epoch_order[(len(micro) - len(epoch_order)) % len(epoch_order)])
    return [micro[i : i + per_step] for i in range(0, len(micro), per_step)]


# --------------------------------------------------------------------------- the target's head


def _target_weight_names(target_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, for a single or sharded checkpoint."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: str(target_dir / file) for name, file in json.loads(index.read_text())["weight_map"].items()}
    names: dict[str, str] = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            names.update({name: str(file) for name in fh.keys()})
    if not names:
        raise FileNotFoundError(f"target {target_dir}: no safetensors weights")
    return names


def load_target_tensors(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """The target's ``embed_tokens``, final ``norm`` and ``lm_head`` weights (only those), as float32."""
    target_dir = Path(target_dir)
    names = _target_weight_names(target_dir)

    def find(suffix: str, exclude: str = "\0") -> str | None:
        hits = [n for n in names if n.endswith(suffix) and exclude not in n]
        return min(hits, key=len) if hits else None

    wanted = {"embed": find("embed_tokens.weight"), "norm": find("norm.weight", exclude="layers."), "lm_head": find("lm_head.weight")}
    config = json.loads((target_dir / "config.json").read_text())
    text = config.get("text_config", config)
    if wanted["lm_head"] is None and text.get("tie_word_embeddings", config.get("tie_word_embeddings")):
        wanted["lm_head"] = wanted["embed"]
    missing = [k for k, v in wanted.items() if v is None]
    if missing:
        raise ValueError(f"target {target_dir}: cannot find its {missing} weights")
    out = {}
    for key, name in wanted.items():
        with safe_open(names[name], framework="pt") as fh:
            out[key] = fh.get_tensor(name).float()
    out["rms_norm_eps"] = torch.tensor(float(text.get("rms_norm_eps", 1e-6)))
    return out


class TargetHead(nn.Module):
    """The target's next-token distribution from its stored final states."""

    def __init__(self, tensors: dict[str, torch.Tensor], mapping: VocabMapping, final_state: str):
        super().__init__()
        self.apply_norm = final_state == "pre_norm"  # vLLM stores the last layer's output before the norm
        self.eps = float(tensors["rms_norm_eps"])
        self.register_buffer("norm_weight", tensors["norm"])
        self.register_buffer("lm_head", tensors["lm_head"])
        self.register_buffer("draft_to_target", mapping.draft_to_target)

    @torch.no_grad()
    def forward(self, final: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocabulary [.., Vd], the target's top-1 target id [..])."""
        if self.apply_norm:
            final = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        flat = final.reshape(-1, final.shape[-1])
        restricted, top = [], []
        for part in flat.split(chunk):  # full-vocabulary logits only a chunk at a time (160k-wide for Kimi)
            logits = part @ self.lm_head.T
            top.append(logits.argmax(-1))
            restricted.append(logits[:, self.draft_to_target])
        shape = final.shape[:-1]
        return torch.cat(restricted).view(*shape, -1), torch.cat(top).view(shape)


# --------------------------------------------------------------------------- the unrolled loss


def shift_left(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """``out[:, t] = x[:, t + by]``, ``fill`` past the end."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1) if by < x.shape[1] else torch.full_like(x, fill)


class TrainingTimeTest(nn.Module):
    """The draft unrolled ``steps`` times; ``forward`` is the whole loss so that DDP syncs its gradients.

    Chain t starts from the target's states at position t. At step k it reads
    token x[t+1+k] (teacher-forced tokens, the draft's own hidden state) and
    predicts the target's distribution at position t+1+k, i.e. token t+2+k,
    which is supervised where ``loss_mask`` is 1 and the target's top token is
    in the draft vocabulary (elsewhere no draft can be accepted anyway).
    """

    def __init__(self, draft: Eagle3Draft, steps: int, step_weight: float):
        super().__init__()
        self.draft, self.steps, self.step_weight = draft, steps, step_weight

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, target_logits: torch.Tensor, target_top: torch.Tensor):
        draft = self.draft
        target_probs = torch.softmax(target_logits.float(), dim=-1)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = draft.fuse(aux)
        cache: list = []
        loss = torch.zeros((), device=hidden.device)
        step_losses, correct, counts = [], [], []
        for k in range(self.steps):
            logits, hidden = draft.step(shift_left(input_ids, 1 + k), hidden, positions + k, cache)
            probs_k = shift_left(target_probs, 1 + k)
            top_k = shift_left(target_top, 1 + k)
            mask = shift_left(loss_mask, 2 + k, False) & draft.t2d[top_k]
            count = mask.sum()
            token_loss = -(probs_k * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
            step_loss = (token_loss * mask).sum() / count.clamp(min=1)
            loss = loss + self.step_weight**k * step_loss
            with torch.no_grad():
                hit = draft.draft_to_target_ids(logits.argmax(-1)) == top_k
                step_losses.append(step_loss.detach())
                correct.append((hit & mask).sum())
                counts.append(count)
        stats = torch.stack([torch.stack(step_losses), torch.stack(correct).float(), torch.stack(counts).float()])
        return loss, stats  # stats: [3, steps] = per-step loss, correct, supervised positions


# --------------------------------------------------------------------------- initial weights


@dataclass
class InitReport:
    source: str  # "scratch" or the fine-tuned directory
    lm_head_rows_kept: int = 0
    lm_head_rows_new: int = 0
    notes: list[str] = field(default_factory=list)


def initial_draft(config: TrainConfig, index: HiddenStateIndex, mapping: VocabMapping, target: dict) -> tuple[Eagle3Draft, InitReport]:
    """A fresh draft whose embedding is the target's, or an existing draft adapted to the new vocabulary map."""
    target_config = json.loads((Path(config.target_path) / "config.json").read_text())
    torch.manual_seed(config.seed)
    if config.init_from is None:
        draft_config = DraftConfig.for_target(
            target_config,
            mapping.draft_vocab_size,
            index.aux_layer_ids,
            intermediate_size=config.draft_intermediate_size,
            num_attention_heads=config.draft_num_attention_heads,
            num_key_value_heads=config.draft_num_key_value_heads,
            head_dim=config.draft_head_dim,
        )
        draft = Eagle3Draft(draft_config)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(target["embed"])
            if config.head_from_target:
                # The draft's head starts as the target's own (final norm, lm_head rows of the draft
                # vocabulary): the draft then only has to learn to produce the target's final state.
                # Seen here on the tiny target: acceptance 2.19 instead of 1.88 after the same training.
                draft.norm.weight.copy_(target["norm"])
                draft.lm_head.weight.copy_(target["lm_head"][mapping.draft_to_target])
        draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
        return draft, InitReport(source="scratch")
    return _fine_tune_start(Path(config.init_from), index, mapping, target)


def _fine_tune_start(path: Path, index: HiddenStateIndex, mapping: VocabMapping, target: dict) -> tuple[Eagle3Draft, InitReport]:
    hf, tensors = read_draft_dir(path)
    old, layer_ids = draft_config_from_hf(hf, str(path))
    report = InitReport(source=str(path))
    problems = []
    if old.target_hidden_size != index.hidden_size:
        problems.append(f"it reads target states of width {old.target_hidden_size}, the hidden states have {index.hidden_size}")
    if old.vocab_size != mapping.target_vocab_size:
        problems.append(f"its vocab_size {old.vocab_size} is not the target's {mapping.target_vocab_size}")
    if layer_ids is None:
        default = [2, index.num_layers // 2, index.num_layers - 3]
        if default != index.aux_layer_ids:
            problems.append(
                f"its config names no eagle_aux_hidden_state_layer_ids, so vLLM used its default {default}, "
                f"but the hidden states were extracted at {index.aux_layer_ids}"
            )
        report.notes.append(f"config named no layer ids; vLLM's default {default} equals the hidden states'")
    elif list(layer_ids) != index.aux_layer_ids:
        problems.append(f"it was trained on layers {layer_ids}, the hidden states are from {index.aux_layer_ids}")
    if "embed_tokens.weight" not in tensors and old.hidden_size != index.hidden_size:
        problems.append("it has no embed_tokens and its width differs from the target's, so it cannot share the target's")
    if problems:
        raise ValueError(f"cannot fine-tune {path}: " + "; ".join(problems))

    new_config = DraftConfig(**{**asdict(old), "draft_vocab_size": mapping.draft_vocab_size, "aux_layer_ids": tuple(index.aux_layer_ids)})
    draft = Eagle3Draft(new_config)  # new lm_head rows keep this random init
    own = {k: v for k, v in tensors.items() if k not in ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")}
    missing = sorted(set(draft.state_dict()) - set(own) - {"lm_head.weight", "d2t", "t2d", "embed_tokens.weight"})
    if missing:
        raise ValueError(f"cannot fine-tune {path}: its weights lack {missing}")
    draft.load_state_dict(own, strict=False)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(tensors.get("embed_tokens.weight", target["embed"]).float())
        # Rows follow target ids: row i of the new head predicts target id i + d2t_new[i].
        old_targets = torch.arange(old.draft_vocab_size) + tensors.get("d2t", torch.zeros(old.draft_vocab_size, dtype=torch.int64))
        old_row_of_target = torch.full((mapping.target_vocab_size,), -1, dtype=torch.int64)
        old_row_of_target[old_targets] = torch.arange(old.draft_vocab_size)
        old_rows = old_row_of_target[mapping.draft_to_target]
        kept = old_rows >= 0
        draft.lm_head.weight[kept] = tensors["lm_head.weight"].float()[old_rows[kept]]
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    report.lm_head_rows_kept, report.lm_head_rows_new = int(kept.sum()), int((~kept).sum())
    return draft, report


# --------------------------------------------------------------------------- checkpoints


CHECKPOINT_GLOB = "epoch-*"
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(
    checkpoints: Path, epoch: int, model: Eagle3Draft, optimizer, scheduler, state: dict, keep: int, name: str | None = None, pattern: str = CHECKPOINT_GLOB
) -> Path:
    """Write an epoch's checkpoint into a temporary directory, seal it with a manifest, rename it into place.

    A crash at any point leaves either no ``epoch-NNNN`` directory or a
    complete one; :func:`latest_checkpoint` also verifies the manifest's
    hashes, so a checkpoint damaged later is skipped too. ``name`` and
    ``pattern`` let bounded-disk training (core/bounded_training.py) keep
    checkpoints by step (``step-NNNNNNNN``) instead of by epoch.
    """
    checkpoints.mkdir(parents=True, exist_ok=True)
    final = checkpoints / (name or f"epoch-{epoch:04d}")
    staging = staging_dir(final)
    try:
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
        save_file(weights, str(staging / "model.safetensors"))
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng}, staging / "trainer.pt")
        (staging / "state.json").write_text(json.dumps(state, indent=1))
        files = {}
        for path in sorted(staging.iterdir()):
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        (staging / MANIFEST).write_text(json.dumps({"epoch": epoch, "files": files}, indent=1))
        with open(staging / MANIFEST, "rb") as fh:
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(checkpoints)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in sorted(checkpoints.glob(pattern))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_is_complete(path: Path) -> bool:
    manifest = path / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    for name, expected in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != expected["bytes"] or _sha256(file) != expected["sha256"]:
            return False
    return {"model.safetensors", "trainer.pt", "state.json"} <= files.keys()


def latest_checkpoint(checkpoints: Path, fingerprint: str, pattern: str = CHECKPOINT_GLOB) -> Path | None:
    """The newest complete checkpoint of this very run (same fingerprint), else None."""
    for path in sorted(checkpoints.glob(pattern), reverse=True):
        if checkpoint_is_complete(path) and json.loads((path / "state.json").read_text()).get("fingerprint") == fingerprint:
            return path
    return None


# --------------------------------------------------------------------------- the loop


def supervised_token_count(index: HiddenStateIndex, max_seq_len: int) -> int:
    """Tokens the draft learns from (loss mask 1, within ``max_seq_len``): one read of each part's mask."""
    by_file: dict[str, list[Sample]] = {}
    for sample in index.samples:
        by_file.setdefault(sample.file, []).append(sample)
    total = 0
    for path, samples in by_file.items():
        with safe_open(path, framework="pt") as fh:
            mask = fh.get_tensor("loss_mask")
        total += sum(int(mask[s.start : s.start + min(s.length, max_seq_len)].sum()) for s in samples)
    return total


def resolve_schedule(config: TrainConfig, index: HiddenStateIndex, lengths: list[int], world: int) -> tuple[TrainConfig, Schedule]:
    """``config`` with every unset schedule setting fitted to the data (the same data always gives the same fit)."""
    schedule = fit_schedule(
        total_tokens=sum(lengths),
        supervised_tokens=supervised_token_count(index, config.max_seq_len),
        hidden_size=index.hidden_size,
        steps_per_epoch_for=lambda batch_tokens: len(epoch_steps(lengths, replace(config, batch_tokens=batch_tokens), world, 0)),
        world_size=world,
        grad_accumulation=config.grad_accumulation,
        batch_tokens=config.batch_tokens,
        epochs=config.epochs,
        learning_rate=config.learning_rate,
    )
    resolved = replace(config, batch_tokens=schedule.batch_tokens, epochs=schedule.epochs, learning_rate=schedule.learning_rate)
    return resolved, schedule


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def run_fingerprint(config: TrainConfig, index: HiddenStateIndex) -> str:
    """What the run is made of: settings, data, vocabulary map, target and starting point."""
    # Inputs count by content (or, for large weight files, by name, size and time), not by path.
    settings = {k: v for k, v in config.to_dict().items() if k not in TrainConfig._NOT_IN_FINGERPRINT}
    for by_content in ("hidden_state_dirs", "vocab_mapping", "target_path", "init_from"):
        settings.pop(by_content)
    return stable_hash(
        {
            "settings": settings,
            "hidden_states": index.fingerprint,
            "vocab_mapping": file_hash(_mapping_file(config.vocab_mapping)),
            "target": _files_identity(Path(config.target_path)),
            "init_from": _files_identity(Path(config.init_from)) if config.init_from else None,
            "format": 1,
        }
    )


def _files_identity(directory: Path) -> list:
    """Config files by content, weight files by name, size and modification time."""
    identity = []
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        if path.suffix == ".json":
            identity.append((path.name, file_hash(path)))
        elif path.suffix == ".safetensors":
            identity.append((path.name, path.stat().st_size, int(path.stat().st_mtime)))
    return identity


def _mapping_file(path: str) -> Path:
    p = Path(path)
    return p / "vocab_mapping.safetensors" if p.is_dir() else p


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


def train(config: TrainConfig, on_event: OnEvent | None = None) -> TrainResult:
    """Train (or resume) and checkpoint every epoch. Under torchrun, every process runs this."""
    config.validate()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = _pick_device()
    threads = torch.get_num_threads()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    elif device.type == "cpu":
        # CPU training is the demo's and the tests': a tiny draft whose matrices are too small to split.
        # Measured here (2 busy cores): 1 thread ran 3-10x faster than 2, which mostly wait on each other.
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

    index = index_hidden_states(config.hidden_state_dirs)
    mapping = load_vocab_mapping(Path(config.vocab_mapping))
    if mapping.target_vocab_size != index.vocab_size:
        raise ValueError(f"vocab mapping covers {mapping.target_vocab_size} target ids, the hidden states' target has {index.vocab_size}")
    target = load_target_tensors(config.target_path)
    if target["lm_head"].shape[0] != index.vocab_size or target["lm_head"].shape[1] != index.hidden_size:
        raise ValueError(f"target {config.target_path}: lm_head {tuple(target['lm_head'].shape)} does not fit the hidden states")
    draft, init_report = initial_draft(config, index, mapping, target)
    draft.embed_tokens.weight.requires_grad_(False)  # the target's embedding: frozen, shared by vLLM
    draft.to(device)
    head = TargetHead(target, mapping, index.final_state).to(device)
    ttt = TrainingTimeTest(draft, config.ttt_steps, config.step_weight).to(device)
    model = ttt
    if distributed:
        model = nn.parallel.DistributedDataParallel(ttt, device_ids=[device.index] if device.type == "cuda" else None)

    lengths = [min(s.length, config.max_seq_len) for s in index.samples]
    config, schedule = resolve_schedule(config, index, lengths, world)
    emit({"event": "schedule", "description": schedule.describe(), "warnings": schedule.warnings, **asdict(schedule)})
    plans = [epoch_steps(lengths, config, world, epoch) for epoch in range(config.epochs)]
    total_steps = sum(len(p) for p in plans)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, config.warmup_ratio, config.min_lr_ratio))

    fingerprint = run_fingerprint(config, index)
    training_dir = Path(config.training_dir)
    checkpoints = training_dir / "checkpoints"
    if rank == 0 and checkpoints.is_dir():
        for partial in checkpoints.glob(".*.partial"):  # left by a crash mid-checkpoint: never resumed from
            shutil.rmtree(partial, ignore_errors=True)
    start_epoch, step, history, resumed_from = 0, 0, [], None
    resume = latest_checkpoint(checkpoints, fingerprint)
    if resume is not None:
        state = json.loads((resume / "state.json").read_text())
        draft.load_state_dict({**load_file(str(resume / "model.safetensors")), "embed_tokens.weight": draft.embed_tokens.weight}, strict=True)
        saved = torch.load(resume / "trainer.pt", weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        random.setstate(saved["rng"]["python"])
        torch.set_rng_state(saved["rng"]["torch"])
        if "cuda" in saved["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
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

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and config.bf16_autocast else nullcontext()
    started, tokens_seen = time.monotonic(), 0
    rank_micro_batches = rank_tokens = 0  # this process's share (this run's, not a resumed run's)
    last_checkpoint = str(resume) if resume else ""
    model.train()
    for epoch in range(start_epoch, config.epochs):
        for micro_batches in plans[epoch]:
            mine = micro_batches[rank::world]
            totals = torch.zeros(3, config.ttt_steps, device=device)
            loss_sum = torch.zeros((), device=device)
            tokens = 0
            for i, members in enumerate(mine):
                batch = load_batch([index.samples[j] for j in members], config.max_seq_len).to(device)
                tokens += batch.num_tokens
                rank_micro_batches += 1
                target_logits, target_top = head(batch.final)
                last = i == len(mine) - 1
                sync = model.no_sync() if distributed and not last else nullcontext()
                with sync:
                    with autocast:
                        loss, stats = model(batch.aux, batch.input_ids, batch.loss_mask, target_logits, target_top)
                    (loss / len(mine)).backward()
                loss_sum += loss.detach()
                totals += stats
            rank_tokens += tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # Per-step figures over every process's micro-batches.
            summary = torch.cat([loss_sum.view(1), totals[0], totals[1:].flatten(), torch.tensor([float(tokens)], device=device)])
            if distributed:
                dist.all_reduce(summary)
            n = len(micro_batches)
            k = config.ttt_steps
            correct, counts = summary[1 + k : 1 + 2 * k], summary[1 + 2 * k : 1 + 3 * k]
            tokens_seen += int(summary[-1])
            record = {
                "step": step,
                "epoch": epoch + 1,
                "loss": float(summary[0]) / n,
                "step_losses": [round(float(x) / n, 6) for x in summary[1 : 1 + k]],
                "accuracy": [round(float(c) / max(float(m), 1.0), 6) for c, m in zip(correct, counts)],
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "tokens": int(summary[-1]),
            }
            history.append(record)
            if step % config.log_every == 0 or step == total_steps:
                emit({"event": "step", **record, "total_steps": total_steps, "elapsed_s": round(time.monotonic() - started, 2)})

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
            last_checkpoint = str(save_checkpoint(checkpoints, epoch + 1, draft, optimizer, scheduler, state, config.keep_checkpoints))
            emit({"event": "checkpoint", "epoch": epoch + 1, "step": step, "path": last_checkpoint})
        if distributed:
            dist.barrier()

    elapsed = time.monotonic() - started
    if distributed:
        emit_own({"event": "rank_done", "rank": rank, "world_size": world, "micro_batches": rank_micro_batches, "tokens": rank_tokens})
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
        write_json_atomic(training_dir / "history.json", {"fingerprint": fingerprint, "history": history})
        write_json_atomic(training_dir / "result.json", asdict(result) | {"history": None})
        emit({"event": "done", "checkpoint": last_checkpoint, "tokens_per_s": result.tokens_per_s})
    if distributed:
        dist.barrier()
    return result


def _pick_device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # before NCCL starts: one GPU per process
        return device
    if os.environ.get("EAGLE3_ALLOW_CPU", "1") != "1":
        raise RuntimeError("no CUDA device on this host and EAGLE3_ALLOW_CPU is not 1: refusing to train on CPU")
    return torch.device("cpu")


def draft_from_checkpoint(checkpoint: Path, target_path: str | Path, target_embedding: torch.Tensor | None = None) -> Eagle3Draft:
    """The trained draft of a complete checkpoint, with the embedding it was trained with."""
    checkpoint = Path(checkpoint)
    if not checkpoint_is_complete(checkpoint):
        raise ValueError(f"checkpoint {checkpoint} is incomplete or damaged")
    state = json.loads((checkpoint / "state.json").read_text())
    raw = state["draft_config"]
    draft = Eagle3Draft(DraftConfig(**{**raw, "aux_layer_ids": tuple(raw["aux_layer_ids"])}))
    init_from = state["config"].get("init_from")
    embed = None
    if init_from:
        _, tensors = read_draft_dir(Path(init_from))
        embed = tensors.get("embed_tokens.weight")
    if embed is None:
        embed = target_embedding if target_embedding is not None else load_target_tensors(target_path)["embed"]
    draft.load_state_dict({**load_file(str(checkpoint / "model.safetensors")), "embed_tokens.weight": embed.float()})
    return draft


def export_trained_draft(result_checkpoint: str | Path, target_path: str | Path, out_dir: Path, dtype: str | None = None) -> Path:
    """Export the final checkpoint as vLLM's native directory, in the target's dtype unless told otherwise."""
    target_embed = load_target_tensors(target_path)["embed"]
    draft = draft_from_checkpoint(Path(result_checkpoint), target_path, target_embed)
    if dtype is None:
        target_config = json.loads((Path(target_path) / "config.json").read_text())
        text = target_config.get("text_config", target_config)
        dtype = text.get("dtype") or text.get("torch_dtype") or target_config.get("dtype") or "bfloat16"
        dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    return export_draft(draft, out_dir, dtype=dtype, target_embedding=target_embed)


# --------------------------------------------------------------------------- launching


def run_training(config: TrainConfig, nproc: int = 1, on_event: OnEvent | None = None, python: str = sys.executable) -> dict:
    """Train in this process (``nproc == 1``) or under ``torchrun`` with ``nproc`` processes; return result.json."""
    on_event = on_event or (lambda event: None)
    if nproc <= 1:
        result = train(config, on_event)
        return asdict(result) | {"history": None}
    training_dir = Path(config.training_dir)
    training_dir.mkdir(parents=True, exist_ok=True)
    config_file = training_dir / "launch_config.json"
    write_json_atomic(config_file, config.to_dict())
    command = [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(nproc)}",
        "-m", "eagle3_assets.core.training", "--config", str(config_file),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert process.stdout is not None
    decoder = json.JSONDecoder()
    for line in process.stdout:
        if EVENT_PREFIX not in line:
            tail = (tail + [line.rstrip()])[-40:]
            continue
        # Every rank writes to this one pipe: two ranks' writes can land on one line, so each event is
        # decoded where its prefix starts, and whatever follows it on the line is not taken for JSON.
        for chunk in line.split(EVENT_PREFIX)[1:]:
            on_event(decoder.raw_decode(chunk.strip())[0])
    if process.wait() != 0:
        raise RuntimeError(f"torchrun training exited with {process.returncode}:\n" + "\n".join(tail))
    return json.loads((training_dir / "result.json").read_text())


def _print_event(event: Event) -> None:
    print(EVENT_PREFIX + json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> None:
    """The torchrun worker: ``python -m eagle3_assets.core.training --config launch_config.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a JSON file of TrainConfig fields")
    args = parser.parse_args(argv)
    train(TrainConfig.from_dict(json.loads(Path(args.config).read_text())), _print_event)


if __name__ == "__main__":
    main()
