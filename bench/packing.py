"""Packed against padded micro-batches: what an epoch's batch plan costs, for stored states or a length distribution.

For the lengths of a materialised ``hidden_states`` (or a synthetic spread of
lengths, the user's size by default: 10,000 samples of 200 to 4,096 tokens),
at ``--batch-tokens``, prints for each plan (``pack_samples`` true and false,
``core/training/data.py``): micro-batches per epoch, tokens over the budget's
(fill), padding, samples per micro-batch, the attention scores it computes
(a sample attends within itself either way: padded, over its micro-batch's
longest; packed, over its own length) and the time to plan an epoch; then
packed over padded for each. Acceptance is measured by
``bench/peer_acceptance.py --ours-variant padded:pack_samples=false``.

With ``--time``, it then trains one epoch of those states each way with the
platform's trainer on a demo target's recipe (``--demo-target``), ``--rounds``
times in alternating order, and prints tokens/s and the time per token of packed
over padded (the median round of each): what the plan's figures cost in a real
step, packed attention's per-sample calls included.

    .venv/bin/python bench/packing.py                                     # the user's size, synthetic
    .venv/bin/python bench/packing.py --hidden-states data/hidden_states --batch-tokens 1024   # the demo's states
    .venv/bin/python bench/packing.py --hidden-states /tmp/long/data/hidden_states --max-seq-len 8192 --batch-tokens 8192 \
        --time --demo-target long                                         # the long demo's states, timed
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def lengths_of(args) -> tuple[list[int], str]:
    if args.hidden_states:
        from eagle3_assets.core.training.data import index_hidden_states

        root = Path(args.hidden_states)
        shards = sorted(p for p in root.iterdir() if (p / "metadata.json").is_file()) if not (root / "metadata.json").is_file() else [root]
        samples = index_hidden_states(shards).samples
        return [min(s.length, args.max_seq_len) for s in samples], f"{len(samples)} samples of {root}"
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.shortest, args.longest) for _ in range(args.samples)]
    return lengths, f"{args.samples} samples of {args.shortest} to {args.longest} tokens (uniform, seed {args.seed})"


def plan_figures(lengths: list[int], batch_tokens: int, packed: bool) -> dict:
    from eagle3_assets.core.training.data import epoch_micro_batches

    started = time.perf_counter()
    batches = epoch_micro_batches(lengths, batch_tokens, seed=0, epoch=0, packed=packed)
    seconds = time.perf_counter() - started
    tokens = sum(lengths)
    computed = sum(sum(lengths[i] for i in b) if packed else max(lengths[i] for i in b) * len(b) for b in batches)
    scores = sum(lengths[i] ** 2 for b in batches for i in b) if packed else sum(max(lengths[i] for i in b) ** 2 * len(b) for b in batches)
    return {
        "micro_batches": len(batches),
        "fill": tokens / (len(batches) * batch_tokens),
        "padding": computed / tokens - 1,
        "samples_per_batch": len(lengths) / len(batches),
        "attention_scores": scores,
        "plan_ms": seconds * 1000,
    }


def timed_epochs(shards: list[Path], recipe: dict, rounds: int, work: Path) -> dict[str, list[dict]]:
    """``shards`` trained on ``recipe`` (one epoch, from :func:`main`) packed and padded with the platform's trainer,
    ``rounds`` times, alternating which goes first (the machine's drift falls on both alike); each run's tokens/s of
    training and its optimizer steps."""
    import json
    import shutil

    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.launch import run_training

    sidecar = json.loads((shards[0] / "metadata.json").read_text())
    vocab = shards[0].parent.parent / "vocab_mapping" / "vocab_mapping.safetensors"
    if not vocab.is_file():
        sys.exit(f"{vocab}: no vocabulary map beside the hidden states; materialise vocab_mapping first")
    runs: dict[str, list[dict]] = {"padded": [], "packed": []}
    for round_ in range(rounds):
        for name in ("packed", "padded") if round_ % 2 == 0 else ("padded", "packed"):
            training_dir = work / f"{name}-round{round_}"
            shutil.rmtree(training_dir, ignore_errors=True)  # from scratch each time: a resumed run would time nothing
            config = TrainConfig(
                hidden_state_dirs=[str(s) for s in shards], vocab_mapping=str(vocab), target_path=sidecar["target_path"],
                training_dir=str(training_dir), **{**recipe, "pack_samples": name == "packed"},
            )  # fmt: skip
            result = run_training(config)
            figures = {"tokens_per_s": result["train_tokens_per_s"], "optimizer_steps": result["schedule"]["optimizer_steps"]}
            print(f"packing: round {round_} {name}: {figures['tokens_per_s']:.1f} tokens/s, {figures['optimizer_steps']} optimizer steps", flush=True)
            runs[name].append(figures)
            shutil.rmtree(training_dir, ignore_errors=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-states", help="a hidden_states directory (its shards) or one shard; default: synthetic lengths")
    p.add_argument("--max-seq-len", type=int, default=4096, help="samples are cut here, as training cuts them")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per micro-batch (the default's upper bound)")
    p.add_argument("--samples", type=int, default=10_000)
    p.add_argument("--shortest", type=int, default=200)
    p.add_argument("--longest", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time", action="store_true", help="also train an epoch of --hidden-states each way and time it")
    p.add_argument("--demo-target", choices=["tiny", "kimi", "qwen3", "long"], default="tiny", help="whose demo recipe --time trains with")
    p.add_argument("--rounds", type=int, default=2, help="--time: epochs of each, alternating the order; the median is printed")
    p.add_argument("--work", default="/tmp/bench_packing", help="--time: where the training runs go (removed after each)")
    args = p.parse_args()
    if args.time and not args.hidden_states:
        sys.exit("--time trains on stored states: pass --hidden-states")

    lengths, described = lengths_of(args)
    print(f"packing: {described}, {sum(lengths):,} tokens, micro-batches of {args.batch_tokens:,} tokens")
    figures = {name: plan_figures(lengths, args.batch_tokens, packed) for name, packed in (("padded", False), ("packed", True))}
    print("| plan | micro-batches | fill | padding | samples a micro-batch | attention scores | planning ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, f in figures.items():
        print(
            f"| {name} | {f['micro_batches']:,} | {f['fill']:.3f} | {f['padding']:.2%} | {f['samples_per_batch']:.1f} | "
            f"{f['attention_scores']:.3g} | {f['plan_ms']:.0f} |"
        )
    packed, padded = figures["packed"], figures["padded"]
    print(
        f"packed over padded: micro-batches (optimizer steps at grad_accumulation 1) {packed['micro_batches'] / padded['micro_batches']:.3f}, "
        f"attention scores {packed['attention_scores'] / padded['attention_scores']:.3f}"
    )
    if not args.time:
        return
    import statistics

    sys.path.insert(0, str(REPO / "bench"))
    from peer_acceptance import demo_recipe, shard_dirs

    recipe = {**demo_recipe(args.demo_target), "max_seq_len": args.max_seq_len, "batch_tokens": args.batch_tokens, "epochs": 1}
    print(f"packing: timing one epoch each way, {args.rounds} round(s), the {args.demo_target} demo's recipe as {recipe}", flush=True)
    runs = timed_epochs(shard_dirs([args.hidden_states], Path()), recipe, args.rounds, Path(args.work))
    rate = {name: statistics.median(r["tokens_per_s"] for r in rows) for name, rows in runs.items()}
    print("| plan | optimizer steps an epoch | tokens/s (median of rounds) | each round | time per token over padded |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in runs.items():
        each = " / ".join(f"{r['tokens_per_s']:.1f}" for r in rows)
        print(f"| {name} | {rows[0]['optimizer_steps']} | {rate[name]:.1f} | {each} | {rate['padded'] / rate[name]:.3f} |")


if __name__ == "__main__":
    main()
