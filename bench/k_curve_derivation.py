"""How close is the acceptance curve derived from one server at the largest k to one server per k?

``draft_evaluation`` on a CPU serves the draft once, at the largest k, and
derives the acceptance length at each smaller k from the per-position rates
(:mod:`eagle3_assets.core.evaluation.speculation_depth` says why that is exact per
drafting step but not over a run). This serves the same draft at every k on
the same held-out prompts and prints derived against measured, with their
ratio, in one run.

    .venv/bin/python bench/k_curve_derivation.py                     # a draft trained here in seconds on the tiny target
    .venv/bin/python bench/k_curve_derivation.py --draft DIR --target DIR --eval-prompts held_out.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def demo_draft(target: Path, work: Path) -> Path:
    from tests.test_deployed_draft_watch import trained_draft

    return trained_draft(target, work)


def main() -> None:
    from eagle3_assets.core.evaluation.acceptance import evaluate, load_conversations
    from eagle3_assets.core.evaluation.speculation_depth import derived_curve
    from eagle3_assets.core.evaluation.job import EVAL_MAX_TOKENS
    from eagle3_assets.core.serving.profile import ServingProfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None, help="target directory (default: the demo's tiny target)")
    parser.add_argument("--draft", type=Path, default=None, help="an exported EAGLE-3 draft (default: train one on the tiny target)")
    parser.add_argument("--eval-prompts", default=None, help="held-out prompts (default: the demo's)")
    parser.add_argument("--k-values", default="1,2,3,4,5")
    parser.add_argument("--max-tokens", type=int, default=EVAL_MAX_TOKENS)
    args = parser.parse_args()
    ks = sorted(int(k) for k in args.k_values.split(","))
    if args.target is None:
        from eagle3_assets.demo.stack import tiny_target_dir

        args.target = tiny_target_dir()
    if args.eval_prompts is None:
        from eagle3_assets.demo.stack import demo_eval_prompts_path

        args.eval_prompts = str(demo_eval_prompts_path())
    work = Path(tempfile.mkdtemp(prefix="k-curve-"))
    draft = args.draft or demo_draft(args.target, work / "draft")
    _, conversations = load_conversations(args.eval_prompts)
    labels = {f"k{k}": k for k in ks}
    results = evaluate(
        args.target, {label: draft for label in labels}, conversations, num_speculative_tokens=ks[-1], max_tokens=args.max_tokens,
        include_reference=False, server_log_dir=work, k_by_label=labels, profile=ServingProfile(),
    )  # fmt: skip
    derived = derived_curve(results[f"k{ks[-1]}"].acceptance_rate_per_position, ks)
    print(f"\n{len(conversations)} held-out prompts, greedy, {args.max_tokens} tokens; derived from one server at k={ks[-1]}:")
    print("   k   measured   derived   derived/measured")
    for point in derived:
        measured = results[f"k{point.k}"].mean_acceptance_length
        print(f"{point.k:4d}   {measured:8.3f}   {point.acceptance_length:7.3f}   {point.acceptance_length / measured:8.3f}")


if __name__ == "__main__":
    main()
