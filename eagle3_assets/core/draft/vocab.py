"""The draft vocabulary: which target tokens the draft can propose, and how its ids map back.

An EAGLE-3 draft predicts over a small vocabulary (e.g. 32k of a 160k target
vocabulary): the tokens the target actually writes. We count target token ids
where ``loss_mask == 1`` (the tokens the target generated itself), keep the
``draft_vocab_size`` most frequent (ties broken by the smaller id, so the map
is deterministic), and sort them by id. vLLM's form of the map:

- ``d2t`` int64 ``[draft_vocab]``: offsets, the target id of draft id ``i`` is
  ``i + d2t[i]`` (vLLM adds ``arange(draft_vocab)`` itself);
- ``t2d`` bool ``[target_vocab]``: which target ids are in the draft vocabulary
  (shipped beside ``d2t`` by convention; vLLM ignores it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.core.storage.shard_paths import VOCAB_MAPPING_FILE
from eagle3_assets.core.storage.files import atomic_path, write_json_atomic

if TYPE_CHECKING:  # polars is imported where traces are counted: training reads the mapping, not the traces
    import polars as pl

MAPPING_FILE = VOCAB_MAPPING_FILE
SUMMARY_FILE = "vocab_mapping.json"


@dataclass(frozen=True)
class VocabMapping:
    d2t: torch.Tensor  # int64 [draft_vocab]: target id = i + d2t[i]
    t2d: torch.Tensor  # bool [target_vocab]

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of every draft id, ascending."""
        return torch.arange(self.draft_vocab_size, dtype=torch.int64) + self.d2t


def count_supervised_tokens(traces: pl.DataFrame, target_vocab_size: int) -> torch.Tensor:
    """How often each target id occurs where ``loss_mask == 1``, over rows with ``input_ids``/``loss_mask`` lists."""
    import polars as pl

    missing = {"input_ids", "loss_mask"} - set(traces.columns)
    if missing:
        raise ValueError(f"traces lack the columns {sorted(missing)}")
    lengths_differ = traces.filter(pl.col("input_ids").list.len() != pl.col("loss_mask").list.len())
    if lengths_differ.height:
        first = lengths_differ.row(0, named=True)
        raise ValueError(f"{lengths_differ.height} rows have input_ids and loss_mask of different lengths (e.g. id {first.get('id')!r})")
    supervised = (
        traces.select("input_ids", "loss_mask")
        .explode("input_ids", "loss_mask")
        .filter(pl.col("loss_mask") == 1)
        .group_by("input_ids")
        .len()
    )
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    if supervised.height:
        ids = torch.as_tensor(supervised["input_ids"].cast(pl.Int64).to_numpy().copy())
        if ids.min() < 0 or ids.max() >= target_vocab_size:
            raise ValueError(f"token id {int(ids.max())} outside the target vocabulary of {target_vocab_size}")
        counts[ids] = torch.as_tensor(supervised["len"].cast(pl.Int64).to_numpy().copy())
    return counts


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> VocabMapping:
    """The ``draft_vocab_size`` most frequent ids (ties by id), sorted by id, as ``d2t``/``t2d``."""
    target_vocab_size = int(counts.numel())
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{target_vocab_size} (the target vocabulary)")
    # A stable sort on descending counts keeps equal counts in ascending id order.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    draft_to_target = torch.sort(order[:draft_vocab_size]).values
    d2t = draft_to_target - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return VocabMapping(d2t=d2t, t2d=t2d)


def coverage(counts: torch.Tensor, mapping: VocabMapping) -> float:
    """Share of supervised target tokens that the draft vocabulary contains (1.0 when nothing is supervised)."""
    total = int(counts.sum())
    return float(counts[mapping.t2d].sum()) / total if total else 1.0


def save_vocab_mapping(out_dir: Path, mapping: VocabMapping, summary: dict) -> Path:
    """Write ``vocab_mapping.safetensors`` and then ``vocab_mapping.json`` (the summary), atomically."""
    out_dir = Path(out_dir)
    path = out_dir / MAPPING_FILE
    with atomic_path(path) as tmp:
        save_file({"d2t": mapping.d2t.contiguous(), "t2d": mapping.t2d.contiguous()}, str(tmp))
    write_json_atomic(
        out_dir / SUMMARY_FILE,
        {**summary, "draft_vocab_size": mapping.draft_vocab_size, "target_vocab_size": mapping.target_vocab_size},
    )
    return path


def load_vocab_mapping(path: Path) -> VocabMapping:
    """Read a mapping file (or the directory holding one) and check that ``d2t`` and ``t2d`` agree."""
    path = Path(path)
    if path.is_dir():
        path = path / MAPPING_FILE
    if not path.is_file():
        raise FileNotFoundError(f"vocab mapping {path} does not exist: materialise vocab_mapping first")
    tensors = load_file(str(path))
    missing = {"d2t", "t2d"} - tensors.keys()
    if missing:
        raise ValueError(f"vocab mapping {path} lacks {sorted(missing)}")
    mapping = VocabMapping(d2t=tensors["d2t"].to(torch.int64), t2d=tensors["t2d"].to(torch.bool))
    targets = mapping.draft_to_target
    if (
        targets.min() < 0
        or targets.max() >= mapping.target_vocab_size
        or not bool((targets[1:] > targets[:-1]).all())
        or int(mapping.t2d.sum()) != mapping.draft_vocab_size
        or not bool(mapping.t2d[targets].all())
    ):
        raise ValueError(f"vocab mapping {path}: d2t and t2d do not describe the same sorted set of target ids")
    return mapping
