"""The hidden-state shards as an index of samples, token-budget micro-batches, and an epoch's batch plan.

The batch plan of an epoch is a pure function of (seed, epoch), and a
micro-batch's loss is its own mean: a run with W processes and A accumulation
micro-batches per step sees exactly the batches of a run with 1 process and
W*A micro-batches, so 1 process and W processes follow the same loss curve.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from eagle3_assets.core.extraction.part_files import PartStates, open_part, verify_part
from eagle3_assets.core.storage.files import file_hash, stable_hash
from eagle3_assets.core.training.config import TrainConfig


# A refinement round's anchors beside an on-policy shard's parts (core/refinement/anchors.py writes it): one int8
# tensor [tokens, k] per sample id, where the server accepted or first rejected each chain's proposals.
ANCHORS_FILE = "anchors.safetensors"


@dataclass(frozen=True)
class Sample:
    file: str
    start: int  # token offsets inside the file
    end: int
    sample_id: str
    anchors_file: str | None = None  # its shard's ANCHORS_FILE, where it has one

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
    dtypes: list[str] = field(default_factory=list)  # the storage precisions of the shards (8-bit ones are dequantised to float32)
    mix: dict | None = None  # a refinement round's (mixed_index): how many on-policy and supervised samples it holds


def index_hidden_states(shard_dirs: list[str | Path]) -> HiddenStateIndex:
    """Every sample of every shard, from the sidecars; shards must agree on how they were extracted."""
    samples: list[Sample] = []
    sidecars = []
    anchors = {}  # shard -> its anchors file's hash: in the fingerprint (a round re-anchored is another run)
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
        anchors_file = shard / ANCHORS_FILE
        if anchors_file.is_file():
            anchors[str(shard)] = file_hash(anchors_file)
        for entry in meta["files"]:
            path = shard / entry["name"]
            verify_part(path, entry.get("sha256"))  # once, here: a damaged part fails naming the file, not mid-epoch
            with open_part(path) as fh:
                offsets = fh.get_tensor("sample_offsets").tolist()
            if len(offsets) != entry["num_samples"] + 1:
                raise ValueError(f"hidden states {path}: {len(offsets) - 1} samples in sample_offsets, sidecar says {entry['num_samples']}")
            ids = meta["sample_ids"][entry["first_sample"] : entry["first_sample"] + entry["num_samples"]]
            anchored = str(anchors_file) if str(shard) in anchors else None
            samples += [Sample(str(path), offsets[i], offsets[i + 1], str(ids[i]), anchored) for i in range(entry["num_samples"])]
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
        fingerprint=stable_hash({"sidecars": sidecars, "anchors": anchors}) if anchors else stable_hash(sidecars),
        dtypes=sorted({str(m.get("dtype")) for m in sidecars}),
    )


def mixed_index(on_policy_dirs: list[str | Path], supervised_dirs: list[str | Path], supervised_share: float, seed: int) -> HiddenStateIndex:
    """Every sample of ``on_policy_dirs`` and ``round(supervised_share * n)`` of the ``n`` of ``supervised_dirs``,
    drawn with ``seed``, in their stored order: a refinement round's data, on-policy with some of the supervised.

    The shards must agree on how they were extracted (:func:`index_hidden_states` checks); the index's fingerprint
    covers every sidecar and which supervised samples were drawn, so another share or draw is another run.
    """
    index = index_hidden_states([*on_policy_dirs, *supervised_dirs])
    supervised_parents = {str(Path(d)) for d in supervised_dirs}
    is_supervised = [str(Path(s.file).parent) in supervised_parents for s in index.samples]
    supervised_positions = [i for i, flag in enumerate(is_supervised) if flag]
    drawn = sorted(random.Random(seed).sample(supervised_positions, round(supervised_share * len(supervised_positions))))
    keep = set(drawn)
    index.samples = [s for i, s in enumerate(index.samples) if not is_supervised[i] or i in keep]
    if not index.samples:
        raise ValueError(f"hidden states: no samples in {[str(d) for d in on_policy_dirs]} and none drawn from the supervised shards")
    index.fingerprint = stable_hash({"sidecars": index.fingerprint, "supervised_share": supervised_share, "drawn": drawn})
    index.mix = {"on_policy_samples": len(is_supervised) - len(supervised_positions), "supervised_samples": len(drawn),
                 "supervised_available": len(supervised_positions), "supervised_share": supervised_share}  # fmt: skip
    return index


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, 3*H] float32
    final: torch.Tensor  # [B, T, H]
    input_ids: torch.Tensor  # [B, T] int64, 0 after a sample's end
    loss_mask: torch.Tensor  # [B, T] bool, False after a sample's end
    num_tokens: int
    documents: torch.Tensor | None = None  # packed ([1, T]): each token's sample, counted from 0; None: one sample a row
    anchors: torch.Tensor | None = None  # [B, T, k] int8, a refinement round's (0 where a sample has none); None: no sample has

    def to(self, device: torch.device) -> Batch:
        documents = self.documents.to(device) if self.documents is not None else None
        anchors = self.anchors.to(device) if self.anchors is not None else None
        return Batch(
            self.aux.to(device), self.final.to(device), self.input_ids.to(device), self.loss_mask.to(device), self.num_tokens, documents, anchors
        )


def load_anchors(samples: list[Sample], lengths: list[int]) -> list[torch.Tensor] | None:
    """Each sample's anchors [length, k] (zeros for one without: its shard has none, or none for it); None when no
    sample's shard has any."""
    if not any(s.anchors_file for s in samples):
        return None
    read: dict[int, torch.Tensor] = {}
    k = 0
    for path in {s.anchors_file for s in samples if s.anchors_file}:
        with safe_open(path, framework="pt") as fh:
            held = set(fh.keys())
            k = max([k, *(fh.get_slice(key).get_shape()[1] for key in held)])
            for i, s in enumerate(samples):
                if s.anchors_file == path and s.sample_id in held:
                    read[i] = fh.get_slice(s.sample_id)[: lengths[i]]
    return [F.pad(read[i], (0, k - read[i].shape[1])) if i in read else torch.zeros(n, k, dtype=torch.int8) for i, n in enumerate(lengths)]


