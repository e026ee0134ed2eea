"""What each of the draft's norm flags buys: acceptance per position through vLLM, and time per training step.

Trains the draft on a data directory's hidden states (what ``make demo`` leaves
under ``data/``) at the demo's recipe (20 epochs, learning rate 3e-3, warm-up
0.05, cosine, depth 3, 1,024 tokens per micro-batch) once per norm variant and
seed: plain EAGLE-3, EAGLE 3.1 (``fc_norm`` + ``norm_output``), each flag
alone, and speculators' defaults (``norm_before_fc`` + ``norm_output`` +
``norm_before_residual``). Every draft is served through vLLM speculative
decoding at ``num_speculative_tokens`` 5 on the same held-out prompts, greedy.
Prints, per variant, the mean acceptance length (mean of the seeds and their
range), the acceptance rate per draft position (means), the training's time
per optimizer step, and each against plain EAGLE-3's measured in the same run.

    make demo && .venv/bin/python bench/draft_norms.py                          # every variant, seed 0
    .venv/bin/python bench/draft_norms.py --variants plain eagle3.1 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.training_defaults import RECIPES, train_and_export  # noqa: E402
from eagle3_assets.core.training.throughput import NORM_VARIANTS  # noqa: E402

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
    args = parser.parse_args()

    data = Path(args.data)
    if not (data / "vocab_mapping" / "vocab_mapping.safetensors").is_file() or not (data / "hidden_states").is_dir():
        sys.exit(f"{data}: no hidden_states/ and vocab_mapping/ here; run `make demo` (or the graph on your target) first")
    if args.target:
        target = Path(args.target)
    else:  # the target the states were extracted from, as their sidecar records it
        sidecar = next((data / "hidden_states").glob("*/metadata.json"))
        target = Path(json.loads(sidecar.read_text())["target_path"])
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

    drafts, step_s = {}, {}
    for variant in args.variants:
        for seed in args.seeds:
            label = f"{variant}-seed{seed}"
            recipe = {**RECIPES["demo_recipe"], **NORM_VARIANTS[variant], "seed": seed}
            export, schedule, seconds = train_and_export(label, recipe, data, target, work, args.max_seq_len)
            drafts[label], step_s[label] = export, seconds / schedule["optimizer_steps"]
            print(f"{label}: trained in {seconds:.0f}s, {schedule['optimizer_steps']} steps, {step_s[label] * 1e3:.1f} ms/step", flush=True)

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
        print(f"\nper held-out set, one prompt at a time (mean of the seeds; spread: min / median / max over prompts of seed {args.seeds[0]}):")
        print("| set | variant | acceptance | ratio | per position | spread over prompts |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in extra:
            for variant in args.variants:
                runs = [results[f"{variant}-seed{seed}"].per_set[name] for seed in args.seeds]
                mean = statistics.fmean(r.mean_acceptance_length for r in runs)
                positions = [statistics.fmean(r.acceptance_rate_per_position[i] for r in runs) for i in range(args.num_speculative_tokens)]
                spread = runs[0].to_dict()["spread_over_prompts"]
                by_set.setdefault(name, {})[variant] = {"acceptance": mean, "per_position": positions, "spread": spread}
                ratio = mean / by_set[name][args.variants[0]]["acceptance"]
                print(
                    f"| {name} | {variant} | {mean:.3f} | {ratio:.3f} | {' '.join(f'{p:.2f}' for p in positions)} | "
                    f"{spread['min']:.2f} / {spread['median']:.2f} / {spread['max']:.2f} |"
                )
    report = {"table": table, "by_set": by_set, "target": str(target), "prompts": len(conversations)}
    (work / "report.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
