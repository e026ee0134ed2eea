"""What does the spread over prompts cost the default evaluation? The same pass with and without vLLM's per-request counts.

``draft_evaluation`` starts its draft servers with
``--per-request-spec-decode-metrics detailed`` (``PER_REQUEST_METRICS_LEVEL``) so
that each response carries its prompt's own spec-decode counts, every verify
step's included (:mod:`eagle3_assets.core.evaluation.spread`); the figures in
docs/performance.md were taken at ``summary``, before the per-step lists.
This serves the same draft on two servers at once, without and with the
argument, sends the standard set's concurrent pass to each in turn
``--repeats`` times (after one warm-up pass each), and prints the wall times,
their ratio, and whether the per-prompt counts add up to the ``/metrics``
counters; beside the wall times, the CPU seconds each server process spent per
pass, which a shared host's load moves far less. Only the ratios mean anything:
both servers run on the same host in the same run, and only one of them is sent
requests at a time.

    .venv/bin/python bench/per_request_metrics.py                    # a draft trained here in a minute on the tiny target
    .venv/bin/python bench/per_request_metrics.py --draft DIR --target DIR --eval-prompts held_out.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    from eagle3_assets.core.evaluation.acceptance import evaluation_servers, load_conversations, run_pass
    from eagle3_assets.core.evaluation.job import EVAL_MAX_TOKENS
    from eagle3_assets.core.serving.profile import ServingProfile
    from eagle3_assets.demo.targets import TINY_SERVING

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None, help="target directory (default: the demo's tiny target)")
    parser.add_argument("--draft", type=Path, default=None, help="an exported EAGLE-3 draft (default: train one on the tiny target)")
    parser.add_argument("--eval-prompts", default=None, help="held-out prompts (default: the demo's)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=EVAL_MAX_TOKENS)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="per-request-metrics-"))
    profile = ServingProfile()  # a target given by path is served as this host's EAGLE3_* environment says
    if args.target is None:
        from eagle3_assets.demo.stack import tiny_target_dir

        args.target, profile = tiny_target_dir(), TINY_SERVING["profile"]
    if args.eval_prompts is None:
        from eagle3_assets.demo.stack import demo_eval_prompts_path

        args.eval_prompts = str(demo_eval_prompts_path())
    if args.draft is None:
        from tests.test_deployed_draft_watch import trained_draft

        args.draft = trained_draft(args.target, work / "draft")
    _, conversations = load_conversations(args.eval_prompts)

    # Both servers up at once, passes taken in turn (after a warm-up pass each): a shared host's load drifts over
    # minutes, and alternating lets both sides meet the same drift.
    servers = {
        label: server
        for label, counted in (("without", False), ("with", True))
        for _, server in evaluation_servers(
            args.target, {label: args.draft}, args.k, profile=profile, include_reference=False, server_log_dir=work, per_request_metrics=counted
        )
    }  # fmt: skip
    passes: dict[str, list] = {label: [] for label in servers}
    cpu: dict[str, list[float]] = {label: [] for label in servers}
    with servers["without"], servers["with"]:
        for label, server in servers.items():
            run_pass(label, server.base_url, server.served_model_name, conversations, args.max_tokens, args.concurrency)  # warm-up
        for _ in range(args.repeats):
            for label, server in servers.items():
                before = server_cpu_s(server.process.pid)
                passes[label].append(run_pass(label, server.base_url, server.served_model_name, conversations, args.max_tokens, args.concurrency))
                cpu[label].append(server_cpu_s(server.process.pid) - before)
    walls = {label: [p.wall_s for p in runs] for label, runs in passes.items()}
    for label, runs in passes.items():
        last = runs[-1]
        spread = last.spread_over_prompts() or {}
        adds_up = f"per-prompt drafts {spread.get('drafts')} of the counters' {last.drafts:.0f}" if spread else "no per-prompt figures"
        print(
            f"{label} per-request metrics: passes {', '.join(f'{w:.1f}' for w in walls[label])} s wall, "
            f"{', '.join(f'{c:.1f}' for c in cpu[label])} s server CPU; acceptance {last.mean_acceptance_length:.3f}; {adds_up}"
        )
    print(f"\n{len(conversations)} prompts, {args.concurrency} in flight, {args.max_tokens} tokens, k={args.k}, medians with / without:")
    for name, figures in (("wall s per pass", walls), ("server CPU s per pass", cpu)):
        with_, without = statistics.median(figures["with"]), statistics.median(figures["without"])
        print(f"  {name}: {with_:.2f} / {without:.2f} (ratio {with_ / without:.3f})")


def server_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a server process and its children: on a shared host, steadier than wall time."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


if __name__ == "__main__":
    main()
