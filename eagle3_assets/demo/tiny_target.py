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
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.storage import stable_hash, staging_dir
from eagle3_assets.demo.prompt_set import training_traces

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
    # ~70 s on 2 cores; the model then answers in the reasoning format ~96 % of the time under vLLM
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
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = []
    for question, reasoning, answer in training_traces(spec.seed):
        corpus.append(f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n")
        corpus.append(response_text(reasoning, answer))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - 2,  # the two think markers are added below
        special_tokens=[BOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=BOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )


def _training_batches(tokenizer, spec: TinyTargetSpec):
    """Token ids of whole conversations, with a mask over the assistant's own tokens."""
    import torch

    rows = []
    for question, reasoning, answer in training_traces(spec.seed):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(response_text(reasoning, answer), add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        mask[i, : len(row_mask)] = torch.tensor(row_mask)
    return ids, mask


def build_tiny_target(out_dir: Path, spec: TinyTargetSpec = TinyTargetSpec(), log=print) -> Path:
    """Train tokenizer and model from ``spec.seed`` and save an HF model directory atomically."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
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
    ids, mask = _training_batches(tokenizer, spec)
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=spec.learning_rate, total_steps=spec.train_steps, pct_start=0.1)
    model.train()
    for step in range(spec.train_steps):
        pick = torch.randint(0, ids.shape[0], (spec.batch_size,), generator=generator)
        batch_ids, batch_mask = ids[pick], mask[pick]
        width = int(batch_mask.nonzero()[:, 1].max()) + 1
        batch_ids, batch_mask = batch_ids[:, :width], batch_mask[:, :width]
        logits = model(input_ids=batch_ids).logits[:, :-1]
        labels = batch_ids[:, 1:].masked_fill(batch_mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == spec.train_steps - 1:
            log(f"tiny target: step {step + 1}/{spec.train_steps} loss {loss.item():.3f} ({time.monotonic() - started:.0f}s)")
    model.eval()

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out_dir)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "build_info.json").write_text(
            json.dumps({"fingerprint": spec.fingerprint, "spec": dataclasses.asdict(spec), "final_loss": loss.item()}, indent=2)
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"tiny target: built in {time.monotonic() - started:.0f}s at {out_dir}")
    return out_dir


def ensure_tiny_target(out_dir: Path, spec: TinyTargetSpec = TinyTargetSpec(), log=print) -> Path:
    """The cached target at ``out_dir``, rebuilt only when missing or built from another spec."""
    info = Path(out_dir) / "build_info.json"
    if info.is_file() and json.loads(info.read_text()).get("fingerprint") == spec.fingerprint:
        return Path(out_dir)
    return build_tiny_target(Path(out_dir), spec, log=log)
