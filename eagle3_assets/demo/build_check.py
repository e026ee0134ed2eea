"""A built-in target built alike on every machine, as far as a CPU allows, and checked by what it does.

A seed fixes the data order and the initial weights, but not the arithmetic:
300 steps of AdamW carry a difference in the last bit of a sum into other weights, and the sums differ
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
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_assets.core.storage.files import write_json_atomic
from eagle3_assets.demo.environment import ACCEPT_TARGET_FINGERPRINT
from eagle3_assets.demo.prompt_set import demo_prompts, eval_prompts
from eagle3_assets.demo.target_building import BUILD_INFO, deterministic_torch

RECORDED_FINGERPRINTS = Path(__file__).with_name("target_fingerprints.json")
ACCEPT_UNRECORDED_ENV = ACCEPT_TARGET_FINGERPRINT.name  # 1: use a build whose greedy outputs differ from the recorded

# Each built-in target: (its module, its build function, its spec class, whether its tokenizer is remote code).
BUILT_TARGETS = {
    "tiny": ("eagle3_assets.demo.tiny_target", "build_tiny_target", "TinyTargetSpec", False),
    "qwen3": ("eagle3_assets.demo.qwen3_target", "build_qwen3_target", "Qwen3TargetSpec", False),
    "kimi": ("eagle3_assets.demo.kimi_target", "build_kimi_target", "KimiTargetSpec", True),
    "long": ("eagle3_assets.demo.long_target", "build_long_target", "LongTargetSpec", False),
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


def fingerprint_prompts() -> list[str]:
    """The fixed questions a built target's greedy outputs are recorded on: demo questions and held-out ones."""
    return [p["conversations"][0]["value"] for p in demo_prompts()[:4]] + [p["question"] for p in eval_prompts()[:4]]


def fingerprint_conversations(name: str) -> list[list[dict]]:
    """The conversations target ``name``'s greedy outputs are recorded on: the long target's own (it answers its own
    task families, some after a history), the shared questions for the others."""
    if name == "long":
        from eagle3_assets.demo.long_prompts import fingerprint_questions

        return fingerprint_questions()
    return [[{"role": "user", "content": question}] for question in fingerprint_prompts()]


def behaviour_fingerprint(
    model_dir: Path, trust_remote_code: bool = False, tokens: int = FINGERPRINT_TOKENS, name: str = "tiny"
) -> list[list[int]]:
    """What the target ``name`` at ``model_dir`` does: its greedy token ids after each fingerprint conversation's generation prompt.

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
        for messages in fingerprint_conversations(name):
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


# The instruction sets that decide which kernels a pinned build still runs. Two machines whose sets differ were seen
# to build other weights from the same seed, pins and lock (the tiny target's greedy token 8 after prompt 0: 484 on the
# machine the records were first made on, without AMX; 559 on one with AVX-512 FP16 and AMX, three builds alike there).
ARITHMETIC_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_class(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's arithmetic class: which of :data:`ARITHMETIC_FLAGS` it has ("unknown" where the kernel does not say)."""
    try:
        flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return "unknown"
    return "+".join(flag for flag in ARITHMETIC_FLAGS if flag in flags) or "none"


def recorded_fingerprints(name: str, spec) -> list[list[list[int]]]:
    """Every greedy output recorded for target ``name`` built from ``spec``, this CPU class's own record first, else the
    first machine's (empty: nothing recorded for this spec). A build doing any of them is one the suite passed with:
    a class may compute like another (a machine with AVX-512 but not AMX built the long target as the AVX2-only one
    did), and the first record's class is not named."""
    recorded = json.loads(RECORDED_FINGERPRINTS.read_text()).get(name) if RECORDED_FINGERPRINTS.is_file() else None
    if not recorded or recorded.get("spec_fingerprint") != spec.fingerprint:
        return []
    by_class = recorded.get("by_cpu_class", {})
    own = by_class.get(cpu_class(), recorded["greedy_token_ids"])
    return [own] + [greedy for greedy in [recorded["greedy_token_ids"], *by_class.values()] if greedy != own]


def record_entry(previous: dict | None, spec, greedy: list[list[int]]) -> dict:
    """What ``record`` keeps for a target: a new spec's outputs as its first record; the same spec's, when they differ
    from the first record, under this CPU's class beside it (a machine of another class computes differently)."""
    if not previous or previous.get("spec_fingerprint") != spec.fingerprint:
        return {"spec_fingerprint": spec.fingerprint, "greedy_token_ids": greedy}
    by_class = {k: v for k, v in previous.get("by_cpu_class", {}).items() if k != cpu_class()}
    if greedy != previous["greedy_token_ids"]:
        by_class[cpu_class()] = greedy
    return {**previous, "by_cpu_class": by_class} if by_class else {k: v for k, v in previous.items() if k != "by_cpu_class"}


def fingerprint_difference(observed: list[list[int]], recorded: list[list[int]], name: str = "tiny") -> str | None:
    """Where target ``name``'s ``observed`` greedy outputs first leave the ``recorded`` ones, or None when they are the same."""
    prompts = [messages[-1]["content"] for messages in fingerprint_conversations(name)]
    for index, (mine, theirs) in enumerate(zip(observed, recorded)):
        if mine != theirs:
            at = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            return f"after prompt {index} ({prompts[index]!r}) greedy token {at} is {mine[at:at + 1]}, recorded {theirs[at:at + 1]}"
    return None if len(observed) == len(recorded) else f"{len(observed)} outputs, {len(recorded)} recorded"


