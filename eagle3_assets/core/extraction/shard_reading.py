"""Reading a complete ``hidden_states`` shard: its sidecar (refusing another format or other layers) and its samples.

Dagster-free; memory holds one sample at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.core.extraction.part_files import PartStates, open_part
from eagle3_assets.core.extraction.state_layout import FINAL_STATES, FORMAT_VERSION, STORAGE_DTYPE_BYTES
from eagle3_assets.core.storage.shard_paths import PART_GLOB, SIDECAR


def shard_bytes(shard_dir: Path) -> int:
    """Bytes of a shard as stored: its part files and its sidecar."""
    shard_dir = Path(shard_dir)
    return sum(p.stat().st_size for p in shard_dir.glob(PART_GLOB)) + (
        (shard_dir / SIDECAR).stat().st_size if (shard_dir / SIDECAR).is_file() else 0
    )


def read_sidecar(shard_dir: Path, expected_layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """A complete shard's sidecar; with ``expected_layer_ids``, refuse states taken at other layers."""
    path = Path(shard_dir) / SIDECAR
    if not path.is_file():
        raise FileNotFoundError(f"hidden_states {shard_dir}: no {SIDECAR}, the shard is incomplete (re-run hidden_states)")
    sidecar = json.loads(path.read_text())
    if sidecar.get("format") != FORMAT_VERSION:
        raise ValueError(f"hidden_states {path}: format {sidecar.get('format')!r}, this code reads {FORMAT_VERSION}")
    if sidecar.get("final_state") not in FINAL_STATES:
        raise ValueError(f"hidden_states {path}: final_state {sidecar.get('final_state')!r}, expected one of {FINAL_STATES}")
    if sidecar.get("dtype") not in STORAGE_DTYPE_BYTES:
        raise ValueError(f"hidden_states {path}: dtype {sidecar.get('dtype')!r}, this code reads {sorted(STORAGE_DTYPE_BYTES)}")
    if expected_layer_ids is not None and list(sidecar.get("aux_layer_ids") or []) != list(expected_layer_ids):
        raise ValueError(
            f"hidden_states {path}: aux_layer_ids {sidecar.get('aux_layer_ids')} but {list(expected_layer_ids)} were expected "
            "(vLLM's convention); states from other layers would train a draft that vLLM feeds differently"
        )
    return sidecar


@dataclass
class StoredSample:
    id: str
    aux: torch.Tensor  # [T, 3H], as stored (float32 when stored in 8 bits, dequantised)
    final: torch.Tensor  # [T, H], pre- or post-norm as the sidecar says
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int8


def iter_samples(shard_dir: Path, only: set[str] | None = None) -> Iterator[StoredSample]:
    """The stored samples one at a time, in storage order (memory: one sample)."""
    shard_dir = Path(shard_dir)
    sidecar = read_sidecar(shard_dir)
    ids = sidecar["sample_ids"]
    for entry in sidecar["files"]:
        with open_part(shard_dir / entry["name"]) as handle:
            offsets = handle.get_tensor("sample_offsets").tolist()
            states = PartStates(handle)
            input_ids, loss_mask = handle.get_slice("input_ids"), handle.get_slice("loss_mask")
            for j in range(entry["num_samples"]):
                sample_id = ids[entry["first_sample"] + j]
                if only is not None and sample_id not in only:
                    continue
                lo, hi = offsets[j], offsets[j + 1]
                yield StoredSample(
                    id=sample_id,
                    aux=states.aux(lo, hi),
                    final=states.final(lo, hi),
                    input_ids=input_ids[lo:hi],
                    loss_mask=loss_mask[lo:hi],
                )
