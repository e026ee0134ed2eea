"""Atomic step checkpoints, the journal of committed steps, the run's fingerprint (what a checkpoint may be resumed by), and the export."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.core.draft.forms import draft_config_from_dict, new_draft
from eagle3_assets.core.draft.model import Eagle3Draft
from eagle3_assets.core.draft.export import export_draft, read_draft_dir
from eagle3_assets.core.storage.files import file_hash, fsync_dir, stable_hash, staging_dir
from eagle3_assets.core.storage.shard_paths import VOCAB_MAPPING_FILE
from eagle3_assets.core.target.description import text_config
from eagle3_assets.core.target.head import load_head_weights
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import HiddenStateIndex


CHECKPOINT_GLOB = "step-*"
MANIFEST = "manifest.json"
# The journal of committed optimizer steps: one JSON line per step (its batch ids and sample ids), appended
# only once the checkpoint holding the step's weights is durable.
JOURNAL = "trained_batches.jsonl"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(checkpoints: Path, step: int, model: torch.nn.Module, optimizers: list, schedulers: list, state: dict, keep: int) -> Path:
    """Write a step's checkpoint into a temporary directory, seal it with a manifest, rename it into place.

    A crash at any point leaves either no ``step-NNNNNNNN`` directory or a
    complete one; :func:`latest_checkpoint` also verifies the manifest's
    hashes, so a checkpoint damaged later is skipped too.
    """
    checkpoints.mkdir(parents=True, exist_ok=True)
    final = checkpoints / checkpoint_name(step)
    staging = staging_dir(final)
    try:
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
        save_file(weights, str(staging / "model.safetensors"))
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        trainer = {"optimizers": [o.state_dict() for o in optimizers], "schedulers": [s.state_dict() for s in schedulers], "rng": rng}
        torch.save(trainer, staging / "trainer.pt")
        (staging / "state.json").write_text(json.dumps(state, indent=1))
        files = {}
        for path in sorted(staging.iterdir()):
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        (staging / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        with open(staging / MANIFEST, "rb") as fh:
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(checkpoints)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in sorted(checkpoints.glob(CHECKPOINT_GLOB))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def restore_checkpoint(checkpoint: Path, draft: Eagle3Draft, optimizers: list, schedulers: list) -> dict:
    """Load a complete checkpoint's weights, optimizer, schedule and RNG states in place; return its ``state.json``."""
    state = json.loads((checkpoint / "state.json").read_text())
    draft.load_state_dict({**load_file(str(checkpoint / "model.safetensors")), "embed_tokens.weight": draft.embed_tokens.weight}, strict=True)
    saved = torch.load(checkpoint / "trainer.pt", weights_only=True)
    # A run's fingerprint holds its optimizer setting, so the checkpoint has as many optimizers as this run.
    for optimizer, optimizer_state in zip(optimizers, saved["optimizers"], strict=True):
        optimizer.load_state_dict(optimizer_state)
    for scheduler, scheduler_state in zip(schedulers, saved["schedulers"], strict=True):
        scheduler.load_state_dict(scheduler_state)
    random.setstate(saved["rng"]["python"])
    torch.set_rng_state(saved["rng"]["torch"])
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
    return state


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


def latest_checkpoint(checkpoints: Path, fingerprint: str) -> Path | None:
    """The newest complete checkpoint of this very run (same fingerprint), else None."""
    for path in sorted(checkpoints.glob(CHECKPOINT_GLOB), reverse=True):
        if checkpoint_is_complete(path) and json.loads((path / "state.json").read_text()).get("fingerprint") == fingerprint:
            return path
    return None



def run_fingerprint(config: TrainConfig, index: HiddenStateIndex) -> str:
    """What the run is made of: settings, data, vocabulary map, target and starting point."""
    # Inputs count by content (or, for large weight files, by name, size and time), not by path.
    settings = {k: v for k, v in config.to_dict().items() if k not in TrainConfig._NOT_IN_FINGERPRINT}
    # supervised_dirs count through the index too: the mixed index's fingerprint covers their sidecars and the draw.
    for by_content in ("hidden_state_dirs", "supervised_dirs", "vocab_mapping", "target_path", "init_from"):
        settings.pop(by_content)
    return stable_hash(
        {
            "settings": settings,
            "hidden_states": index.fingerprint,
            "vocab_mapping": file_hash(_mapping_file(config.vocab_mapping)),
            "target": _files_identity(Path(config.target_path)),
            "init_from": _files_identity(Path(config.init_from)) if config.init_from else None,
            "format": 2,  # 2: step checkpoints and a journal in both modes
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
    return p / VOCAB_MAPPING_FILE if p.is_dir() else p



def draft_from_checkpoint(checkpoint: Path, target_path: str | Path, target_embedding: torch.Tensor | None = None) -> Eagle3Draft:
    """The trained draft of a complete checkpoint, with the embedding it was trained with."""
    checkpoint = Path(checkpoint)
    if not checkpoint_is_complete(checkpoint):
        raise ValueError(f"checkpoint {checkpoint} is incomplete or damaged")
    state = json.loads((checkpoint / "state.json").read_text())
    draft = new_draft(draft_config_from_dict(state["draft_config"]))
    init_from = state["config"].get("init_from")
    embed = None
    if init_from:
        _, tensors = read_draft_dir(Path(init_from))
        embed = tensors.get("embed_tokens.weight")
    if embed is None:
        embed = target_embedding if target_embedding is not None else load_head_weights(target_path)["embed"]
    draft.load_state_dict({**load_file(str(checkpoint / "model.safetensors")), "embed_tokens.weight": embed.float()})
    return draft


def export_trained_draft(result_checkpoint: str | Path, target_path: str | Path, out_dir: Path, dtype: str | None = None) -> Path:
    """Export the final checkpoint as vLLM's native directory, in the target's dtype unless told otherwise."""
    target_embed = load_head_weights(target_path)["embed"]
    draft = draft_from_checkpoint(Path(result_checkpoint), target_path, target_embed)
    if dtype is None:
        target_config = json.loads((Path(target_path) / "config.json").read_text())
        text = text_config(target_config)
        dtype = text.get("dtype") or text.get("torch_dtype") or target_config.get("dtype") or "bfloat16"
        dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    return export_draft(draft, out_dir, dtype=dtype, target_embedding=target_embed)

