"""The platform's stored hidden states in the layout speculators' EAGLE-3 trainer expects.

Imported by both sides of the peer bench: by ``bench/peer/train_speculators.py``
in the peer environment (torch and safetensors only, nothing of the platform,
whose dependencies that environment lacks) and by the project's tests.

Ours (docs/hidden-states.md): per token t of a sample, one row each of
``input_ids[t]``, ``aux_hidden_states[t]`` (the three auxiliary states after
reading token t, side by side), ``final_hidden_states[t]`` and
``loss_mask[t]``, all at the same t. That is the unshifted layout speculators'
own data generation stores, so a sample goes to speculators as it is
(:func:`read_sample`), and speculators' ``shift_batch``
(``speculators/models/eagle3/data.py``) aligns it: row j of the result holds
token t+1, the aux states of t, the final state of t+1 and the loss mask of
t+1 (t = j), with position ids from 1. :func:`speculators_layout` is that
alignment written out here, so that a test can hold it without speculators
installed, and the peer script checks it equal to ``shift_batch`` on the real
data before training: shifting twice, or not at all, is the mistake that took
the peer's draft to 1.90 in the issue's first try.

The final state: speculators applies the verifier's final norm to it before
the verifier's head. The platform stores it after that norm (``post_norm``,
the transformers backend) or before it (``pre_norm``, the vLLM backend):
:func:`verifier_norm_needed` says which, so a post-norm state is not normed
twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

AUX_STATES = 3


@dataclass(frozen=True)
class StoredSampleRef:
    """Where one sample's rows are: a part file and the token range inside it."""

    file: str
    start: int
    end: int
    sample_id: str

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StoredStates:
    """Every sample of some shards, and what their sidecars say about how they were extracted."""

    samples: list[StoredSampleRef]
    hidden_size: int
    aux_layer_ids: list[int]
    final_state: str  # "post_norm" | "pre_norm"
    target_path: str


def index_shards(shard_dirs: list[str | Path]) -> StoredStates:
    """The samples of every shard from its ``metadata.json`` and part files; shards must agree on how they were extracted."""
    from safetensors import safe_open

    samples: list[StoredSampleRef] = []
    sidecars = []
    for shard in map(Path, shard_dirs):
        sidecar_path = shard / "metadata.json"
        if not sidecar_path.is_file():
            raise FileNotFoundError(f"hidden states {shard}: no metadata.json, the shard is incomplete (materialise hidden_states again)")
        sidecar = json.loads(sidecar_path.read_text())
        sidecars.append(sidecar)
        for entry in sidecar["files"]:
            path = shard / entry["name"]
            with safe_open(str(path), framework="pt") as fh:
                offsets = fh.get_tensor("sample_offsets").tolist()
            if len(offsets) != entry["num_samples"] + 1:
                raise ValueError(f"hidden states {path}: {len(offsets) - 1} samples in sample_offsets, the sidecar says {entry['num_samples']}")
            ids = sidecar["sample_ids"][entry["first_sample"] : entry["first_sample"] + entry["num_samples"]]
            samples += [StoredSampleRef(str(path), offsets[i], offsets[i + 1], str(ids[i])) for i in range(entry["num_samples"])]
    if not samples:
        raise ValueError(f"hidden states {[str(s) for s in shard_dirs]}: no samples")
    for key in ("hidden_size", "aux_layer_ids", "final_state", "target_path"):
        values = {json.dumps(s.get(key)) for s in sidecars}
        if len(values) > 1:
            raise ValueError(f"hidden-state shards disagree on {key}: {sorted(values)}")
    first = sidecars[0]
    return StoredStates(samples, int(first["hidden_size"]), [int(i) for i in first["aux_layer_ids"]], first["final_state"], str(first["target_path"]))


def verifier_norm_needed(final_state: str) -> bool:
    """Whether the stored final state still needs the target's final norm before its head (speculators' ``verifier_norm``)."""
    if final_state == "post_norm":
        return False  # already normed: applying it again is a second RMSNorm, and the peer's targets would be off
    if final_state == "pre_norm":
        return True
    raise ValueError(f"hidden states: final_state {final_state!r}, expected 'post_norm' or 'pre_norm'")


def _rows(handle, name: str, lo: int, hi: int) -> torch.Tensor:
    """Rows of a state tensor as float32; an 8-bit part's codes times its per-row, per-state scales."""
    codes = handle.get_slice(name)[lo:hi]
    scale_name = name.replace("hidden_states", "scales")  # aux_hidden_states -> aux_scales
    if scale_name not in set(handle.keys()):
        return codes.float()
    scales = handle.get_slice(scale_name)[lo:hi].float()
    return (codes.float().reshape(codes.shape[0], scales.shape[1], -1) * scales[..., None]).reshape(codes.shape[0], -1)


def read_sample(ref: StoredSampleRef, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """One sample, unshifted, under speculators' names: what its ``ArrowDataset`` returns for a sample.

    ``hidden_states`` [T, 3H] (the aux states), ``input_ids`` [T], ``verifier_last_hidden_states``
    [T, H] (the final state, as stored), ``loss_mask`` [T] bool; the first ``max_len`` tokens.
    """
    from safetensors import safe_open

    hi = ref.end if max_len is None else min(ref.end, ref.start + max_len)
    with safe_open(ref.file, framework="pt") as fh:
        return {
            "hidden_states": _rows(fh, "aux_hidden_states", ref.start, hi),
            "input_ids": fh.get_slice("input_ids")[ref.start : hi].long(),
            "verifier_last_hidden_states": _rows(fh, "final_hidden_states", ref.start, hi),
            "loss_mask": fh.get_slice("loss_mask")[ref.start : hi] == 1,
        }


def with_lengths(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What speculators' ``BaseDataset.__getitem__`` adds to a raw sample: its length and position ids from 0."""
    length = sample["input_ids"].shape[0]
    return {**sample, "lengths": torch.tensor([length], dtype=torch.long), "position_ids": torch.arange(length, dtype=torch.long)}


def speculators_layout(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The aligned sample speculators trains on: row j = (token j+1, aux of j, final of j+1, mask of j+1), positions from 1."""
    sample = with_lengths(sample) if "lengths" not in sample else sample
    return {
        "input_ids": sample["input_ids"][1:],
        "hidden_states": sample["hidden_states"][:-1],
        "verifier_last_hidden_states": sample["verifier_last_hidden_states"][1:],
        "loss_mask": sample["loss_mask"][1:],
        "lengths": torch.clamp(sample["lengths"] - 1, min=0),
        "position_ids": sample["position_ids"][1:],
    }
