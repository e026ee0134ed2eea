"""Hidden-state extraction: the target's features for EAGLE-3, exact, streamed to disk, resumable.

EAGLE-3 trains on the target's residual stream at three auxiliary layers plus
the final hidden state that the target's ``lm_head`` consumes. This module
writes them per sample shard in the ``hidden_states`` contract (see docs/hidden-states.md
and :data:`TENSOR_ORDER`), whichever backend computes them:

- :class:`TransformersBackend` (this module): the HF model, bf16 with
  ``device_map="auto"`` on GPUs, fp32 on CPU; the final state is
  ``hidden_states[L]`` of transformers, i.e. *after* the final norm
  (``post_norm``);
- :class:`eagle3_assets.core.extraction.vllm_backend.VLLMBackend`: vLLM's
  ``extract_hidden_states`` speculative method, for targets too large for
  transformers; its final state is the last layer's output *before* the norm
  (``pre_norm``). The sidecar says which, and readers apply the target's
  final norm when it says ``pre_norm``, so both feed training the same thing.

Layer ids are in vLLM's convention: id ``k`` is the residual stream *entering*
decoder layer ``k``, which is ``hidden_states[k]`` of transformers'
``output_hidden_states`` (index 0 = the embeddings). An off-by-one here has
been seen to drop acceptance from ~59 % to ~1 % with no error, so the ids are
recorded in the sidecar and checked (:mod:`eagle3_assets.core.extraction.hidden_state_checks`).

Exactness under batching: samples are batched by length with right padding
and an attention mask. Under a causal mask a real token attends only to real
tokens before it, so its states do not depend on what else is in the batch
(up to fp32 rounding of differently shaped matrix products).

Streaming: the parts of a shard are planned up front from the token counts
(split at ``part_bytes``); each part file is created at its final size with
its safetensors header, and each batch's rows are written in place at their
offsets, so memory holds one batch, never a part or a shard. A part becomes
visible by atomic rename once complete; ``metadata.json`` is written last, so
a shard without it is incomplete. A rerun keeps every part whose header says
it holds the planned samples of the same extraction (resume by sample id) and
recomputes the rest.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle3_assets.core.storage.shard_files import ShardFileError, quarantine, read_shard_parquet
from eagle3_assets.core.storage.shard_paths import PART_GLOB, PART_PATTERN, SIDECAR
from eagle3_assets.core.gpu_host.stage_jobs import ExtractionRecipe
from eagle3_assets.core.storage.files import PARTIAL_SUFFIX, atomic_path, file_hash, stable_hash, write_json_atomic
from eagle3_assets.core.target.description import TargetError, checked_layer_ids, read_config, text_config
from eagle3_assets.core.extraction.state_layout import (
    DEFAULT_DTYPE,
    DEFAULT_PART_BYTES,
    FINAL_STATES,
    STORAGE_DTYPE_BYTES,
    bytes_per_token,
    is_scaled,
)

FORMAT_VERSION = 1
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

ProgressCallback = Callable[[dict[str, Any]], None]
SCALES_NOTE = (
    "aux_scales [T, 3] and final_scales [T, 1], float32: a state = its codes x its row's scale "
    "(each state's max-abs is stored as 448)"
)


class ExtractionInputError(ValueError):
    """The traces or the settings cannot be extracted; the message names the input and what is wrong."""


# -- inputs ------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Trace:
    """One validated trace: the token ids the target sees and the mask of what it generated.

    The ids and masks of a shard are views into two flat arrays (int64, int8):
    a shard of 80 M tokens takes 0.7 GB this way, and several GB as Python lists.
    """

    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int8

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def of(cls, sample_id: str, input_ids: Sequence[int], loss_mask: Sequence[int]) -> Trace:
        return cls(sample_id, torch.as_tensor(input_ids, dtype=torch.int64), torch.as_tensor(loss_mask, dtype=torch.int8))


def read_traces(path: Path, vocab_size: int | None = None) -> list[Trace]:
    """The kept rows of a ``validated_traces`` shard, checked against the contract."""
    import polars as pl

    path = Path(path)
    if not path.is_file():
        raise ExtractionInputError(f"validated_traces {path}: no such file (materialise validated_traces for this shard first)")
    try:
        frame = read_shard_parquet(path, asset="validated_traces", columns=["id", "input_ids", "loss_mask"])
    except ShardFileError as exc:  # truncated or damaged: the message names the file, the shard and the fix
        raise ExtractionInputError(str(exc)) from exc
    ids = frame["id"].to_list()
    lengths = frame["input_ids"].list.len().fill_null(0).to_list()
    mask_lengths = frame["loss_mask"].list.len().fill_null(-1).to_list()
    seen: set[str] = set()
    for sample_id, length, mask_length in zip(ids, lengths, mask_lengths):
        where = f"validated_traces {path}: sample {sample_id!r}"
        if not sample_id:
            raise ExtractionInputError(f"validated_traces {path}: a row has an empty id")
        if sample_id in seen:
            raise ExtractionInputError(f"{where}: duplicate id")
        seen.add(sample_id)
        if not length:
            raise ExtractionInputError(f"{where}: no input_ids")
        if mask_length != length:
            raise ExtractionInputError(f"{where}: loss_mask has {max(mask_length, 0)} entries for {length} input_ids")
    if not ids:
        return []
    flat_ids = torch.from_numpy(frame["input_ids"].explode().cast(pl.Int64).to_numpy().copy())
    flat_mask = torch.from_numpy(frame["loss_mask"].explode().cast(pl.Int8).to_numpy().copy())
    if vocab_size is not None and (int(flat_ids.min()) < 0 or int(flat_ids.max()) >= vocab_size):
        bad = int(((flat_ids < 0) | (flat_ids >= vocab_size)).nonzero()[0])
        owner = next(i for i, end in zip(ids, itertools.accumulate(lengths)) if bad < end)
        raise ExtractionInputError(f"validated_traces {path}: sample {owner!r}: token id outside the target's vocabulary of {vocab_size}")
    traces = []
    start = 0
    for sample_id, length in zip(ids, lengths):
        traces.append(Trace(str(sample_id), flat_ids[start : start + length], flat_mask[start : start + length]))
        start += length
    return traces


def traces_digest(traces: Sequence[Trace]) -> str:
    """A content hash of what is extracted (ids, tokens, masks): part of the extraction's identity."""
    digest = hashlib.sha256()
    for trace in traces:
        digest.update(trace.id.encode() + b"\0")
        digest.update(trace.input_ids.contiguous().numpy().tobytes())
        digest.update(trace.loss_mask.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TargetFacts:
    """What the format needs to know about the target, read from its ``config.json``."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_path(cls, target_path: Path | str) -> TargetFacts:
        try:
            text = text_config(read_config(target_path))
        except TargetError as exc:
            raise ExtractionInputError(str(exc)) from None
        return cls(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
        )


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """:func:`~eagle3_assets.core.target.description.checked_layer_ids` (the one check), as an extraction input error."""
    try:
        return checked_layer_ids(layer_ids, num_layers)
    except TargetError as exc:
        raise ExtractionInputError(str(exc)) from None


# -- settings and plan ----------------------------------------------------------


@dataclass(frozen=True)
class ExtractionSettings:
    """Everything that decides what a shard's files contain (the batching does not)."""

    target_path: str
    target_config_hash: str
    aux_layer_ids: tuple[int, ...]
    dtype: str = DEFAULT_DTYPE
    part_bytes: int = DEFAULT_PART_BYTES

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ExtractionInputError(f"dtype {self.dtype!r}: one of {sorted(STORAGE_DTYPES)}")
        if self.part_bytes <= 0:
            raise ExtractionInputError(f"part_bytes {self.part_bytes}: must be positive")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @property
    def storage_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.dtype]

    @property
    def scaled(self) -> bool:
        return is_scaled(self.dtype)

    @property
    def capture_dtype(self) -> torch.dtype:
        """What the backends hand over: the storage dtype, or float32 for 8-bit storage so that it is rounded only once."""
        return torch.float32 if self.scaled else self.storage_dtype


