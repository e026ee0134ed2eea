"""Hidden-state extraction: the target's features for EAGLE-3, exact, streamed to disk, resumable.

EAGLE-3 trains on the target's residual stream at three auxiliary layers plus
the final hidden state that the target's ``lm_head`` consumes. This module
writes them per sample shard in the ``hidden_states`` contract (see docs/hidden-states.md
and :data:`~eagle3_assets.core.extraction.part_files.TENSOR_ORDER`), whichever backend computes them
(each registered in :mod:`eagle3_assets.core.extraction.backends`, which says what a backend must do):

- :class:`~eagle3_assets.core.extraction.transformers_backend.TransformersBackend`: the HF model, bf16 with
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

The concepts live in their own modules: the inputs (:mod:`.traces`), the part
files and their 8-bit storage (:mod:`.part_files`), the transformers backend
(:mod:`.transformers_backend`; vLLM's is :mod:`.vllm_backend`), reading a
complete shard (:mod:`.shard_reading`). This one plans a shard's parts and
writes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.core.extraction.part_files import PartFileWriter, SCALES_NOTE, STORAGE_DTYPES, part_header, quantise_rows
from eagle3_assets.core.extraction.shard_reading import shard_bytes
from eagle3_assets.core.extraction.state_layout import DEFAULT_DTYPE, DEFAULT_PART_BYTES, FINAL_STATES, FORMAT_VERSION, bytes_per_token, is_scaled
from eagle3_assets.core.extraction.traces import ExtractionInputError, TargetFacts, Trace, traces_digest, validate_layer_ids
from eagle3_assets.core.extraction.backends import CaptureBackend
from eagle3_assets.core.storage.files import PARTIAL_SUFFIX, atomic_path, file_hash, stable_hash, write_json_atomic
from eagle3_assets.core.storage.shard_files import quarantine
from eagle3_assets.core.storage.shard_paths import PART_GLOB, PART_PATTERN, SIDECAR

ProgressCallback = Callable[[dict[str, Any]], None]


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
        part_file = PartFileWriter(tmp, layout, metadata)
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
    previous: dict = {}
    if sidecar_path.is_file():
        try:
            previous = json.loads(sidecar_path.read_text())
        except ValueError:
            pass
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
    # A complete shard extracted again writes nothing: replacing an equal sidecar would briefly hold two copies of it,
    # beyond what a streamed window of shards promises to hold.
    if not (sidecar_path.is_file() and previous == sidecar):
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


