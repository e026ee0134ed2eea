"""The transformers backend: the target's states captured with hooks at exactly the configured layer ids.

:class:`TransformersBackend` (the HF model, bf16 with ``device_map="auto"`` on
GPUs, fp32 on CPU) with its padded length batching: a
:class:`~eagle3_assets.core.extraction.backends.CaptureBackend`, registered in
:mod:`eagle3_assets.core.extraction.backends` as ``transformers``. Dagster-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.core.extraction.traces import ExtractionInputError, validate_layer_ids
from eagle3_assets.core.extraction.job import ExtractionRecipe


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
    logits_dtype = None  # the gate reports float32: reference_forward upcasts the logits

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
        self.reference_passes: dict[str, int] = {}  # one forward per sequence checked: the gate counts them itself
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

    def keep_references(self, sequences: Sequence[Sequence[int]]) -> None:
        """Nothing to keep: :meth:`reference_argmax` runs its own forward of each sequence checked."""

    def reference_argmax(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The target's own greedy choice after each position of each sequence (for the checks)."""
        return [self.reference_forward(sequence)[0].argmax(dim=-1) for sequence in sequences]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


