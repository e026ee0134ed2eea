"""The extraction backends, one entry each, and what every backend must do (:class:`CaptureBackend`).

To add a backend: write its class (a module beside ``transformers_backend.py``
that meets :class:`CaptureBackend`) and add an entry to :data:`EXTRACTION_BACKENDS`.
Everything that chooses or describes a backend reads the entry:

- the stage (:func:`make_backend`, called by ``extract_hidden_states`` and by
  bounded-disk training) builds the engine with the entry's ``build``;
- the assets validate the ``backend`` setting against the table
  (:func:`extraction_backend`, whose error names the registered ones), ask the
  GPU host's pre-flight for the entry's ``modules``, and, where the entry
  ``serves_target``, for the GPUs and memory the target's serving profile
  names.

Torch-free and Dagster-free: the assets read this table when the code
location loads (tests/test_import_graph.py), so each ``build`` imports its
backend's module when it is called. The extraction job
(:mod:`eagle3_assets.core.extraction.job`) is imported by the backends
themselves, so this module imports it for types only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from eagle3_assets.core.extraction.needs import EXTRACTION_MODULES

if TYPE_CHECKING:
    import torch

    from eagle3_assets.core.extraction.job import ExtractionRecipe, StageTarget


@runtime_checkable  # isinstance checks that every member below is there (tests/test_extraction.py)
class CaptureBackend(Protocol):
    """Everything the extraction, its gates and the stage ask of a backend (an engine holding the target)."""

    name: str  # its entry's name in EXTRACTION_BACKENDS: recorded in the sidecar, the record and the engine build
    final_state: str  # "post_norm" | "pre_norm": what its final state is (state_layout.FINAL_STATES)
    logits_dtype: str | None  # the dtype of the logits reference_argmax's choices come from (None: float32 or unknown)
    reference_passes: dict[str, int]  # the gate's reference passes so far, by kind (reported with the gate); {}: not counted

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Group positions into ``lengths`` (already sorted ascending) into batches, in order."""
        ...

    def capture(self, sequences: Sequence[Sequence[int]], dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, on the CPU in ``dtype``: aux states [T, 3·H] (in layer-id order) and the final state [T, H]."""
        ...

    def keep_references(self, sequences: Sequence[Sequence[int]]) -> None:
        """Before extraction: the sequences ``final_state_reproduces_logits`` will check (a backend that can records
        its own greedy choice for them in the pass that captures their states; one that cannot does nothing)."""
        ...

    def reference_argmax(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The target's own greedy choice after each position of each sequence, as this engine computes it (the gates)."""
        ...

    def close(self) -> None:
        """Free the engine (its memory, hooks, scratch files, anything it set in the process)."""
        ...


@dataclass(frozen=True)
class ExtractionBackend:
    """One backend: how the stage builds it and what the orchestrator must know of it before it runs."""

    build: Callable[[ExtractionRecipe, StageTarget, Sequence[Any]], CaptureBackend]  # (recipe, target, the run's traces)
    modules: tuple[str, ...]  # Python modules the GPU host must have beyond extraction's own (EXTRACTION_MODULES)
    serves_target: bool  # its engine serves the target as the target's serving profile says (GPUs, memory: pre-flighted)
    description: str


def _transformers(recipe: ExtractionRecipe, target: StageTarget, traces: Sequence[Any]) -> CaptureBackend:
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend

    return TransformersBackend(target.path, target.aux_layer_ids, recipe, trust_remote_code=target.trust_remote_code)


def _vllm(recipe: ExtractionRecipe, target: StageTarget, traces: Sequence[Any]) -> CaptureBackend:
    from eagle3_assets.core.extraction.vllm_backend import VLLMBackend

    longest = max(t.num_tokens for t in traces)
    # The context this use needs (the target's serving profile may set its own max_model_len).
    return VLLMBackend(target.path, target.aux_layer_ids, recipe, max_model_len=-(-(longest + 1) // 16) * 16, serving=target.serving)


# The registry.
EXTRACTION_BACKENDS: dict[str, ExtractionBackend] = {
    "transformers": ExtractionBackend(
        _transformers, modules=(), serves_target=False,
        description="the HF model with hooks at the layer ids (bf16 over the GPUs, fp32 on a CPU)",
    ),
    "vllm": ExtractionBackend(
        _vllm, modules=("vllm",), serves_target=True,
        description="a vLLM engine in the stage's process, served as the target's profile says: for targets too large for transformers",
    ),
}  # fmt: skip


def known_backends() -> str:
    """The registered backends' names, for an error: ``'transformers', 'vllm'``."""
    return ", ".join(repr(name) for name in EXTRACTION_BACKENDS)


def extraction_backend(name: str) -> ExtractionBackend:
    """The entry of backend ``name``; a ``ValueError`` naming the registered ones when there is none."""
    try:
        return EXTRACTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"extraction backend {name!r}: one of {known_backends()} (core/extraction/backends.py registers them)") from None


def extraction_modules(name: str) -> list[str]:
    """The Python modules the GPU host needs to extract with backend ``name`` (its pre-flight checks each)."""
    return EXTRACTION_MODULES + list(extraction_backend(name).modules)


def make_backend(recipe: ExtractionRecipe, target: StageTarget, traces: Sequence[Any]) -> CaptureBackend:
    """The recipe's backend for ``target``, built once per run; ``traces`` (``num_tokens`` each) size what needs it."""
    return extraction_backend(recipe.backend).build(recipe, target, traces)
