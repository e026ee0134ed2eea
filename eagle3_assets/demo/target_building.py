"""What every built-in target shares: its tokenizer training, its training loop, and its cache on disk.

The built-in targets (the Llama demo target, the Qwen3 one, the DeepSeek-V3 /
Kimi-K2 one) differ in architecture, chat markup and how their tokenizer is
saved, but are made the same way: a byte-level BPE trained in-process on the
templated conversations, a model trained briefly on those conversations with
the loss on the assistant's tokens only, and a model directory written
atomically and reused while its spec fingerprint matches.

The same on every machine, as far as a CPU allows. A seed fixes the data order
and the initial weights, but not the arithmetic: 300 steps of AdamW carry a
difference in the last bit of a sum into other weights, and the sums differ
with the thread count (how a reduction is split) and with the CPU (MKL and
ATen pick AVX-512, AVX2 or other kernels by what the CPU offers, and round
differently). So :func:`checked_build` trains in a process of its own whose
arithmetic is pinned (:data:`BUILD_ENVIRONMENT`: one thread, MKL's
conditional numerical reproducibility, ATen's AVX2 kernels, deterministic
algorithms), and then checks what was built by what it *does*: its greedy
outputs on fixed prompts (:func:`behaviour_fingerprint`) against the ones
recorded in ``target_fingerprints.json``. A build that differs is refused with
the first differing output, never used silently; a cached build from before
the check is checked once and rebuilt when it differs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from eagle3_assets.core.serving.profile import BUILT_IN_MARKER
from eagle3_assets.core.storage.files import staging_dir, write_json_atomic
from eagle3_assets.demo.prompt_set import demo_prompts, eval_prompts, training_traces
from eagle3_assets.demo.environment import ACCEPT_TARGET_FINGERPRINT

BUILD_INFO = BUILT_IN_MARKER  # its presence gives a target the fast start (core/serving/profile.py)
RECORDED_FINGERPRINTS = Path(__file__).with_name("target_fingerprints.json")
ACCEPT_UNRECORDED_ENV = ACCEPT_TARGET_FINGERPRINT.name  # 1: use a build whose greedy outputs differ from the recorded

# Each built-in target: (its module, its build function, its spec class, whether its tokenizer is remote code).
BUILT_TARGETS = {
    "tiny": ("eagle3_assets.demo.tiny_target", "build_tiny_target", "TinyTargetSpec", False),
    "qwen3": ("eagle3_assets.demo.qwen3_target", "build_qwen3_target", "Qwen3TargetSpec", False),
    "kimi": ("eagle3_assets.demo.kimi_target", "build_kimi_target", "KimiTargetSpec", True),
}

# The arithmetic of a build process, pinned so that a seed gives the same weights on any x86 machine with AVX2:
# one thread (a reduction split over threads sums in another order), MKL's conditional numerical reproducibility
# on its AVX2 branch (its GEMMs otherwise pick kernels, and roundings, by CPU model and vendor; the AVX2 branch ran
# as fast as MKL's own choice here, its COMPATIBLE branch 2.2 times slower), ATen's AVX2 kernels (not AVX-512 on
# one machine and AVX2 on the next), and the tokenizer trainer on one thread. Read when the libraries start, so
# they are set for a process of its own.
BUILD_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_CBWR": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "TOKENIZERS_PARALLELISM": "false",
    "RAYON_NUM_THREADS": "1",
}
FINGERPRINT_TOKENS = 24  # greedy tokens per fingerprint prompt


class TargetBuildError(RuntimeError):
    """A built-in target could not be built as recorded; the message says what differs and what to do."""


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


def fingerprint_prompts() -> list[str]:
    """The fixed questions a built target's greedy outputs are recorded on: demo questions and held-out ones."""
    return [p["conversations"][0]["value"] for p in demo_prompts()[:4]] + [p["question"] for p in eval_prompts()[:4]]


