"""A built-in long-trace target: reasoning traces of thousands of tokens whose length the question sets.

The other built-in targets write ~55 tokens a trace; the user's traces run to
8,192 (about 4,000 on average), and a draft's acceptance thousands of tokens
into a trace is what matters there. This target writes traces of that length,
built in code like the others (deterministic, fingerprinted, cached, checked by
what it does: :mod:`.build_check`).

What a tiny model (width 64) trained for a few minutes can write in format for
8,000 tokens: every line of a trace is fixed-width and follows from the line
before it by a local rule, and the question says how many lines there are.
Each line starts with a countdown ``n d d d`` (the steps left, one token per
digit, units first) that the first line copies from the question and each next
line decrements, then the family's tag, capitalised on the line with ``n 0 0 0``
alone; that line is the last, so the stop is in sight of the model (one capital
within the window, decided by the three digits just written), and the length
comes from the question. Numbers are written units
first so that a borrow (or a carry) shows in the digit the model has just
written: the tens fall by one exactly when the units just written are 9, a rule
of the last token, where written the usual way it is a rule of the digits
still to come. After the countdown, each
task family has its own state, tokens per line and entropy:

- ``sum`` (step-by-step arithmetic): a digit ``a`` and a running sum
  ``s`` of four digits (units first), ``s`` grows by ``a`` each line (mod
  10,000): 12 tokens a line, nothing left to chance;
- ``rotate`` (passes over a word): six letters, rotated left by one each line:
  12 tokens a line, nothing left to chance;
- ``flips`` (counting): a coin flip ``h`` or ``t`` written freely, and the count
  of heads so far: 12 tokens a line, one free bit a line;
- ``dice`` (rolls): six rolls 1-6 written freely: 12 tokens a line, 15.5 free
  bits a line.

Digits and letters of a line are written apart (``n 2 5 0``) so that each is
one token of the byte-level BPE (its pre-tokeniser never merges across a
space), which keeps every line of a family the same number of tokens.

The prompt set holds single questions and multi-turn conversations (2-4 user
turns, the earlier ones answered in the history), under several system
prompts; the trace answers the last user turn.

The model is trained on windows of its traces (the start with the prompt, the
end with the answer, and windows between), not on whole 8,000-token
conversations: every rule is local, so a window teaches it, at a fraction of
the cost. Head size 64 (vLLM's CPU attention backend crashes with 16).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.demo.build_check import checked_build
from eagle3_assets.demo.long_prompts import (  # noqa: F401 (the target's prompt set and format check, read from here too)
    MAX_COMPLETION_TOKENS, format_break, fingerprint_questions, long_prompts, make_conversations, steps_as_asked,
)  # fmt: skip
from eagle3_assets.demo.target_building import deterministic_torch, render_chat, trained_tokenizer, write_model_dir
# The tiny target's markup: ChatML whose generation prompt opens the think block; any role renders alike.
from eagle3_assets.demo.tiny_target import BOS, CHAT_TEMPLATE, IM_END, IM_START, THINK_CLOSE, THINK_OPEN  # noqa: F401

LONG_REASONING_PARSER = "deepseek_r1"  # the generation prompt opens the think block, as the tiny target's does


@dataclass(frozen=True)
class LongTargetSpec:
    seed: int = 0
    vocab_size: int = 384
    hidden_size: int = 64
    num_layers: int = 4  # vLLM's default aux layer ids (2, 2, 1) repeat; the platform picks (1, 2, 3)
    # Four query heads of 64 (vLLM's CPU attention crashes at 16) over one key/value head: heads enough to find the
    # line before and the question, and a KV cache of 2 KiB a token (float32), so 128 traces of 8,400 fit 2.1 GiB.
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 192
    # the longest prompt (a system prompt and three answered turns) and 8,192 completion tokens
    max_position_embeddings: int = 10240
    # Each token attends to the last 128 only (Mistral's sliding window, which transformers and vLLM's CPU attention
    # both apply): the model is trained on 128-token windows, and with full attention 200 tokens into a trace it
    # met contexts it never saw and ended its turn (measured through vLLM at temperature 1: 55 of 55 traces ended
    # in under 820 tokens without closing the think block). Windowed, 8,000 tokens in look like 100.
    sliding_window: int = 128  # at least window
    conversations: int = 600
    window: int = 128  # tokens per training row: a window of a conversation, ten lines
    train_steps: int = 700
    batch_size: int = 32
    learning_rate: float = 1e-2

    @property
    def fingerprint(self) -> str:
        return stable_hash({"spec": dataclasses.asdict(self), "template": CHAT_TEMPLATE, "format": 2})


def response_text(reasoning: str, answer: str) -> str:
    """What the target writes after the generation prompt (which already holds ``<think>\\n``)."""
    return f"{reasoning}\n{THINK_CLOSE}\n\n{answer}{IM_END}"


def training_pairs(spec: LongTargetSpec) -> list[tuple[str, str]]:
    """(prompt text, completion text) of every training conversation."""
    conversations = make_conversations(spec.conversations, spec.seed)
    return [(render_chat(CHAT_TEMPLATE, messages), response_text(reasoning, answer)) for messages, reasoning, answer in conversations]


def build_tokenizer(spec: LongTargetSpec, pairs: list[tuple[str, str]]):
    corpus = [text for pair in pairs[:200] for text in pair]  # 200 conversations hold every token the rest use
    return trained_tokenizer(
        corpus, spec, special_tokens=[BOS, IM_START, IM_END], think_markers=[THINK_OPEN, THINK_CLOSE], chat_template=CHAT_TEMPLATE,
        bos_token=BOS, eos_token=IM_END, pad_token=BOS,
    )  # fmt: skip


def train_on_windows(model, rows: list[tuple[list[int], int]], spec: LongTargetSpec, pad_id: int, label: str, log=print) -> float:
    """Train ``model`` on windows of ``spec.window`` tokens of ``rows`` (token ids, where the completion starts).

    Half the windows hold the end of the prompt and the first lines (the first
    line copies the last question's numbers, the hardest rule: one line a
    trace), a quarter end at the conversation's end (the last lines, the close,
    the answer), a quarter lie between; the
    loss is on the completion's tokens only. AdamW with a one-cycle schedule; the
    windows come from a generator seeded with ``spec.seed`` alone.
    """
    import torch

    started = time.monotonic()
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=spec.learning_rate, total_steps=spec.train_steps, pct_start=0.1)
    model.train()
    for step in range(spec.train_steps):
        ids = torch.full((spec.batch_size, spec.window), pad_id, dtype=torch.long)
        mask = torch.zeros((spec.batch_size, spec.window), dtype=torch.long)
        picks = torch.randint(0, len(rows), (spec.batch_size,), generator=generator).tolist()
        kinds = torch.randint(0, 4, (spec.batch_size,), generator=generator).tolist()
        offsets = torch.rand(spec.batch_size, generator=generator).tolist()
        for b, (pick, kind, offset) in enumerate(zip(picks, kinds, offsets)):
            tokens, completion_start = rows[pick]
            last_start = max(0, len(tokens) - spec.window)
            # the start: the end of the prompt (the last question) and the first lines; the end; between
            start = max(0, min(completion_start - spec.window // 2, last_start)) if kind < 2 else last_start if kind == 2 else int(offset * last_start)
            window = tokens[start : start + spec.window]
            ids[b, : len(window)] = torch.tensor(window)
            mask[b, : len(window)] = (torch.arange(start, start + len(window)) >= completion_start).long()
        logits = model(input_ids=ids).logits[:, :-1]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == spec.train_steps - 1:
            log(f"{label}: step {step + 1}/{spec.train_steps} loss {loss.item():.4f} ({time.monotonic() - started:.0f}s)")
    model.eval()
    return loss.item()


def build_long_target(out_dir: Path, spec: LongTargetSpec = LongTargetSpec(), log=print) -> Path:
    """Train tokenizer and model from ``spec.seed`` and save an HF model directory atomically."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    started = time.monotonic()
    torch.manual_seed(spec.seed)
    pairs = training_pairs(spec)
    tokenizer = build_tokenizer(spec, pairs)
    rows = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"], len(prompt_ids)))
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    # Trained as Llama: on windows of spec.window <= sliding_window tokens the window masks nothing, so the weights
    # are those of the windowed model; then saved as Mistral (Llama's layers and weight names, with the window).
    model = LlamaForCausalLM(LlamaConfig(**shape))
    log(f"long target: {len(rows)} conversations tokenised in {time.monotonic() - started:.0f}s")
    with deterministic_torch():
        final_loss = train_on_windows(model, rows, spec, tokenizer.pad_token_id, "long target", log)
    windowed = MistralForCausalLM(MistralConfig(**shape, sliding_window=spec.sliding_window))
    windowed.load_state_dict(model.state_dict())
    model = windowed.eval()

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)

    write_model_dir(out_dir, write, {"fingerprint": spec.fingerprint, "spec": dataclasses.asdict(spec), "final_loss": final_loss})
    log(f"long target: trained and saved in {time.monotonic() - started:.0f}s at {out_dir}")
    return Path(out_dir)


def ensure_long_target(out_dir: Path, spec: LongTargetSpec = LongTargetSpec(), log=print) -> Path:
    """The cached target at ``out_dir``, rebuilt when missing, built from another spec or doing other than recorded."""
    return checked_build("long", Path(out_dir), spec, log=log)
