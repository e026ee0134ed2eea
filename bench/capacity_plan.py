"""The capacity plan on the story's figures, against the bytes per token measured on disk here.

In one run:

1. writes the demo's validated traces (the tiny target's templated reasoning,
   as the demo's prompts are answered) and extracts their hidden states in
   bf16 with the transformers backend: the bytes per token on disk against
   the plan's count (``bytes_per_token``: 8·H for the 3 aux states and the
   final one, plus 9 for the ids and the mask), their ratio, and the same
   layout at H = 7,168;
2. takes the demo traces' mean length: the prompt's tokens plus the
   generated ones, which the demo caps at 256 (``demo.plugin.MAX_TOKENS``),
   scaled to the story's 8,192 cap (the share of the cap a trace uses is
   kept);
3. prints the plan (core/planning/capacity.py, the one ``capacity_plan`` and
   ``hidden_states``' refusal use) for the story: 10,000 prompts in shards of
   128, H = 7,168, 3 aux states, bf16, a 3 TB volume on the GPU host; the
   training's GPU-hours at Kimi-K2's width (a one-layer draft of the
   ``kimi-k2`` preset, depth 7, 10 epochs) from the H200 rate measured in
   the training-at-scale issue (5,636 tokens/s, not in this run) and from the
   step's FLOPs at a 0.34 share of the H200's rate (a share taken from that
   same run, so the two agree by construction);
   and the same plan at 1,000 and 25,000 prompts (the story's ramp and its
   aborted run), with the verdict ``hidden_states`` would give.

    .venv/bin/python bench/capacity_plan.py [--samples 128] [--volume-tb 3] [--extraction-tokens-per-s 20000]

4. with ``--scale-only`` (no measurement: arithmetic only), the plan of a run
   on N nodes of a Ray cluster of 8 GPUs each (issue 43 item 6): 100,000
   prompts of the story's ~4,000 tokens, extraction at the assumed and the
   FLOP-derived per-GPU rates (8 GPUs an engine, one engine a node, a target
   load of ``--target-load-s`` per engine per run), training at the measured
   H200 rate over nodes x 8 GPUs (DDP scaling assumed), generation at the
   story's 2,222 output tokens/s per 8-GPU server, one server per node
   (assumed to add up), and the volume each way of storing the states needs::

    .venv/bin/python bench/capacity_plan.py --scale-only [--scale-prompts 100000] [--nodes 1 2 4 8] [--target-load-s 600]

Rates not measured here (the story's generation and extraction on its GPU
host) are command-line assumptions, printed as such. What is measured in a
run is the bytes per token on disk at H = 64 and the demo traces' lengths;
the figures at H = 7,168 are the formula (8·H + 9 bytes per token), and the
plans are arithmetic on assumed prompt counts and trace lengths.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))

from eagle3_assets.core.extraction.state_layout import bytes_per_token  # noqa: E402
from eagle3_assets.core.planning.capacity import PlanSettings, ShardFacts, Volume, human, plan_capacity  # noqa: E402
from eagle3_assets.core.planning.stage_rates import Rate, estimated_training_rate  # noqa: E402

STORY_PROMPTS = 10_000
STORY_SHARD = 128
STORY_CAP = 8192
STORY_HIDDEN = 7168
H200_KIMI_DEPTH7_TOKENS_PER_S = 5636.0  # bench/training.py --device cuda --preset kimi-k2 (training-at-scale issue)
# The story's server: 10,000 prompts of ~4,000 tokens in ~5 h on one 8-GPU vLLM server (docs/generation.md): derived, not measured here.
STORY_SERVER_TOKENS_PER_S = 2222.0
# Extraction per GPU at Kimi width, derived: 64 GFLOP per token (2 x 32 B active, assumed) at the training step's measured
# 0.34 share of an H200's 790 TFLOP/s (assumed to hold for a prefill); docs/performance.md, one refinement round.
KIMI_EXTRACTION_PER_GPU_DERIVED = 4200.0
LAYER_IDS = (2, 3, 4)


def measure(samples: int, threads: int) -> dict:
    import polars as pl
    import torch

    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, TargetFacts, extract_shard
    from eagle3_assets.core.extraction.traces import read_traces
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
    from eagle3_assets.demo.plugin import MAX_TOKENS
    from eagle3_assets.demo.stack import tiny_target_dir
    from eagle3_assets.demo.validated_traces import write_validated_traces

    torch.set_num_threads(threads)
    target = tiny_target_dir()
    work = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    traces_path = write_validated_traces(work, "shard-bench", target, count=samples, seed=11)
    frame = pl.read_parquet(traces_path, columns=["num_tokens", "loss_mask"])
    tokens = int(frame["num_tokens"].sum())
    generated = int(frame["loss_mask"].list.sum().sum())
    facts = TargetFacts.from_path(target)
    backend = TransformersBackend(target, LAYER_IDS)
    try:
        report = extract_shard(read_traces(traces_path, facts.vocab_size), work / "states", ExtractionSettings(str(target), "bench", LAYER_IDS), backend)
    finally:
        backend.close()
    return {
        "samples": samples,
        "tokens": tokens,
        "prompt_tokens": (tokens - generated) / samples,
        "generated_tokens": generated / samples,
        "demo_cap": MAX_TOKENS,
        "hidden_size": facts.hidden_size,
        "bytes_on_disk": report.bytes_on_disk,
        "measured_per_token": report.bytes_on_disk / report.tokens,
        "planned_per_token": bytes_per_token(facts.hidden_size, "bfloat16"),
    }


def kimi_draft() -> tuple[int, float]:
    from eagle3_assets.core.training.memory import StepShape
    from eagle3_assets.core.training.throughput import PRESETS, draft_config_of, step_flops

    preset = PRESETS["kimi-k2"]
    shape = StepShape.of(draft_config_of(preset), tokens=1, seq_len=1, ttt_steps=7, bf16=True)
    return shape.trainable_parameters, step_flops(preset, 7)


def story_plan(prompts: int, sample_tokens: float, volume_bytes: int, training: Rate, extraction: Rate, generation: Rate, parameters: int, gpus: int):
    shards = [ShardFacts(f"shard-{i:05d}", min(STORY_SHARD, prompts - i * STORY_SHARD)) for i in range(-(-prompts // STORY_SHARD))]
    settings = PlanSettings(
        hidden_size=STORY_HIDDEN, sample_tokens=sample_tokens, completion_tokens=None, draft_parameters=parameters, training_gpus=gpus, generation_gpus=gpus
    )
    return plan_capacity(
        shards,
        settings,
        Volume("GPU host", "/data (the story's 3 TB volume)", volume_bytes, device="story"),
        Volume("data volume", "/data", volume_bytes, device="story"),
        {"generation": generation, "extraction": extraction, "training": training},
    )


def scale_plans(prompts: int, nodes: list[int], per_run: list[int], load_s: float, trace_tokens: float, parameters: int) -> None:
    """The run at ``prompts`` on each count of nodes (8 GPUs each): hours, GPU-hours and the volume each way of storing the states needs."""
    shards = [ShardFacts(f"shard-{i:05d}", min(STORY_SHARD, prompts - i * STORY_SHARD)) for i in range(-(-prompts // STORY_SHARD))]
    measured = Rate(H200_KIMI_DEPTH7_TOKENS_PER_S, "measured on one H200 (training-at-scale issue)")
    volume = Volume("shared volume", "/data", None, device="story")

    def plan(n: int, extraction: float, runs_of: int):
        settings = PlanSettings(
            hidden_size=STORY_HIDDEN, sample_tokens=trace_tokens, draft_parameters=parameters, generation_gpus=8 * n, extraction_gpus=8,
            training_gpus=8, nodes=n, target_load_s=load_s, shards_per_run=runs_of, accept_unknown_capacity=True,
        )  # fmt: skip
        # One vLLM server per node, each at the story's rate: assumed to add up (requests go to the least busy).
        rates = {"generation": Rate(STORY_SERVER_TOKENS_PER_S * n, "derived"), "extraction": Rate(extraction, "assumed"), "training": measured}
        return plan_capacity(shards, settings, volume, volume, rates)

    first = plan(1, KIMI_EXTRACTION_PER_GPU_DERIVED, per_run[0])
    print(f"## {prompts:,} prompts of {trace_tokens:,.0f} tokens (assumed) on N nodes of 8 GPUs: arithmetic (core/planning/capacity.py)\n")
    print(f"{len(shards)} shards of {STORY_SHARD}, {first.tokens / 1e6:,.0f} M tokens, {first.epochs} epochs (the schedule's fit). Disk (formula, 8·H + 9 B per token): "
          f"bf16 states {first.states_bytes / 1e12:.2f} TB ({human(first.states_bytes)}), 8-bit {first.states_to_write_8bit / 1e12:.2f} TB, bounded-disk "
          f"window (2 shards) {first.bounded_window_bytes / 1e9:.1f} GB, checkpoints {first.checkpoint_bytes / 1e9:.1f} GB, responses "
          f"{first.responses_bytes_to_write / 1e9:.1f} GB (16 B/token, a first guess)\n")  # fmt: skip
    print("| nodes | shards per run | generation h (GPU-h) | extraction h (GPU-h), 4,200 / 20,000 tokens/s per GPU | training h (GPU-h) | stages in turn, h |")
    print("| --- | --- | --- | --- | --- | --- |")
    for runs_of in per_run:
        for n in nodes:
            slow, fast = plan(n, KIMI_EXTRACTION_PER_GPU_DERIVED, runs_of), plan(n, 20_000.0, runs_of)
            h, g = slow.hours, slow.gpu_hours
            print(f"| {n} | {runs_of} | {h['generation']:,.1f} ({g['generation']:,.0f}) | {h['extraction']:,.1f} ({g['extraction']:,.0f}) / "
                  f"{fast.hours['extraction']:,.1f} ({fast.gpu_hours['extraction']:,.0f}) | {h['training']:,.1f} ({g['training']:,.0f}) | "
                  f"{slow.remaining_hours:,.1f} / {fast.remaining_hours:,.1f} |")  # fmt: skip
    print()
    per_prompt = trace_tokens * bytes_per_token(STORY_HIDDEN, "bfloat16"), trace_tokens * bytes_per_token(STORY_HIDDEN, "float8_e4m3fn")
    print("| shared volume free | most prompts whose bf16 states fit | in 8-bit |")
    print("| --- | --- | --- |")
    for tb in (3, 10, 25, 50):
        room = tb * 1e12 - first.checkpoint_bytes
        print(f"| {tb} TB | {room / per_prompt[0]:,.0f} | {room / per_prompt[1]:,.0f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=128, help="demo traces extracted to measure the bytes per token")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--volume-tb", type=float, default=3.0, help="the story's volume, in TB (10^12 bytes)")
    parser.add_argument("--gpus", type=int, default=8, help="the story's GPU host")
    parser.add_argument("--extraction-tokens-per-s", type=float, default=20_000.0, help="bf16 extraction rate on the story's host (an assumption)")
    parser.add_argument("--story-trace-tokens", type=float, default=4000.0, help="the story's own mean trace (its 2.3 TB of bf16 states for 10,000 traces)")
    parser.add_argument("--generation-tokens-per-s", type=float, default=None, help="the story's server's output tokens/s (an assumption; unset: unknown)")
    parser.add_argument("--scale-only", action="store_true", help="only the run at --scale-prompts on --nodes (arithmetic, no measurement)")
    parser.add_argument("--scale-prompts", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8], help="nodes of 8 GPUs each")
    parser.add_argument("--shards-per-run", type=int, nargs="+", default=[20, 200], help="$EAGLE3_EXTRACTION_SHARDS_PER_RUN (20: the default)")
    parser.add_argument("--target-load-s", type=float, default=600.0, help="one engine's target load (assumed: 10 minutes, not measured)")
    args = parser.parse_args()
    if args.scale_only:
        scale_plans(args.scale_prompts, args.nodes, args.shards_per_run, args.target_load_s, args.story_trace_tokens, kimi_draft()[0])
        return

    m = measure(args.samples, args.threads)
    ratio = m["planned_per_token"] / m["measured_per_token"]
    print(f"bytes per token, H = {m['hidden_size']}, bf16: measured on disk {m['measured_per_token']:.1f} ({m['bytes_on_disk']} B / {m['tokens']} tokens), "
          f"planned {m['planned_per_token']} (8·H + 9): planned / measured = {ratio:.4f}")  # fmt: skip
    print(f"same layout at H = {STORY_HIDDEN}, by formula (8·H + 9; not measured): {bytes_per_token(STORY_HIDDEN, 'bfloat16')} B per token "
          f"({bytes_per_token(STORY_HIDDEN, 'bfloat16') / (8 * STORY_HIDDEN):.5f} of 8·H)")  # fmt: skip
    scaled_generated = m["generated_tokens"] * STORY_CAP / m["demo_cap"]
    sample_tokens = m["prompt_tokens"] + scaled_generated
    print(f"demo traces ({m['samples']}): {m['prompt_tokens']:.1f} prompt + {m['generated_tokens']:.1f} generated tokens "
          f"(cap {m['demo_cap']}); generated scaled to the {STORY_CAP} cap: {scaled_generated:,.0f}; a story trace: {sample_tokens:,.0f} tokens")  # fmt: skip

    parameters, flops = kimi_draft()
    measured = Rate(H200_KIMI_DEPTH7_TOKENS_PER_S, "measured on one H200, Kimi width, depth 7 (training-at-scale issue; not in this run)")
    estimated = estimated_training_rate(flops, 790.0, 0.34)
    extraction = Rate(args.extraction_tokens_per_s, "assumed (command line)")
    generation = Rate(args.generation_tokens_per_s, "assumed (command line)") if args.generation_tokens_per_s else Rate(None, "not given")
    volume = int(args.volume_tb * 1e12)
    print(f"draft at Kimi width: {parameters / 1e9:.2f} B trainable parameters, {flops / 1e9:.1f} GFLOP per token at depth 7 (counted); training rate "
          f"{measured.tokens_per_s:,.0f} tokens/s measured on one H200 (training-at-scale issue, not in this run), {estimated.tokens_per_s:,.0f} derived "
          f"({estimated.source}; the 0.34 share was taken from that same H200 run, so the two agree by construction: no independent check)\n")  # fmt: skip

    plan = story_plan(STORY_PROMPTS, sample_tokens, volume, measured, extraction, generation, parameters, args.gpus)
    print(f"## The story's run: {STORY_PROMPTS:,} prompts, H = {STORY_HIDDEN}, bf16, {args.volume_tb:g} TB, {args.gpus} GPUs "
          "(arithmetic: assumed prompts and trace length x the formula's bytes per token; rates as their sources say)\n")  # fmt: skip
    print(plan.markdown())
    print()
    story_tokens = args.story_trace_tokens
    for label, per_trace in ((f"the demo's traces scaled to the cap ({sample_tokens:,.0f} tokens)", sample_tokens),
                             (f"the story's own traces ({story_tokens:,.0f} tokens assumed, 40 M tokens for 10,000)", story_tokens)):  # fmt: skip
        print(f"## The ramp and the aborted run at {label} (arithmetic from assumptions)\n")
        print(f"| prompts | tokens | hidden states bf16 | 8-bit | bounded window (2 shards) | fits {args.volume_tb:g} TB | training GPU-hours (measured / estimated rate) | hidden_states |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for prompts in (1_000, STORY_PROMPTS, 25_000):
            p = story_plan(prompts, per_trace, volume, measured, extraction, generation, parameters, args.gpus)
            e = story_plan(prompts, per_trace, volume, estimated, extraction, generation, parameters, args.gpus)
            verdict = "refuses before its first shard" if p.states_refusal() else "runs"
            print(f"| {prompts:,} | {p.tokens / 1e6:,.1f} M | {human(p.states_bytes)} ({p.states_bytes / 1e12:.2f} TB) | {human(p.states_to_write_8bit)} | "
                  f"{human(p.bounded_window_bytes)} | {'yes' if p.fits else 'no'} | {p.gpu_hours['training']:,.0f} / {e.gpu_hours['training']:,.0f} | {verdict} |")  # fmt: skip
        print()
    refused = story_plan(25_000, story_tokens, volume, measured, extraction, generation, parameters, args.gpus).states_refusal()
    print(f"hidden_states at 25,000 prompts of the story's traces:\n{refused}")


if __name__ == "__main__":
    main()
