"""A built-in target of the Qwen3 architecture, built deterministically in code and cached on disk.

A second architecture for the platform's measurements (the training defaults
among them): ``Qwen3ForCausalLM`` as transformers and vLLM know it, with what
sets it apart from the Llama demo target (``tiny_target.py``):

- attention: grouped-query (2 query heads share 1 key/value head) with an
  RMSNorm on each head's queries and keys before rotary, rotary base 1e6;
- markup: Qwen3's ChatML. The generation prompt ends at
  ``<|im_start|>assistant\\n`` and the *model* writes ``<think>\\n`` itself,
  closes with ``\\n</think>\\n\\n``, answers and ends the turn with
  ``<|im_end|>`` (its eos, on which vLLM stops). ``<think>``/``</think>`` are
  single tokens that are not special, as in Qwen3's tokenizer, because vLLM's
  reasoning parsers read them from the detokenised text. History renders an
  assistant turn's ``reasoning_content`` inside a think block, as Qwen3's own
  template does (which also drops it before the last user turn; a detail the
  platform never renders, since it only renders one-question prompts);
- served with vLLM's ``qwen3`` reasoning parser (``QWEN3_REASONING_PARSER``),
  which starts in reasoning, drops the ``<think>`` the model writes and splits
  at ``</think>`` leaving the newlines around it in the two fields, so the
  platform rebuilds the exact text the model wrote.

Six layers, so vLLM's default EAGLE-3 layer ids ``(2, 3, 3)`` repeat and the
platform picks ``(2, 3, 4)`` (``core.target.description.default_aux_layer_ids``). Head size
64: vLLM's CPU attention backend crashes with 16. Trained like the other
built-in targets (``target_building.py``) on the demo's reasoning traces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.demo.build_check import checked_build
from eagle3_assets.demo.target_building import (
    train_and_save,
    trained_tokenizer,
    training_conversations,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN3_REASONING_PARSER = "qwen3"

# Qwen3's chat markup, reduced to what a text-only conversation uses (no tools).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'].strip('\\n') + '\\n</think>\\n\\n' + message['content'].lstrip('\\n') }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


@dataclass(frozen=True)
class Qwen3TargetSpec:
    seed: int = 0
    vocab_size: int = 640
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 2  # head_dim 64
    num_kv_heads: int = 1  # grouped-query attention, as in every Qwen3
    intermediate_size: int = 384
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    train_steps: int = 400
    batch_size: int = 32
    learning_rate: float = 3e-3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def fingerprint(self) -> str:
        return stable_hash({"spec": dataclasses.asdict(self), "template": CHAT_TEMPLATE, "format": 1})


def response_text(reasoning: str, answer: str) -> str:
    """What the target writes after the generation prompt: its own think block, the answer, the end of turn."""
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{answer}{IM_END}"


def _training_conversations(spec: Qwen3TargetSpec) -> list[tuple[str, str]]:
    return training_conversations(CHAT_TEMPLATE, response_text, spec.seed)


def build_tokenizer(spec: Qwen3TargetSpec):
    """Qwen3's tokens: ``<|endoftext|>`` pads, ``<|im_end|>`` is eos; no bos (Qwen3 prepends nothing)."""
    corpus = [text for conversation in _training_conversations(spec) for text in conversation]
    return trained_tokenizer(
        corpus, spec, special_tokens=[ENDOFTEXT, IM_START, IM_END], think_markers=[THINK_OPEN, THINK_CLOSE], chat_template=CHAT_TEMPLATE,
        eos_token=IM_END, pad_token=ENDOFTEXT,
    )  # fmt: skip


def model_config(spec: Qwen3TargetSpec, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        attention_bias=False,
        tie_word_embeddings=False,  # as in the larger Qwen3 models; the draft learns its own head either way
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),  # generation stops at the end of the turn
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def build_qwen3_target(out_dir: Path, spec: Qwen3TargetSpec = Qwen3TargetSpec(), log=print) -> Path:
    """Train tokenizer and model from ``spec.seed`` and save an HF model directory atomically."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec)
    model = Qwen3ForCausalLM(model_config(spec, tokenizer))
    return train_and_save(out_dir, spec, tokenizer, model, _training_conversations(spec), label="qwen3 target", log=log)


def ensure_qwen3_target(out_dir: Path, spec: Qwen3TargetSpec = Qwen3TargetSpec(), log=print) -> Path:
    """The cached target at ``out_dir``, rebuilt when missing, built from another spec or doing other than recorded."""
    return checked_build("qwen3", Path(out_dir), spec, log=log)
