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
    from eagle3_assets.core.serving.profile import ServingProfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO / "data"), help="data directory holding hidden_states/ and vocab_mapping/")
    parser.add_argument("--target", default=None, help="target model directory (default: the hidden states' own target)")
    parser.add_argument("--eval-prompts", default=None, help="held-out prompts (default: <data>/demo/eval_prompts.jsonl)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(NORM_VARIANTS), help="the first is the reference")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--max-seq-len", type=int, default=512, help="the demo's")
    parser.add_argument("--work", default=None, help="where drafts are written (default: <data>/bench_draft_norms)")
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
    _, conversations = load_conversations(eval_prompts)

    drafts, step_s = {}, {}
    for variant in args.variants:
        for seed in args.seeds:
            label = f"{variant}-seed{seed}"
            recipe = {**RECIPES["demo_recipe"], **NORM_VARIANTS[variant], "seed": seed}
            export, schedule, seconds = train_and_export(label, recipe, data, target, work, args.max_seq_len)
            drafts[label], step_s[label] = export, seconds / schedule["optimizer_steps"]
            print(f"{label}: trained in {seconds:.0f}s, {schedule['optimizer_steps']} steps, {step_s[label] * 1e3:.1f} ms/step", flush=True)

    results = evaluate(
        target, drafts, conversations, num_speculative_tokens=args.num_speculative_tokens, include_reference=False,
        server_log_dir=work, profile=ServingProfile(),
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
    (work / "report.json").write_text(json.dumps({"table": table, "target": str(target), "prompts": len(conversations)}, indent=2))


if __name__ == "__main__":
    main()
