"""What each of the draft's norm flags buys: acceptance per position through vLLM, and time per training step.

Trains the draft on a data directory's hidden states (what ``make demo`` leaves
under ``data/``) at the demo's recipe (20 epochs, learning rate 3e-3, warm-up
0.05, cosine, depth 3, 1,024 tokens per micro-batch) once per norm variant and
seed: plain EAGLE-3 (every flag off), EAGLE 3.1 (``fc_norm`` + ``norm_output``),
each flag alone, and speculators' defaults (``norm_before_fc`` + ``norm_output`` +
``norm_before_residual``); each variant sets all four flags, the rest of the
recipe is TrainConfig's defaults. Every draft is served through vLLM speculative
decoding at ``num_speculative_tokens`` 5 on the same held-out prompts, greedy,
and, while its server is up, on the held-out sets ``draft_evaluation`` builds
beside the standard one (``--prompt-sets``: the long-context and the
template-perturbation set by default), each set served as that stage serves it
(one concurrent pass where vLLM returns each request's spec-decode counts).
Prints, per variant, the mean acceptance length (mean of the seeds and their
range), the acceptance rate per draft position (means), the training's time
per optimizer step, and each against the first variant's measured in the same
run; then the same per held-out set, with the range over seeds per position.
A rerun reuses the drafts this bench exported before for the same recipe,
states and target (``--retrain``: train them again).

    make demo && .venv/bin/python bench/draft_norms.py                          # every variant, seed 0
    .venv/bin/python bench/draft_norms.py --variants norm_before_residual plain eagle3.1 --seeds 0 1 2
    .venv/bin/python bench/draft_norms.py --variants norm_before_residual --seeds 0 1 2 --setting pack_samples=false \
        --work data/bench_draft_norms_padded                                     # another setting under every variant
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.peer_acceptance import parse_settings  # noqa: E402
from bench.training_defaults import RECIPES, states_target, train_and_export  # noqa: E402
from eagle3_assets.core.training.throughput import NORM_VARIANTS  # noqa: E402


def trained_draft(label: str, recipe: dict, data: Path, target: Path, work: Path, max_seq_len: int, retrain: bool) -> tuple[Path, dict, float, bool]:
    """The draft of ``label`` trained with ``recipe``: the one an earlier run of this bench exported for the same
    recipe, states and target (so a rerun after a failed evaluation does not train again), else trained now."""
    from eagle3_assets.core.training.config import trained_settings

    record = work / label / "trained.json"
    # The defaults the recipe leaves unnamed count too: a draft trained before one changed is another draft.
    key = {"recipe": trained_settings(recipe), "data": str(data.resolve()), "target": str(target), "max_seq_len": max_seq_len}
    if not retrain and record.is_file():
        earlier = json.loads(record.read_text())
        if earlier["key"] == key and (Path(earlier["export"]) / "config.json").is_file():
            return Path(earlier["export"]), earlier["schedule"], earlier["seconds"], True
    export, schedule, seconds = train_and_export(label, recipe, data, target, work, max_seq_len)
    written = record.with_suffix(".json.tmp")
    written.write_text(json.dumps({"key": key, "export": str(export), "schedule": schedule, "seconds": seconds}, default=str))
    written.replace(record)
    return export, schedule, seconds, False


DEFAULT_VARIANTS = ["plain", "eagle3.1", "fc_norm", "norm_output", "norm_before_fc", "norm_before_residual", "speculators"]


def main() -> None:
    from eagle3_assets.core.evaluation.acceptance import evaluate, load_conversations
    from eagle3_assets.core.evaluation import prompt_sets as sets
    from eagle3_assets.core.serving.profile import ServingProfile, vllm_launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO / "data"), help="data directory holding hidden_states/ and vocab_mapping/")
    parser.add_argument("--target", default=None, help="target model directory (default: the hidden states' own target)")
    parser.add_argument("--eval-prompts", default=None, help="held-out prompts (default: <data>/demo/eval_prompts.jsonl)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(NORM_VARIANTS), help="the first is the reference")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--max-seq-len", type=int, default=512, help="the demo's")
    parser.add_argument("--work", default=None, help="where drafts are written (default: <data>/bench_draft_norms)")
    parser.add_argument(
        "--prompt-sets", nargs="*", default=list(sets.BUILTIN_SETS), choices=list(sets.BUILTIN_SETS),
        help="held-out sets scored beside the standard one, as draft_evaluation builds them (default: both; none: the standard set alone)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128, help="completion tokens per prompt (draft_evaluation's default)")
    parser.add_argument("--retrain", action="store_true", help="train every draft again, even where this bench exported it before")
    parser.add_argument(
        "--setting", action="append", default=[], metavar="KEY=VALUE",
        help="a TrainConfig setting every variant trains with (repeatable), e.g. pack_samples=false",
    )  # fmt: skip
    args = parser.parse_args()

    data = Path(args.data)
    if not (data / "vocab_mapping" / "vocab_mapping.safetensors").is_file() or not (data / "hidden_states").is_dir():
        sys.exit(f"{data}: no hidden_states/ and vocab_mapping/ here; run `make demo` (or the graph on your target) first")
    target = Path(args.target) if args.target else states_target(data)
    eval_prompts = args.eval_prompts or str(data / "demo" / "eval_prompts.jsonl")
    work = Path(args.work) if args.work else data / "bench_draft_norms"
    ids, conversations = load_conversations(eval_prompts)
    profile = ServingProfile()
    extra = {}
    if args.prompt_sets:  # built as draft_evaluation's stage builds them, for the context its servers get
        from transformers import AutoTokenizer

        max_model_len = int(vllm_launch(profile, target).engine_args["max_model_len"])
        built = sets.build_sets(args.prompt_sets, ids, conversations, tokenizer=AutoTokenizer.from_pretrained(target),
                                max_model_len=max_model_len, max_tokens=args.max_tokens)  # fmt: skip
        extra = {"standard": conversations, **{b.name: b.conversations for b in built}}

    settings = parse_settings(args.setting, "--setting")
    started = time.monotonic()
    drafts, step_s = {}, {}
    for variant in args.variants:
        for seed in args.seeds:
            label = f"{variant}-seed{seed}"
            recipe = {**RECIPES["demo_recipe"], **settings, **NORM_VARIANTS[variant], "seed": seed}
            export, schedule, seconds, reused = trained_draft(label, recipe, data, target, work, args.max_seq_len, args.retrain)
            drafts[label], step_s[label] = export, seconds / schedule["optimizer_steps"]
            how = "reused (trained earlier" if reused else "trained"
            print(
                f"{label}: {how} in {seconds:.0f}s{')' if reused else ''}, {schedule['optimizer_steps']} steps, "
                f"{step_s[label] * 1e3:.1f} ms/step", flush=True,
            )  # fmt: skip

    results = evaluate(
        target, drafts, conversations, num_speculative_tokens=args.num_speculative_tokens, max_tokens=args.max_tokens,
        include_reference=False, server_log_dir=work, profile=profile, prompt_sets=extra or None,
    )  # fmt: skip
    table = {}
    for variant in args.variants:
        runs = [results[f"{variant}-seed{seed}"] for seed in args.seeds]
        lengths = [r.mean_acceptance_length or 1.0 for r in runs]
        positions = [statistics.fmean(r.acceptance_rate_per_position[i] for r in runs) for i in range(args.num_speculative_tokens)]
        table[variant] = {
            "acceptance": statistics.fmean(lengths), "range": [min(lengths), max(lengths)], "per_position": positions,
            "step_s": statistics.fmean(step_s[f"{variant}-seed{seed}"] for seed in args.seeds),
            "seeds": {seed: length for seed, length in zip(args.seeds, lengths)},
        }  # fmt: skip
    reference = table[args.variants[0]]
    print(
        f"\nk = {args.num_speculative_tokens}, {len(conversations)} held-out prompts, seeds {args.seeds}, demo recipe at depth "
        f"{RECIPES['demo_recipe']['ttt_steps']}; ratios against {args.variants[0]} in this run:"
    )
    print("| variant | acceptance (range) | ratio | per position | ms per step | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant, row in table.items():
        print(
            f"| {variant} | {row['acceptance']:.3f} ({row['range'][0]:.2f}-{row['range'][1]:.2f}) | {row['acceptance'] / reference['acceptance']:.3f} | "
            f"{' '.join(f'{p:.2f}' for p in row['per_position'])} | {row['step_s'] * 1e3:.1f} | {row['step_s'] / reference['step_s']:.2f} |"
        )
    by_set = {}
    if extra:
        print(
            f"\nper held-out set (k = {args.num_speculative_tokens}, seeds {args.seeds}): acceptance length, mean of the seeds "
            f"(min-max over seeds); per position, mean (min-max over seeds); ratio against {args.variants[0]} on the same set. "
            f"Spread over prompts: min / median / max of seed {args.seeds[0]}'s prompts."
        )
        for name, prompts in extra.items():
            served = {results[label].per_set[name].per_prompt_source for label in results}
            # Each set is served as draft_evaluation serves it: one concurrent pass where vLLM returns per-request counts.
            how = " / ".join(source or "no per-prompt figures" for source in sorted(served))
            print(f"{name}: {len(prompts)} prompts; figures from {how}")
        print("| set | variant | acceptance (range over seeds) | ratio | per position, mean | per position, range over seeds | spread over prompts |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name in extra:
            for variant in args.variants:
                runs = {seed: results[f"{variant}-seed{seed}"].per_set[name] for seed in args.seeds}
                lengths = {seed: r.mean_acceptance_length or 1.0 for seed, r in runs.items()}  # no accepted draft: length 1
                rates = [r.acceptance_rate_per_position or [0.0] * args.num_speculative_tokens for r in runs.values()]
                per_position = [[seed_rates[i] for seed_rates in rates] for i in range(args.num_speculative_tokens)]
                spread = runs[args.seeds[0]].spread_over_prompts() or {}
                row = {
                    "acceptance": statistics.fmean(lengths.values()), "range": [min(lengths.values()), max(lengths.values())],
                    "seeds": lengths, "per_position": [statistics.fmean(p) for p in per_position],
                    "per_position_range": [[min(p), max(p)] for p in per_position], "prompts": runs[args.seeds[0]].prompts,
                    "failed": {seed: r.failed for seed, r in runs.items()}, "spread_over_prompts": spread,
                }  # fmt: skip
                if any(row["failed"].values()):  # a failed request has no acceptance: the set's figure covers fewer prompts
                    print(f"{name}: {variant}: requests failed per seed {row['failed']}; see {work}/vllm-*.log")
                by_set.setdefault(name, {})[variant] = row
                row["ratio"] = row["acceptance"] / by_set[name][args.variants[0]]["acceptance"]
                over_prompts = f"{spread['min']:.2f} / {spread['median']:.2f} / {spread['max']:.2f}" if "median" in spread else "-"
                print(
                    f"| {name} | {variant} | {row['acceptance']:.3f} ({row['range'][0]:.2f}-{row['range'][1]:.2f}) | {row['ratio']:.3f} | "
                    f"{' '.join(f'{p:.2f}' for p in row['per_position'])} | "
                    f"{' '.join(f'{lo:.2f}-{hi:.2f}' for lo, hi in row['per_position_range'])} | {over_prompts} |"
                )
    print(f"\nbench wall clock: {time.monotonic() - started:.0f}s (training and evaluation)")
    report = {
        "table": table, "by_set": by_set, "target": str(target), "prompts": len(conversations), "seeds": args.seeds,
        "num_speculative_tokens": args.num_speculative_tokens, "variants": args.variants,
    }  # fmt: skip
    (work / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
