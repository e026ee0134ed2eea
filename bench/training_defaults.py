"""Do the training defaults make a useful draft? Acceptance with the defaults against the best settings tried.

Trains the draft on a data directory's hidden states (what ``make demo``, or the
graph on any target, leaves under ``$EAGLE3_DATA_DIR``) with the defaults
(schedule fitted to the data) and with other recipes, exports each, serves each
through vLLM speculative decoding on the held-out prompts, and prints every
mean acceptance length and the ratio of the defaults' to the best (goal: at
least 0.90). Same data, same seed, same prompts, one run.

    make demo && .venv/bin/python bench/training_defaults.py                   # the demo target
    .venv/bin/python bench/training_defaults.py --data /path/to/data --target /path/to/target \\
        --eval-prompts held_out.jsonl --trust-remote-code                      # any other target
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Recipes to compare with the defaults: the demo's hand-tuned one, the published large-target one
# (what the defaults were before they followed the data), and the fitted schedule at a third and
# three times its learning rate (is the fitted rate near the best?).
RECIPES = {
    "defaults": {},
    "demo_recipe": {"epochs": 20, "learning_rate": 3e-3, "warmup_ratio": 0.05, "ttt_steps": 3, "batch_tokens": 1024},
    "published_recipe": {"epochs": 10, "learning_rate": 1e-4, "batch_tokens": 16384},
    "fitted_lr_x3": {"lr_factor": 3.0},
    "fitted_lr_div3": {"lr_factor": 1 / 3},
}


def states_target(data: Path) -> Path:
    """The target a data directory's hidden states were extracted from, as their sidecar records it."""
    sidecar = next((data / "hidden_states").glob("*/metadata.json"))
    return Path(json.loads(sidecar.read_text())["target_path"])


def train_and_export(label: str, recipe: dict, data: Path, target: Path, work: Path, max_seq_len: int) -> tuple[Path, dict, float]:
    from eagle3_assets.core.training.checkpoints import export_trained_draft
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.launch import run_training
    from eagle3_assets.core.training.loop import resolve_schedule
    from eagle3_assets.core.training.sources import StoredShards

    shards = sorted(str(p) for p in (data / "hidden_states").iterdir() if (p / "metadata.json").is_file())
    settings = {k: v for k, v in recipe.items() if k != "lr_factor"}
    config = TrainConfig(
        hidden_state_dirs=shards,
        vocab_mapping=str(data / "vocab_mapping" / "vocab_mapping.safetensors"),
        target_path=str(target),
        training_dir=str(work / label / "training"),
        max_seq_len=max_seq_len,
        **settings,
    )
    if "lr_factor" in recipe:
        fitted, _, _, _ = resolve_schedule(config, StoredShards(shards))
        config = TrainConfig(**{**config.to_dict(), "learning_rate": fitted.learning_rate * recipe["lr_factor"]})
    started = time.monotonic()
    result = run_training(config)
    seconds = time.monotonic() - started
    export = export_trained_draft(result["checkpoint"], target, work / label / "model")
    return export, result["schedule"], seconds


def main() -> None:
    from eagle3_assets.core.evaluation.acceptance import evaluate, load_conversations
    from eagle3_assets.core.serving.profile import ServingProfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO / "data"), help="data directory holding hidden_states/ and vocab_mapping/")
    parser.add_argument("--target", default=None, help="target model directory (default: the hidden states' own target)")
    parser.add_argument("--eval-prompts", default=None, help="held-out prompts (default: the demo's)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--work", default=None, help="where drafts are written (default: <data>/bench_training_defaults)")
    parser.add_argument(
        "--setting", action="append", default=[], metavar="KEY=VALUE",
        help="a TrainConfig setting every recipe trains with (repeatable), e.g. pack_samples=false",
    )  # fmt: skip
    args = parser.parse_args()
    from bench.peer_acceptance import parse_settings

    settings = parse_settings(args.setting, "--setting")

    data = Path(args.data)
    if not (data / "vocab_mapping" / "vocab_mapping.safetensors").is_file() or not (data / "hidden_states").is_dir():
        sys.exit(f"{data}: no hidden_states/ and vocab_mapping/ here; run `make demo` (or the graph on your target) first")
    target = Path(args.target) if args.target else states_target(data)
    eval_prompts = args.eval_prompts or str(data / "demo" / "eval_prompts.jsonl")
    work = Path(args.work) if args.work else data / "bench_training_defaults"
    _, conversations = load_conversations(eval_prompts)

    drafts, facts = {}, {}
    for label in args.recipes:
        export, schedule, seconds = train_and_export(label, {**settings, **RECIPES[label]}, data, target, work, args.max_seq_len)
        drafts[label] = export
        facts[label] = {"schedule": schedule, "train_s": round(seconds, 1)}
        print(f"{label}: trained in {seconds:.0f}s: {schedule['optimizer_steps']} steps, batch {schedule['batch_tokens']}, "
              f"epochs {schedule['epochs']}, lr {schedule['learning_rate']:.2e}", flush=True)  # fmt: skip

    results = evaluate(
        target, drafts, conversations, num_speculative_tokens=args.num_speculative_tokens, include_reference=False,
        server_log_dir=work, profile=ServingProfile(trust_remote_code=args.trust_remote_code),
    )  # fmt: skip
    acceptance = {label: results[label].mean_acceptance_length for label in drafts}
    best_label = max(acceptance, key=acceptance.get)
    print(f"\nmean acceptance length at {args.num_speculative_tokens} speculative tokens, {len(conversations)} held-out prompts:")
    for label, value in acceptance.items():
        print(f"  {label:18s} {value:.3f}  (trained {facts[label]['train_s']:.0f}s)")
    if "defaults" in acceptance:
        print(f"defaults / best ({best_label}): {acceptance['defaults'] / acceptance[best_label]:.3f}  (goal: >= 0.90)")
    (work / "report.json").write_text(json.dumps({"acceptance": acceptance, "facts": facts, "target": str(target)}, indent=2))


if __name__ == "__main__":
    main()
