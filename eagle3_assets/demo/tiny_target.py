"""A tiny reasoning target, built deterministically in code and cached on disk.

No model can be downloaded here, so the demo and the tests build their own
target: a byte-level BPE tokenizer trained in-process, whose ``<think>`` and
``</think>`` are single added tokens that are *not* special (vLLM's reasoning
parser looks for the end-of-think marker in the detokenised text, and special
tokens are dropped from it), a chat template whose generation prompt opens the
think block, and a small Llama trained briefly on templated reasoning traces so
that it answers like a reasoning model: reasoning, ``</think>``, an answer, end
of turn. A random-weight model almost never closes its think block.

Head size is 64: vLLM's CPU attention backend crashes with 16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.demo.prompt_set import training_traces
from eagle3_assets.demo.build_check import checked_build
from eagle3_assets.demo.target_building import (
    train_and_save,
    trained_tokenizer,
    training_conversations,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
BOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Assistant turns from history carry their reasoning as `reasoning_content`
# (the convention of Qwen3/DeepSeek templates); the generation prompt opens the
# think block, so the model's own output starts inside it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyTargetSpec:
    seed: int = 0
    vocab_size: int = 640
    hidden_size: int = 64
    num_layers: int = 7  # vLLM's default aux layer ids (2, 3, 4) are then distinct
    num_heads: int = 1  # head_dim 64
    intermediate_size: int = 192
    max_position_embeddings: int = 4096
    # Enough steps that the model answers in the reasoning format ~96 % of the time under vLLM
    train_steps: int = 400
    batch_size: int = 32
    learning_rate: float = 5e-3

    @property
    def fingerprint(self) -> str:
        return stable_hash({"spec": dataclasses.asdict(self), "template": CHAT_TEMPLATE, "format": 1})


def response_text(reasoning: str, answer: str) -> str:
    """What the target writes after the generation prompt (which already holds ``<think>\\n``)."""
    return f"{reasoning}\n{THINK_CLOSE}\n\n{answer}{IM_END}"


def build_tokenizer(spec: TinyTargetSpec):
    # The BPE learns from the user turn as written here, without the generation prompt's `<think>\n`.
    # The fingerprint does not cover the corpus: another one would make new builds differ from cached ones.
    corpus = []
    for question, reasoning, answer in training_traces(spec.seed):
        corpus.append(f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n")
        corpus.append(response_text(reasoning, answer))
    return trained_tokenizer(
        corpus, spec, special_tokens=[BOS, IM_START, IM_END], think_markers=[THINK_OPEN, THINK_CLOSE], chat_template=CHAT_TEMPLATE,
        bos_token=BOS, eos_token=IM_END, pad_token=BOS,
    )  # fmt: skip


def build_tiny_target(out_dir: Path, spec: TinyTargetSpec = TinyTargetSpec(), log=print) -> Path:
    """Train tokenizer and model from ``spec.seed`` and save an HF model directory atomically."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    return train_and_save(out_dir, spec, tokenizer, model, training_conversations(CHAT_TEMPLATE, response_text, spec.seed), label="tiny target", log=log)


def ensure_tiny_target(out_dir: Path, spec: TinyTargetSpec = TinyTargetSpec(), log=print) -> Path:
    """The cached target at ``out_dir``, rebuilt when missing, built from another spec or doing other than recorded."""
    return checked_build("tiny", Path(out_dir), spec, log=log)
