"""What every built-in target shares: its tokenizer training, its training loop, and its cache on disk.

The built-in targets (the Llama demo target, the Qwen3 one, the DeepSeek-V3 /
Kimi-K2 one) differ in architecture, chat markup and how their tokenizer is
saved, but are made the same way: a byte-level BPE trained in-process on the
templated conversations, a model trained briefly on those conversations with
the loss on the assistant's tokens only, and a model directory written
atomically and reused while its spec fingerprint matches.

Each target is built in a process of pinned arithmetic and checked by what it
does before it is used: :mod:`.build_check`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from eagle3_assets.core.serving.profile import BUILT_IN_MARKER
from eagle3_assets.core.storage.files import staging_dir
from eagle3_assets.demo.prompt_set import training_traces

BUILD_INFO = BUILT_IN_MARKER  # its presence gives a target the fast start (core/serving/profile.py)


@contextlib.contextmanager
def deterministic_torch(threads: int = 1):
    """Seeded training that also sums in a fixed order: a fixed thread count and deterministic algorithms, restored after."""
    import torch

    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)


def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int, special_tokens: Sequence[str], plain_added_tokens: Sequence[str]):
    """A byte-level BPE of ``vocab_size`` tokens: the trained merges, ``special_tokens``, then ``plain_added_tokens``.

    ``plain_added_tokens`` (the think markers) are single tokens that are *not*
    special: vLLM's reasoning parsers look for them in the detokenised text,
    from which special tokens are dropped.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(plain_added_tokens),
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added_tokens])
    return tok


def trained_tokenizer(corpus: Iterable[str], spec, *, special_tokens: Sequence[str], think_markers: Sequence[str], chat_template: str, **named_tokens: str):
    """A fast tokenizer whose byte-level BPE is trained on ``corpus``, as ``spec`` sizes it (``vocab_size``, ``max_position_embeddings``).

    ``named_tokens`` (``bos_token``, ``eos_token``, ``pad_token``) say which of
    ``special_tokens`` play which part; a target without a bos leaves it out.
    """
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_level_bpe(corpus, spec.vocab_size, special_tokens=special_tokens, plain_added_tokens=think_markers)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **named_tokens, chat_template=chat_template, model_max_length=spec.max_position_embeddings)


def training_conversations(chat_template: str, response_text: Callable[[str, str], str], seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) texts of the demo's training traces: the generation prompt for each question and what the target should write."""
    return [(generation_prompt(chat_template, question), response_text(reasoning, answer)) for question, reasoning, answer in training_traces(seed)]


def conversation_batches(tokenizer, conversations: Sequence[tuple[str, str]]):
    """Token ids of ``(prompt text, completion text)`` pairs, padded, with a mask over the completion's tokens.

    Prompt and completion are tokenised apart, as vLLM's chat endpoint sees the
    prompt and the model writes the completion, so the mask never splits a token.
    """
    import torch

    rows = []
    for prompt, completion in conversations:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        mask[i, : len(row_mask)] = torch.tensor(row_mask)
    return ids, mask


def train_on_completions(
    model, ids, mask, *, seed: int, steps: int, batch_size: int, learning_rate: float, label: str, log=print
) -> float:
    """Train ``model`` on random batches of ``ids``, the loss on masked (completion) tokens only; the last loss.

    AdamW with a one-cycle schedule and gradient clipping: a few hundred steps
    are enough for a tiny model to learn the reasoning format of its traces.
    The batch order comes from its own generator seeded with ``seed``, so the
    result depends on the seed alone.
    """
    import torch

    started = time.monotonic()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        pick = torch.randint(0, ids.shape[0], (batch_size,), generator=generator)
        batch_ids, batch_mask = ids[pick], mask[pick]
        width = int(batch_mask.nonzero()[:, 1].max()) + 1  # drop the padding every row of this batch has
        batch_ids, batch_mask = batch_ids[:, :width], batch_mask[:, :width]
        logits = model(input_ids=batch_ids).logits[:, :-1]
        labels = batch_ids[:, 1:].masked_fill(batch_mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"{label}: step {step + 1}/{steps} loss {loss.item():.3f} ({time.monotonic() - started:.0f}s)")
    model.eval()
    return loss.item()


def train_and_save(
    out_dir: Path,
    spec,
    tokenizer,
    model,
    conversations: Sequence[tuple[str, str]],
    *,
    label: str,
    log: Callable[[str], None],
    save_tokenizer: Callable[[object, Path], None] | None = None,
    after_training: Callable[[object], object] | None = None,
) -> Path:
    """Train ``model`` on the completions of ``conversations`` as ``spec`` says, then save model and tokenizer atomically.

    ``spec`` carries ``seed``, ``train_steps``, ``batch_size``, ``learning_rate`` and
    ``fingerprint``; ``after_training`` may convert the model (e.g. to the dtype
    vLLM serves), ``save_tokenizer`` replaces ``tokenizer.save_pretrained``.
    """
    started = time.monotonic()
    ids, mask = conversation_batches(tokenizer, conversations)
    with deterministic_torch():
        final_loss = train_on_completions(
            model, ids, mask,
            seed=spec.seed, steps=spec.train_steps, batch_size=spec.batch_size, learning_rate=spec.learning_rate,
            label=label, log=log,
        )  # fmt: skip
    if after_training is not None:
        model = after_training(model)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        (save_tokenizer or (lambda tok, path: tok.save_pretrained(path)))(tokenizer, staging)

    write_model_dir(out_dir, write, {"fingerprint": spec.fingerprint, "spec": dataclasses.asdict(spec), "final_loss": final_loss})
    log(f"{label}: trained and saved in {time.monotonic() - started:.0f}s at {out_dir}")
    return Path(out_dir)


def write_model_dir(out_dir: Path, write: Callable[[Path], None], build_info: dict) -> Path:
    """Let ``write`` fill a staging directory beside ``out_dir``, add ``build_info.json``, then swap it into place.

    A build interrupted at any point leaves the previous directory (or none),
    never a half-written model that a later run would take as cached.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out_dir)  # the umask's mode, not mkdtemp's 0700: other users serve this model too
    try:
        write(staging)
        (staging / BUILD_INFO).write_text(json.dumps(build_info, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def generation_prompt(chat_template: str, question: str) -> str:
    """The generation prompt ``chat_template`` renders for one user question, before any tokenizer exists.

    The tokenizer is trained on these prompts, so they are rendered from the
    template itself with jinja2 (as transformers does) rather than written out
    by hand a second time.
    """
    return render_chat(chat_template, [{"role": "user", "content": question}])


def render_chat(chat_template: str, messages: list[dict]) -> str:
    """``messages`` as ``chat_template`` renders them with the generation prompt (jinja2, as transformers does)."""
    return _compiled_template(chat_template).render(messages=messages, add_generation_prompt=True)


@functools.lru_cache(maxsize=8)
def _compiled_template(chat_template: str):
    """The template compiled once: compiling it for every one of a build's thousands of prompts was two thirds of a
    Kimi-family build at 4 training steps (40 of 64 s, py-spy)."""
    import jinja2

    return jinja2.Template(chat_template)

