"""A hidden-state part file: a safetensors file laid out up front, written row by row in place, and read back.

The tensors of a part and their order (:data:`TENSOR_ORDER`), the 8-bit
storage's codes and per-row scales, the writer that puts each batch's rows at
their offsets (memory holds one batch, never a part), and the reader's checks:
a part is verified against the checksum its shard's sidecar recorded, and a
part that cannot be read is named with the fix. Dagster-free.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.core.extraction.state_layout import STORAGE_DTYPE_BYTES
from eagle3_assets.core.storage.files import file_hash
from eagle3_assets.core.storage.shard_paths import SIDECAR

STORAGE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in STORAGE_DTYPE_BYTES}
_SAFETENSORS_DTYPE = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int8: "I8",
}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: each row's largest magnitude is stored as this code

# Order of the tensors inside a part file: the int64 ones first, then the float32
# scales (8-bit storage only), so that every tensor starts at an offset aligned to
# its element size.
TENSOR_ORDER = ("sample_offsets", "input_ids", "aux_scales", "final_scales", "aux_hidden_states", "final_hidden_states", "loss_mask")

SCALES_NOTE = (
    "aux_scales [T, 3] and final_scales [T, 1], float32: a state = its codes x its row's scale "
    "(each state's max-abs is stored as 448)"
)


# -- 8-bit storage: codes and a scale per token and state ---------------------------


def quantise_rows(states: torch.Tensor, hidden_size: int, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, k·H]`` states -> ``[T, k·H]`` codes in ``dtype`` and ``[T, k]`` float32 scales (max-abs of each state -> 448).

    A row holding NaN or Inf gets a non-finite scale, so it reads back as NaN
    and ``states_finite`` still sees it (an 8-bit code has no Inf to keep).
    """
    rows = states.float().reshape(states.shape[0], -1, hidden_size)
    amax = rows.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scales = torch.where(torch.isfinite(amax), scales, amax + float("nan"))
    codes = (rows / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return codes.reshape(states.shape[0], -1), scales


def dequantise_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[T, k·H]`` from codes ``[T, k·H]`` and scales ``[T, k]`` (the state width follows from the shapes)."""
    rows = codes.float().reshape(codes.shape[0], scales.shape[1], -1)
    return (rows * scales.float()[..., None]).reshape(codes.shape[0], -1)


class PartStates:
    """Rows of an open part's states as the trainer and the gates use them: as stored, or dequantised to float32.

    Part files say themselves whether they are scaled (``aux_scales`` present),
    so a reader never needs the sidecar to interpret the bytes.
    """

    def __init__(self, handle):
        self._aux = handle.get_slice("aux_hidden_states")
        self._final = handle.get_slice("final_hidden_states")
        self.scaled = "aux_scales" in set(handle.keys())
        if self.scaled:
            self._aux_scales = handle.get_slice("aux_scales")
            self._final_scales = handle.get_slice("final_scales")

    def aux(self, lo: int, hi: int) -> torch.Tensor:
        return dequantise_rows(self._aux[lo:hi], self._aux_scales[lo:hi]) if self.scaled else self._aux[lo:hi]

    def final(self, lo: int, hi: int) -> torch.Tensor:
        return dequantise_rows(self._final[lo:hi], self._final_scales[lo:hi]) if self.scaled else self._final[lo:hi]


# -- part files: safetensors written in place --------------------------------------


class PartFileWriter:
    """A safetensors file whose layout is fixed up front and whose rows are written in place.

    The header (shapes, dtypes, offsets, the part's metadata) is written first
    and the file is extended to its final size; :meth:`write_rows` then puts
    rows at their offsets as batches come. The result is an ordinary
    safetensors file, readable (and memory-mappable) by any safetensors reader.
    """

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        if sys.byteorder != "little":
            raise RuntimeError("safetensors files are little-endian; this writer copies memory as it is")
        header: dict[str, Any] = {"__metadata__": metadata}
        self.slots: dict[str, tuple[int, int, int, torch.dtype]] = {}  # name -> (start, end, bytes per row, dtype)
        offset = 0
        for name in (n for n in TENSOR_ORDER if n in layout):
            dtype, shape = layout[name]
            row_numel = 1
            for dim in shape[1:]:
                row_numel *= dim
            row_bytes = row_numel * dtype.itemsize
            nbytes = shape[0] * row_bytes
            header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.slots[name] = (offset, offset + nbytes, row_bytes, dtype)
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self.data_start = 8 + len(blob)
        self.size = self.data_start + offset
        self.fd = os.open(path, os.O_RDWR)
        os.ftruncate(self.fd, self.size)
        _pwrite_all(self.fd, struct.pack("<Q", len(blob)) + blob, 0)

    def write_rows(self, name: str, first_row: int, tensor: torch.Tensor) -> None:
        start, end, row_bytes, dtype = self.slots[name]
        if tensor.dtype != dtype:
            raise TypeError(f"{name}: got {tensor.dtype}, the part holds {dtype}")
        if tensor.numel() == 0:
            return
        payload = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        at = start + first_row * row_bytes
        if at + payload.nbytes > end:
            raise ValueError(f"{name}: rows from {first_row} ({payload.nbytes} bytes) run past the end of the tensor")
        _pwrite_all(self.fd, payload, self.data_start + at)

    def close(self) -> None:
        os.close(self.fd)


def _pwrite_all(fd: int, payload, position: int) -> None:
    view = memoryview(payload).cast("B")
    written = 0
    while written < view.nbytes:
        written += os.pwrite(fd, view[written:], position + written)


def part_header(path: Path) -> dict[str, str] | None:
    """The string metadata of a part file's header, or None when the file is missing or unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except Exception:  # a truncated or foreign file is simply not reusable
        return None


class HiddenStateFileError(ValueError):
    """A part file is missing, truncated or not what its shard's sidecar recorded; the message names it and the fix."""


def _part_fix(path: Path) -> str:
    return f"rerun hidden_states for {path.parent.name}: the part will be quarantined and extracted again"


_verified_parts: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256: each part is hashed once per process


def verify_part(path: Path, expected_sha256: str | None) -> None:
    """Check a part against the checksum its sidecar recorded (sidecars from before checksums record none)."""
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise HiddenStateFileError(f"hidden_states {path.parent.name}: part {path} is missing; {_part_fix(path)}") from None
    if not expected_sha256:
        return
    cache_key = (str(path), stat.st_size, stat.st_mtime_ns)
    digest = _verified_parts.get(cache_key) or file_hash(path, length=64)
    if digest != expected_sha256:
        raise HiddenStateFileError(
            f"hidden_states {path.parent.name}: part {path} has sha256 {digest[:16]}... but {SIDECAR} recorded "
            f"{expected_sha256[:16]}... (damaged after it was written); {_part_fix(path)}"
        )
    _verified_parts[cache_key] = digest


@contextmanager
def open_part(path: Path) -> Iterator[Any]:
    """``safe_open`` of a part, with an error naming the file when it is truncated or not safetensors at all."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # SafetensorError for a truncated file, OSError for a missing one
        raise HiddenStateFileError(
            f"hidden_states {Path(path).parent.name}: part {path} cannot be read ({type(exc).__name__}: {exc}); {_part_fix(Path(path))}"
        ) from exc
    with handle:
        yield handle