def _build_process(*arguments: str, log: Callable[[str], None]) -> None:
    """``python -m eagle3_assets.demo.build_check ARGUMENTS`` under :data:`BUILD_ENVIRONMENT`, its output logged."""
    command = [sys.executable, "-m", "eagle3_assets.demo.build_check", *arguments]
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
    recorded = recorded_fingerprints(name, spec)
    return info.get("fingerprint") == spec.fingerprint and (not recorded or info.get("greedy_token_ids") in recorded)


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
    (a changed one) is built and logged as unchecked. One process builds a
    directory at a time; another waits for it and then uses its build.
    """
    out_dir = Path(out_dir)
    if is_checked_build(name, out_dir, spec):
        return out_dir
    with _build_lock(out_dir):
        return _checked_build(name, out_dir, spec, log)


def _checked_build(name: str, out_dir: Path, spec, log: Callable[[str], None] = print) -> Path:
    """:func:`checked_build` once its caller holds the directory's build lock."""
    recorded = recorded_fingerprints(name, spec)
    info_path = out_dir / BUILD_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if info.get("fingerprint") == spec.fingerprint:
        if not recorded or info.get("greedy_token_ids") in recorded:
            return out_dir
        if "greedy_token_ids" not in info:  # built before the check: check it once
            _build_process("fingerprint", name, str(out_dir), log=log)
            info = json.loads(info_path.read_text())
            if "greedy_token_ids" not in info:
                raise TargetBuildError(f"{name} target at {out_dir}: its greedy outputs could not be recorded in {info_path}")
            if info["greedy_token_ids"] in recorded:
                return out_dir
        difference = fingerprint_difference(info["greedy_token_ids"], recorded[0], name)
        if ACCEPT_TARGET_FINGERPRINT.get():
            log(f"{name} target at {out_dir}: {difference}; used anyway ({ACCEPT_UNRECORDED_ENV}=1)")
            return out_dir
        log(f"{name} target at {out_dir}: {difference}; rebuilding")
    _build_process("build", name, str(out_dir), json.dumps(dataclasses.asdict(spec)), log=log)
    info = json.loads(info_path.read_text())
    if not recorded:
        log(f"{name} target: no greedy outputs recorded for spec {spec.fingerprint}; built unchecked (record them with "
            "`python -m eagle3_assets.demo.build_check record`)")  # fmt: skip
        return out_dir
    if info["greedy_token_ids"] in recorded:
        return out_dir
    difference = fingerprint_difference(info["greedy_token_ids"], recorded[0], name)
    if len(recorded) > 1:
        difference += f" (nor does it match any of the {len(recorded) - 1} other CPU classes' records)"
    if not ACCEPT_TARGET_FINGERPRINT.get():
        raise TargetBuildError(
            f"the {name} target built at {out_dir} does not do what was recorded for its spec: {difference}. The build's "
            f"arithmetic is pinned ({BUILD_ENVIRONMENT}), so this CPU (class {cpu_class()}) computes differently; tests that "
            f"depend on what the target writes may then not hold. Set {ACCEPT_UNRECORDED_ENV}=1 to use it anyway, or, once "
            "the suite passes with it, record it for this CPU class: `python -m eagle3_assets.demo.build_check record`"
        )
    return out_dir


def _spec(name: str, fields: dict | None = None):
    module, _, spec_class, _ = BUILT_TARGETS[name]
    return getattr(importlib.import_module(module), spec_class)(**(fields or {}))


def _record_behaviour(name: str, out_dir: Path) -> list[list[int]]:
    """Compute the greedy outputs of the build at ``out_dir`` and keep them in its build info."""
    greedy = behaviour_fingerprint(out_dir, trust_remote_code=BUILT_TARGETS[name][3], name=name)
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
    one after the other (what the test session starts in the background); and ``record [DIR [NAME ...]]``: build every
    built-in target (or those named) from its default spec and write their greedy outputs into
    ``target_fingerprints.json`` (after a deliberate change of a spec or of the data)."""
    parser = argparse.ArgumentParser(prog="python -m eagle3_assets.demo.build_check")
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
        names = args.rest[1:] or list(BUILT_TARGETS)  # `record DIR NAME...`: those targets only, the others' records kept
        recorded = json.loads(RECORDED_FINGERPRINTS.read_text()) if RECORDED_FINGERPRINTS.is_file() else {}
        for name in names:
            spec = _spec(name)
            _build_process("build", name, str(root / name), json.dumps(dataclasses.asdict(spec)), log=print)
            info = json.loads((root / name / BUILD_INFO).read_text())
            recorded[name] = record_entry(recorded.get(name), spec, info["greedy_token_ids"])
        write_json_atomic(RECORDED_FINGERPRINTS, recorded)
        print(f"recorded {sorted(recorded)} in {RECORDED_FINGERPRINTS}")


if __name__ == "__main__":
    main()
