"""Acceptance by output position: the trained draft and its untrained twin, per bucket of output position, one pass each.

What ``draft_evaluation`` reports as ``by_output_position`` (docs/evaluation.md), on its own: the
draft servers are started with ``--per-request-spec-decode-metrics detailed``, the held-out
prompts go through each in one concurrent pass, and each response's per-step counts place every
verify step at its output position (:mod:`eagle3_assets.core.evaluation.output_position`). Prints
the bucket table (steps and mean acceptance length per bucket, trained and baseline), the decay
ratio (last filled bucket over the first) and how many requests' steps added up to their
completion, and checks the per-step counts against the ``/metrics`` counters of the same pass.
No timing: acceptance counts do not depend on the host's load.

    .venv/bin/python bench/output_position.py --draft DIR                         # the demo's tiny target and held-out prompts
    .venv/bin/python bench/output_position.py --demo-target long --draft DIR      # a built-in target, its own evaluation settings
    .venv/bin/python bench/output_position.py --demo-target long --draft DIR --eval-prompts held_out.jsonl --max-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    from eagle3_assets.core.evaluation.acceptance import evaluate, load_conversations, untrained_twin
    from eagle3_assets.core.evaluation.output_position import render_position_table
    from eagle3_assets.core.evaluation.job import EVAL_MAX_TOKENS
    from eagle3_assets.demo.targets import DEMO_TARGETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="an exported EAGLE-3 draft of the target")
    parser.add_argument("--demo-target", default="tiny", choices=sorted(DEMO_TARGETS), help="the built-in target it drafts for")
    parser.add_argument("--eval-prompts", default=None, help="held-out prompts (default: the demo's)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the target's evaluation setting, else EVAL_MAX_TOKENS")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--no-baseline", action="store_true", help="serve the trained draft only (one start fewer)")
    args = parser.parse_args()
    demo = DEMO_TARGETS[args.demo_target]
    settings = demo.evaluation or {}
    max_tokens = args.max_tokens or settings.get("max_tokens", EVAL_MAX_TOKENS)
    concurrency = args.concurrency or settings.get("concurrency", 8)
    if args.eval_prompts is None:
        from eagle3_assets.demo.stack import demo_eval_prompts_path

        args.eval_prompts = str(demo_eval_prompts_path())
    work = Path(tempfile.mkdtemp(prefix="output-position-"))
    target = demo.model_dir()
    drafts = {"trained": args.draft}
    if not args.no_baseline:
        drafts["baseline"] = untrained_twin(args.draft, work / "baseline_draft")
    _, conversations = load_conversations(args.eval_prompts)
    results = evaluate(
        target, drafts, conversations, num_speculative_tokens=args.k, max_tokens=max_tokens, concurrency=concurrency,
        include_reference=False, server_log_dir=work, profile=demo.serving["profile"],
    )  # fmt: skip
    figures = {label: r.to_dict().get("by_output_position") for label, r in results.items()}
    for label, r in results.items():
        steps = [s for s in (r.per_prompt_steps or []) if s is not None]
        listed = (sum(len(s.accepted) for s in steps), sum(sum(s.accepted) for s in steps))
        print(f"{label}: per-step lists {listed[0]} steps, {listed[1]} accepted; /metrics counters {r.drafts:.0f} drafts, {r.accepted:.0f} accepted; "
              f"completion tokens {r.output_tokens}, failed {r.failed}")  # fmt: skip
    print(f"\n{args.demo_target} target, {len(conversations)} prompts from {args.eval_prompts}, k={args.k}, max_tokens {max_tokens}, "
          f"{concurrency} in flight:\n")  # fmt: skip
    print(render_position_table(figures))
    (work / "by_output_position.json").write_text(json.dumps(figures, indent=1))
    print(f"\nfigures: {work / 'by_output_position.json'}")


if __name__ == "__main__":
    main()