@dataclass(frozen=True)
class PartPlan:
    index: int
    first_sample: int  # position of its first sample in the shard's storage order
    samples: tuple[int, ...]  # indices into the traces, in storage order

    @property
    def name(self) -> str:
        return PART_PATTERN.format(self.index)


def storage_order(traces: Sequence[Trace]) -> list[int]:
    """Samples are stored shortest first (ties by their row in the traces): batches then need little padding."""
    return sorted(range(len(traces)), key=lambda i: (traces[i].num_tokens, i))


def plan_parts(traces: Sequence[Trace], hidden_size: int, dtype: str, part_bytes: int) -> list[PartPlan]:
    """Cut the storage order into parts of at most ``part_bytes`` (a longer sample gets a part of its own)."""
    per_token = bytes_per_token(hidden_size, dtype)
    parts: list[PartPlan] = []
    current: list[int] = []
    current_bytes = 0
    first = 0
    for index in storage_order(traces):
        size = traces[index].num_tokens * per_token + 8
        if current and current_bytes + size > part_bytes:
            parts.append(PartPlan(len(parts), first, tuple(current)))
            first += len(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        parts.append(PartPlan(len(parts), first, tuple(current)))
    return parts


def extraction_key(settings: ExtractionSettings, backend_name: str, final_state: str, digest: str, facts: TargetFacts) -> str:
    """Identity of an extraction: a part or sidecar made under another key is never reused."""
    return stable_hash(
        {
            "format": FORMAT_VERSION,
            "traces": digest,
            "target_config_hash": settings.target_config_hash,
            "aux_layer_ids": list(settings.aux_layer_ids),
            "dtype": settings.dtype,
            "part_bytes": settings.part_bytes,
            "backend": backend_name,
            "final_state": final_state,
            "hidden_size": facts.hidden_size,
            "num_layers": facts.num_layers,
        }
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


class _PartFile:
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


# -- backends ------------------------------------------------------------------------


class CaptureBackend(Protocol):
    """What :func:`extract_shard` needs from a backend."""

    name: str  # "transformers" | "vllm"
    final_state: str  # "post_norm" | "pre_norm"

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Group positions into ``lengths`` (already sorted ascending) into batches, in order."""
        ...

    def capture(self, sequences: Sequence[Sequence[int]], dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, on the CPU in ``dtype``: aux states [T, 3·H] (in layer-id order) and the final state [T, H]."""
        ...


def length_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Consecutive positions whose padded size (count x longest) fits the token budget; a long sample goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for position, length in enumerate(lengths):
        grown = max(longest, length)
        if current and (len(current) >= max_batch_size or (len(current) + 1) * grown > max_batch_tokens):
            batches.append(current)
            current, grown = [], length
        current.append(position)
        longest = grown
    if current:
        batches.append(current)
    return batches


def _from_pretrained_dtype_kwarg() -> str:
    """transformers >= 4.56 takes ``dtype``; older versions silently ignore it and want ``torch_dtype``."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_target(target_path: Path | str, device: str | None = None, dtype: torch.dtype | None = None, trust_remote_code: bool = False):
    """The target as a transformers model: bf16 spread over the GPUs (``device_map="auto"``), or fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    kwargs: dict[str, Any] = {_from_pretrained_dtype_kwarg(): dtype or (torch.bfloat16 if on_gpu else torch.float32)}
    if on_gpu:
        kwargs["device_map"] = "auto" if device in (None, "cuda") else device
    model = AutoModelForCausalLM.from_pretrained(str(target_path), trust_remote_code=trust_remote_code, **kwargs)
    return model.eval()


def decoder_parts(model) -> tuple[torch.nn.Module, Sequence[torch.nn.Module], torch.nn.Module]:
    """The decoder stack, its layers and its final norm (Llama, Qwen, Mistral, DeepSeek families)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise ExtractionInputError(f"target {type(model).__name__}: its decoder has no .layers / .norm; this backend cannot find the layers")
    return decoder, layers, norm


class TransformersBackend:
    """Hidden states from the HF model, captured with hooks at exactly the configured layer ids.

    Id ``k < L`` is the input of decoder layer ``k`` (= ``hidden_states[k]``);
    id ``L`` as an *auxiliary* id is the input of the final norm, as in vLLM.
    The final state is the decoder's output, after the final norm
    (``hidden_states[L]`` of transformers). Only the decoder runs: the logits
    are not needed, so the ``lm_head`` (vocab x H per token) is skipped.
    """

    name = "transformers"
    final_state = "post_norm"

    def __init__(
        self,
        target_path: Path | str,
        aux_layer_ids: Sequence[int],
        recipe: ExtractionRecipe | None = None,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
        model=None,
    ):
        recipe = recipe or ExtractionRecipe()  # batch sizes: the stage's settings, with their one default
        self.target_path = Path(target_path)
        self.model = model if model is not None else load_target(target_path, device, dtype, trust_remote_code)
        self.decoder, layers, norm = decoder_parts(self.model)
        self.num_layers = len(layers)
        self.aux_layer_ids = validate_layer_ids(aux_layer_ids, self.num_layers)
        self.max_batch_tokens = recipe.max_batch_tokens
        self.max_batch_size = recipe.max_batch_size
        self.input_device = self.decoder.get_input_embeddings().weight.device
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        for layer_id in self.aux_layer_ids:
            module = layers[layer_id] if layer_id < self.num_layers else norm
            self._hooks.append(module.register_forward_pre_hook(self._recorder(layer_id), with_kwargs=True))

    def _recorder(self, layer_id: int):
        def record(_module, args, kwargs):
            self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return record

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        return length_batches(lengths, self.max_batch_tokens, self.max_batch_size)

    @torch.inference_mode()
    def capture(self, sequences: Sequence[Sequence[int]], dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lengths = [len(s) for s in sequences]
        width = max(lengths)
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):  # right padding: real tokens never see a pad
            input_ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
            attention_mask[row, : len(sequence)] = 1
        self._captured.clear()
        output = self.decoder(
            input_ids=input_ids.to(self.input_device), attention_mask=attention_mask.to(self.input_device), use_cache=False
        )
        final = output.last_hidden_state
        hidden = final.shape[-1]
        # Cast into one [B, T, 3H] buffer on the device (half the transfer in bf16), then one move to the CPU.
        aux_all = torch.empty((*final.shape[:2], 3 * hidden), dtype=dtype, device=final.device)
        for block, layer_id in enumerate(self.aux_layer_ids):
            aux_all[..., block * hidden : (block + 1) * hidden].copy_(self._captured[layer_id])
        self._captured.clear()
        aux_all, final_all = aux_all.cpu(), final.to(dtype).cpu()
        # Views, no copies: the first `length` rows of a padded row are contiguous.
        return [(aux_all[row, :length], final_all[row, :length]) for row, length in enumerate(lengths)]

    @torch.inference_mode()
    def reference_forward(self, sequence: Sequence[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One unpadded forward of the whole model: logits [T, V] and every ``hidden_states[k]`` (for the checks)."""
        ids = torch.as_tensor(sequence, dtype=torch.long).reshape(1, -1).to(self.input_device)
        output = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        return output.logits[0].float().cpu(), tuple(h[0].float().cpu() for h in output.hidden_states)

    def reference_argmax(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The target's own greedy choice after each position of each sequence (for the checks)."""
        return [self.reference_forward(sequence)[0].argmax(dim=-1) for sequence in sequences]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


# -- the extraction ------------------------------------------------------------------


@dataclass
class ExtractionReport:
    """What a run of :func:`extract_shard` did (for the materialisation's metadata; not stored in the sidecar)."""

    shard_dir: Path
    samples: int
    tokens: int
    parts: int
    parts_written: int
    parts_reused: int
    tokens_computed: int
    compute_s: float
    wall_s: float
    bytes_on_disk: int
    sidecar: dict[str, Any] = field(default_factory=dict)
    parts_quarantined: int = 0  # damaged parts moved aside (``*.corrupt-<time>``) and extracted again

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_computed / self.wall_s if self.wall_s > 0 else 0.0


def _remove_stale_partials(shard_dir: Path) -> int:
    """Temporary files of an interrupted run (ours only: this directory belongs to this shard's stage)."""
    removed = 0
    for path in shard_dir.iterdir():
        if path.name.startswith(".") and path.name.endswith(PARTIAL_SUFFIX):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _part_metadata(key: str, part: PartPlan, sample_ids: list[str]) -> dict[str, str]:
    return {
        "format": str(FORMAT_VERSION),
        "extraction_key": key,
        "part_index": str(part.index),
        "first_sample": str(part.first_sample),
        "sample_ids": json.dumps(sample_ids, ensure_ascii=False),
    }


def _write_part(
    path: Path,
    part: PartPlan,
    traces: Sequence[Trace],
    backend: CaptureBackend,
    settings: ExtractionSettings,
    facts: TargetFacts,
    metadata: dict[str, str],
    on_batch: Callable[[int], None],
) -> None:
    samples = [traces[i] for i in part.samples]
    lengths = [t.num_tokens for t in samples]
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    total = offsets[-1]
    H, dtype = facts.hidden_size, settings.storage_dtype
    layout = {
        "sample_offsets": (torch.int64, (len(samples) + 1,)),
        "input_ids": (torch.int64, (total,)),
        "aux_hidden_states": (dtype, (total, 3 * H)),
        "final_hidden_states": (dtype, (total, H)),
        "loss_mask": (torch.int8, (total,)),
    }
    if settings.scaled:
        layout["aux_scales"] = (torch.float32, (total, 3))
        layout["final_scales"] = (torch.float32, (total, 1))
    with atomic_path(path) as tmp:
        part_file = _PartFile(tmp, layout, metadata)
        try:
            part_file.write_rows("sample_offsets", 0, torch.tensor(offsets, dtype=torch.int64))
            part_file.write_rows("input_ids", 0, torch.cat([t.input_ids for t in samples]))
            part_file.write_rows("loss_mask", 0, torch.cat([t.loss_mask for t in samples]))
            for batch in backend.batches(lengths):
                states = backend.capture([samples[i].input_ids for i in batch], settings.capture_dtype)
                for position, (aux, final) in zip(batch, states):
                    want = (lengths[position], 3 * H)
                    if tuple(aux.shape) != want or tuple(final.shape) != (lengths[position], H):
                        raise RuntimeError(
                            f"{backend.name} backend returned aux {tuple(aux.shape)} / final {tuple(final.shape)} "
                            f"for sample {samples[position].id} of {lengths[position]} tokens (expected {want} / {want[0], H})"
                        )
                for position, (aux, final) in zip(batch, states):  # each straight from the batch's buffer, no copy
                    if settings.scaled:  # the one shared writer quantises, so both backends store the same codes
                        aux, aux_scales = quantise_rows(aux, H, dtype)
                        final, final_scales = quantise_rows(final, H, dtype)
                        part_file.write_rows("aux_scales", offsets[position], aux_scales)
                        part_file.write_rows("final_scales", offsets[position], final_scales)
                    part_file.write_rows("aux_hidden_states", offsets[position], aux)
                    part_file.write_rows("final_hidden_states", offsets[position], final)
                on_batch(sum(lengths[i] for i in batch))
        finally:
            part_file.close()


def extract_shard(
    traces: Sequence[Trace],
    shard_dir: Path,
    settings: ExtractionSettings,
    backend: CaptureBackend,
    *,
    on_event: ProgressCallback | None = None,
) -> ExtractionReport:
    """Write the shard's part files and then its sidecar, keeping durable parts of the same extraction.

    ``on_event`` receives ``{"event": "start" | "batch" | "part" | "done", ...}``
    dicts (progress for the run log).
    """
    started = time.monotonic()
    emit = on_event or (lambda _event: None)
    if not traces:
        raise ExtractionInputError(f"hidden_states {shard_dir}: the shard has no traces to extract")
    if backend.final_state not in FINAL_STATES:
        raise ExtractionInputError(f"backend {backend.name}: final_state {backend.final_state!r} not in {FINAL_STATES}")
    facts = TargetFacts.from_path(settings.target_path)
    validate_layer_ids(settings.aux_layer_ids, facts.num_layers)
    shard_dir = Path(shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(shard_dir)

    key = extraction_key(settings, backend.name, backend.final_state, traces_digest(traces), facts)
    sidecar_path = shard_dir / SIDECAR
    recorded: dict[str, str] = {}  # part name -> the sha256 the sidecar of this same extraction recorded
    if sidecar_path.is_file():
        try:
            previous = json.loads(sidecar_path.read_text())
        except ValueError:
            previous = {}
        if previous.get("extraction_key") != key:
            sidecar_path.unlink()  # the shard reads as incomplete while it is redone
        else:
            recorded = {f["name"]: f["sha256"] for f in previous.get("files", []) if f.get("sha256")}
    plan = plan_parts(traces, facts.hidden_size, settings.dtype, settings.part_bytes)
    total_tokens = sum(t.num_tokens for t in traces)
    emit({"event": "start", "samples": len(traces), "tokens": total_tokens, "parts": len(plan), "key": key})

    written = reused = computed = quarantined = 0
    compute_s = 0.0
    checksums: dict[str, str] = {}

    def set_aside(path: Path, why: str) -> None:
        nonlocal quarantined
        sidecar_path.unlink(missing_ok=True)  # the shard reads as incomplete until the part is rebuilt
        quarantine(path, lambda line: emit({"event": "quarantined", "part": path.name, "line": line}), why)
        quarantined += 1

    for part in plan:
        sample_ids = [traces[i].id for i in part.samples]
        metadata = _part_metadata(key, part, sample_ids)
        path = shard_dir / part.name
        header = part_header(path)
        if header == metadata:
            digest = file_hash(path, length=64)
            expected = recorded.get(part.name)
            if expected is None or digest == expected:  # no record: a part of an interrupted run, checked by the gates
                checksums[part.name] = digest
                reused += 1
                emit({"event": "part", "part": part.name, "reused": True, "samples": len(sample_ids)})
                continue
            set_aside(path, f"its sha256 {digest[:16]}... differs from the {expected[:16]}... {SIDECAR} recorded")
        elif header is None and path.exists():
            set_aside(path, "it is not a readable safetensors file (truncated or damaged)")
        part_started = time.monotonic()

        def on_batch(tokens: int) -> None:
            nonlocal computed
            computed += tokens
            emit({"event": "batch", "tokens_done": computed, "elapsed_s": time.monotonic() - started})

        _write_part(path, part, traces, backend, settings, facts, metadata, on_batch)
        checksums[part.name] = file_hash(path, length=64)
        compute_s += time.monotonic() - part_started
        written += 1
        emit({"event": "part", "part": part.name, "reused": False, "samples": len(sample_ids)})

    planned = {part.name for part in plan}
    for stale in shard_dir.glob(PART_GLOB):
        if stale.name not in planned:
            stale.unlink()

    order = [i for part in plan for i in part.samples]
    sidecar = {
        "format": FORMAT_VERSION,
        "backend": backend.name,
        "target_path": str(settings.target_path),
        "target_config_hash": settings.target_config_hash,
        "num_layers": facts.num_layers,
        "hidden_size": facts.hidden_size,
        "vocab_size": facts.vocab_size,
        "aux_layer_ids": list(settings.aux_layer_ids),
        "final_state": backend.final_state,
        "dtype": settings.dtype,
        **({"scales": SCALES_NOTE} if settings.scaled else {}),
        "sample_ids": [traces[i].id for i in order],
        "num_tokens": [traces[i].num_tokens for i in order],
        # Readers (training) verify each part against its checksum: a damaged part fails naming the file.
        "files": [
            {"name": part.name, "first_sample": part.first_sample, "num_samples": len(part.samples), "sha256": checksums[part.name]}
            for part in plan
        ],
        "total_tokens": total_tokens,
        "storage_order": "by length, then row of validated_traces",
        "extraction_key": key,
    }
    write_json_atomic(sidecar_path, sidecar)
    report = ExtractionReport(
        shard_dir=shard_dir,
        samples=len(traces),
        tokens=total_tokens,
        parts=len(plan),
        parts_written=written,
        parts_reused=reused,
        parts_quarantined=quarantined,
        tokens_computed=computed,
        compute_s=compute_s,
        wall_s=time.monotonic() - started,
        bytes_on_disk=shard_bytes(shard_dir),
        sidecar=sidecar,
    )
    emit({"event": "done", "report": report})
    return report


# -- reading -------------------------------------------------------------------------


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