def behaviour_fingerprint(model_dir: Path, trust_remote_code: bool = False, tokens: int = FINGERPRINT_TOKENS) -> list[list[int]]:
    """What the target at ``model_dir`` does: its greedy token ids after each fingerprint prompt's generation prompt.

    Computed with transformers in float32 (a bf16 target's weights upcast), so
    that rounding in the forward pass is as far below the gaps between logits as
    it can be; run it under :data:`BUILD_ENVIRONMENT`, as :func:`checked_build` does.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outputs = []
    with deterministic_torch(), torch.inference_mode():
        for question in fingerprint_prompts():
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def recorded_fingerprint(name: str, spec) -> list[list[int]] | None:
    """The greedy outputs recorded for target ``name`` built from ``spec`` (None: nothing recorded for this spec)."""
    recorded = json.loads(RECORDED_FINGERPRINTS.read_text()).get(name) if RECORDED_FINGERPRINTS.is_file() else None
    if not recorded or recorded.get("spec_fingerprint") != spec.fingerprint:
        return None
    return recorded["greedy_token_ids"]


def fingerprint_difference(observed: list[list[int]], recorded: list[list[int]]) -> str | None:
    """Where ``observed`` greedy outputs first leave the ``recorded`` ones, or None when they are the same."""
    prompts = fingerprint_prompts()
    for index, (mine, theirs) in enumerate(zip(observed, recorded)):
        if mine != theirs:
            at = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            return f"after prompt {index} ({prompts[index]!r}) greedy token {at} is {mine[at:at + 1]}, recorded {theirs[at:at + 1]}"
    return None if len(observed) == len(recorded) else f"{len(observed)} outputs, {len(recorded)} recorded"


def _build_process(*arguments: str, log: Callable[[str], None]) -> None:
    """``python -m eagle3_assets.demo.target_building ARGUMENTS`` under :data:`BUILD_ENVIRONMENT`, its output logged."""
    command = [sys.executable, "-m", "eagle3_assets.demo.target_building", *arguments]
    process = subprocess.Popen(command, env={**os.environ, **BUILD_ENVIRONMENT}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        log(line.rstrip())
    if process.wait() != 0:
        raise TargetBuildError(f"{' '.join(command[2:])} failed (exit {process.returncode}): " + "\n".join(lines[-20:]))


def is_checked_build(name: str, out_dir: Path, spec=None) -> bool:
    """Whether ``out_dir`` already holds a build of ``spec`` (default: the target's default spec) that
    :func:`checked_build` would use without work."""
    spec = spec or _spec(name)
    info_path = Path(out_dir) / BUILD_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    recorded = recorded_fingerprint(name, spec)
    return info.get("fingerprint") == spec.fingerprint and (recorded is None or info.get("greedy_token_ids") == recorded)


@contextlib.contextmanager
def _build_lock(out_dir: Path):
    """One builder per target directory: a second process (a test session's background build, ``make demo`` beside
    ``make dev``) waits for the first, then finds its build. A cache it cannot write to is used without the lock."""
    lock_path = out_dir.with_name(out_dir.name + ".build-lock")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel drops it if the holder dies mid-build
        yield
    finally:
        os.close(fd)


def checked_build(name: str, out_dir: Path, spec, log: Callable[[str], None] = print) -> Path:
    """The built-in target ``name`` at ``out_dir``, built from ``spec`` and doing what was recorded for it.

    A directory holding a build of this spec whose greedy outputs were already
    checked is used as it is. Otherwise the target is built (or, for a build of
    this spec from before the check, first checked) in a process of pinned
    arithmetic, and its greedy outputs compared with ``target_fingerprints.json``:
    a differing build is refused (:class:`TargetBuildError`) unless
    ``EAGLE3_ACCEPT_TARGET_FINGERPRINT=1``. A spec nothing was recorded for
    (a changed one) is built and logged as unchecked. One process builds a directory at a time; another waits
    for it and then uses its build.
    """
    out_dir = Path(out_dir)
    if is_checked_build(name, out_dir, spec):
        return out_dir
    with _build_lock(out_dir):
        return _checked_build(name, out_dir, spec, log)


def _checked_build(name: str, out_dir: Path, spec, log: Callable[[str], None] = print) -> Path:
    """:func:`checked_build` once its caller holds the directory's build lock."""
    out_dir = Path(out_dir)
    recorded = recorded_fingerprint(name, spec)
    info_path = out_dir / BUILD_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if info.get("fingerprint") == spec.fingerprint:
        if recorded is None or info.get("greedy_token_ids") == recorded:
            return out_dir
        if "greedy_token_ids" not in info:  # built before the check: check it once
            _build_process("fingerprint", name, str(out_dir), log=log)
            info = json.loads(info_path.read_text())
            if "greedy_token_ids" not in info:
                raise TargetBuildError(f"{name} target at {out_dir}: its greedy outputs could not be recorded in {info_path}")
            if info["greedy_token_ids"] == recorded:
                return out_dir
        difference = fingerprint_difference(info["greedy_token_ids"], recorded)
        if ACCEPT_TARGET_FINGERPRINT.get():
            log(f"{name} target at {out_dir}: {difference}; used anyway ({ACCEPT_UNRECORDED_ENV}=1)")
            return out_dir
        log(f"{name} target at {out_dir}: {difference}; rebuilding")
    _build_process("build", name, str(out_dir), json.dumps(dataclasses.asdict(spec)), log=log)
    info = json.loads(info_path.read_text())
    if recorded is None:
        log(f"{name} target: no greedy outputs recorded for spec {spec.fingerprint}; built unchecked (record them with "
            "`python -m eagle3_assets.demo.target_building record`)")  # fmt: skip
        return out_dir
    difference = fingerprint_difference(info["greedy_token_ids"], recorded)
    if difference and not ACCEPT_TARGET_FINGERPRINT.get():
        raise TargetBuildError(
            f"the {name} target built at {out_dir} does not do what was recorded for its spec: {difference}. The build's "
            f"arithmetic is pinned ({BUILD_ENVIRONMENT}), so this CPU computes differently; tests that depend on what the "
            f"target writes may then not hold. Set {ACCEPT_UNRECORDED_ENV}=1 to use it anyway"
        )
    return out_dir


def _spec(name: str, fields: dict | None = None):
    module, _, spec_class, _ = BUILT_TARGETS[name]
    return getattr(importlib.import_module(module), spec_class)(**(fields or {}))


def _record_behaviour(name: str, out_dir: Path) -> list[list[int]]:
    """Compute the greedy outputs of the build at ``out_dir`` and keep them in its build info."""
    greedy = behaviour_fingerprint(out_dir, trust_remote_code=BUILT_TARGETS[name][3])
    info_path = Path(out_dir) / BUILD_INFO
    info = json.loads(info_path.read_text())
    try:
        write_json_atomic(info_path, {**info, "greedy_token_ids": greedy, "build_environment": BUILD_ENVIRONMENT})
    except OSError as exc:  # a shared, read-only cache: checked again by the next process
        print(f"{name} target: could not record its greedy outputs in {info_path}: {exc}")
    return greedy


def main(argv: Sequence[str] | None = None) -> None:
    """``build NAME DIR SPEC_JSON``, ``fingerprint NAME DIR`` (run under :data:`BUILD_ENVIRONMENT` by
    :func:`checked_build`); ``ensure NAME DIR [NAME DIR ...]``: :func:`checked_build` of each from its default spec,
    one after the other (what the test session starts in the background); and ``record [DIR]``: build every
    built-in target from its default spec and write their greedy outputs into ``target_fingerprints.json`` (after
    a deliberate change of a spec or of the data)."""
    parser = argparse.ArgumentParser(prog="python -m eagle3_assets.demo.target_building")
    parser.add_argument("command", choices=["build", "fingerprint", "ensure", "record"])
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "build":
        name, out_dir, fields = args.rest
        module, function, _, _ = BUILT_TARGETS[name]
        getattr(importlib.import_module(module), function)(Path(out_dir), _spec(name, json.loads(fields)), log=lambda line: print(line, flush=True))
        _record_behaviour(name, Path(out_dir))
    elif args.command == "fingerprint":
        name, out_dir = args.rest
        _record_behaviour(name, Path(out_dir))
    elif args.command == "ensure":
        for name, out_dir in zip(args.rest[::2], args.rest[1::2], strict=True):
            checked_build(name, Path(out_dir), _spec(name), log=lambda line: print(line, flush=True))
    else:
        root = Path(args.rest[0] if args.rest else ".cache/fingerprint-record")
        recorded = {}
        for name in BUILT_TARGETS:
            spec = _spec(name)
            _build_process("build", name, str(root / name), json.dumps(dataclasses.asdict(spec)), log=print)
            info = json.loads((root / name / BUILD_INFO).read_text())
            recorded[name] = {"spec_fingerprint": spec.fingerprint, "greedy_token_ids": info["greedy_token_ids"]}
        write_json_atomic(RECORDED_FINGERPRINTS, recorded)
        print(f"recorded {sorted(recorded)} in {RECORDED_FINGERPRINTS}")


def generation_prompt(chat_template: str, question: str) -> str:
    """The generation prompt ``chat_template`` renders for one user question, before any tokenizer exists.

    The tokenizer is trained on these prompts, so they are rendered from the
    template itself with jinja2 (as transformers does) rather than written out
    by hand a second time.
    """
    import jinja2

    return jinja2.Template(chat_template).render(messages=[{"role": "user", "content": question}], add_generation_prompt=True)


if __name__ == "__main__":
    main()