def load_batch(samples: list[Sample], max_seq_len: int, packed: bool = False) -> Batch:
    """Read the samples' tensors (slices only, never whole files): right-padded rows, or with ``packed`` one row of
    the samples end to end with each token's sample in ``documents``."""
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
    anchors = load_anchors(samples, lengths)
    if packed:
        columns = [torch.cat([loaded[i][n] for i in range(len(samples))]) for n in range(4)]
        documents = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
        aux, final, ids, mask = columns
        packed_anchors = torch.cat(anchors)[None] if anchors is not None else None
        return Batch(aux.float()[None], final.float()[None], ids.long()[None], (mask.long() == 1)[None], sum(lengths), documents[None], packed_anchors)
    for i in range(len(samples)):
        aux, final, ids, mask = loaded[i]
        pad = width - lengths[i]
        rows["aux"].append(F.pad(aux.float(), (0, 0, 0, pad)))
        rows["final"].append(F.pad(final.float(), (0, 0, 0, pad)))
        rows["ids"].append(F.pad(ids.long(), (0, pad)))
        rows["mask"].append(F.pad(mask.long(), (0, pad)) == 1)
    padded_anchors = torch.stack([F.pad(a, (0, 0, 0, width - a.shape[0])) for a in anchors]) if anchors is not None else None
    return Batch(
        torch.stack(rows["aux"]), torch.stack(rows["final"]), torch.stack(rows["ids"]), torch.stack(rows["mask"]), sum(lengths), None, padded_anchors
    )


# --------------------------------------------------------------------------- batch plan


def epoch_micro_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, packed: bool = False) -> list[list[int]]:
    """Samples grouped into micro-batches of at most ``batch_tokens`` tokens, in a shuffled order.

    Padded (``packed`` false), a micro-batch costs its longest sample times its
    samples, so similar lengths go together (little padding); ties are broken
    randomly so that an epoch's batches differ from the last one's. Packed
    (``load_batch(packed=True)``), it costs its tokens alone: the samples are
    taken in a shuffled order, each into the first micro-batch with room for
    it (first fit: filling only the newest one would leave each a sample's
    worth short). A sample longer than ``batch_tokens`` is a micro-batch of its own.
    """
    rng = random.Random(f"{seed}:{epoch}")
    batches = first_fit(lengths, batch_tokens, rng) if packed else similar_lengths(lengths, batch_tokens, rng)
    rng.shuffle(batches)
    return batches


def similar_lengths(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Samples sorted by length (ties in a random order), cut into groups whose padded size fits ``batch_tokens``."""
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
    return batches


def first_fit(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Samples in a random order, each into the first group with room for its tokens (a new group where none has)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    room: list[int] = []
    shortest = min(lengths, default=0)
    open_rows: list[int] = []  # groups with room for at least the shortest sample, oldest first
    for i in order:
        row = next((r for r in open_rows if room[r] >= lengths[i]), None)
        if row is None:
            row = len(batches)
            batches.append([])
            room.append(batch_tokens)
            open_rows.append(row)
        batches[row].append(i)
        room[row] -= lengths[i]
        if room[row] < shortest:
            open_rows.remove(row)
    return batches


def epoch_steps(lengths: list[int], config: TrainConfig, world_size: int, epoch: int) -> list[list[list[int]]]:
    """The epoch's optimizer steps, each a list of ``world_size * grad_accumulation`` micro-batches.

    The last step is filled up with the epoch's first micro-batches, so that
    every process runs the same number of steps and no sample is dropped.
    """
    micro = epoch_micro_batches(lengths, config.batch_tokens, config.seed, epoch, config.pack_samples)
    per_step = world_size * config.grad_accumulation
    epoch_order = list(micro)
    while len(micro) % per_step:
        micro.append(epoch_order[(len(micro) - len(epoch_order)) % len(epoch_order)])
    return [micro[i : i + per_step] for i in range(0, len(micro), per_step)]



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

