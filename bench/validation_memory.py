"""Peak memory of validating one shard, as a ratio to the shard's text.

validated_traces streams a shard in batches (see eagle3_assets/core/validation/shard_validation.py),
so its peak memory should stay a small multiple of one batch plus the per-row
bookkeeping, not several copies of the shard. This writes a synthetic shard of
long traces in the tiny target's format, validates it in a fresh child process
(so the parent's copy of the data does not count), and prints the child's peak
memory above its baseline (imports and tokenizer loaded) divided by the shard's
text size and by the size of the token ids it produced. It does so for a shard
and for one twice as large: the difference is what the shard's size costs,
apart from the fixed cost of one batch.

    .venv/bin/python bench/validation_memory.py --rows 500 --sentences 400

About 1 x the added text means one copy of the text (a parquet row group is
decoded whole) and no copy of the token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def write_shard(root: Path, rows: int, sentences: int) -> int:
    import polars as pl

    from eagle3_assets.core.prompts.loading import PROMPTS_SCHEMA
    from eagle3_assets.core.validation.trace_files import RAW_RESPONSES_SCHEMA

    prompts, raw, text_bytes = [], [], 0
    for i in range(rows):
        reasoning = "".join(f"I need to add {i % 97 + k} and {k * 7 % 89}. " for k in range(sentences)) + f"So the sum is {i}.\n"
        content = f"\n\nThe answer is {i}."
        text_bytes += len(reasoning.encode()) + len(content.encode())
        prompts.append({"row_index": i, "id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i}+{i}?"}]})
        raw.append(
            {"id": f"q{i}", "reasoning": reasoning, "content": content, "reasoning_field": "reasoning", "finish_reason": "stop",
             "prompt_tokens": 10, "completion_tokens": sentences * 10, "latency_s": 1.0, "server": "bench", "model": "tiny",
             "attempts": 1, "error": None}
        )
    pl.DataFrame(prompts, schema=PROMPTS_SCHEMA).write_parquet(root / "prompts.parquet")
    pl.DataFrame(raw, schema=RAW_RESPONSES_SCHEMA).write_parquet(root / "raw.parquet")
    return text_bytes


def child(root: Path, target: Path, batch_rows: int) -> None:
    from transformers import AutoTokenizer

    from eagle3_assets.core.validation.chat_rendering import ChatRenderer
    from eagle3_assets.core.validation.mask_alignment import mask_alignment_problems
    from eagle3_assets.core.validation.trace_files import written_token_lengths
    from eagle3_assets.core.validation.shard_validation import ValidationRules, validate_shard

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(target))
    renderer.render([{"role": "user", "content": "warm up"}], "r", "c")
    baseline = rss_kib("VmRSS")
    started = time.monotonic()
    summary = validate_shard(
        root / "raw.parquet", root / "prompts.parquet", renderer, ValidationRules(max_seq_len=1 << 20),
        root / "kept.parquet", root / "rejected.parquet", batch_rows=batch_rows,
    )
    alignment = mask_alignment_problems(root / "kept.parquet", root / "raw.parquet", renderer, batch_rows=batch_rows)
    checked, problems = alignment.rows_checked, alignment.problems
    tokens = sum(written_token_lengths(root / "kept.parquet"))
    print(json.dumps({
        "peak_above_baseline_kib": rss_kib("VmHWM") - baseline, "kept": summary.kept, "checked": checked,
        "misaligned": len(problems), "tokens": tokens, "seconds": time.monotonic() - started,
    }))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--sentences", type=int, default=400, help="reasoning sentences per trace (~10 tokens each)")
    parser.add_argument("--batch-rows", type=int, default=128)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.target, args.batch_rows)
        return 0

    from eagle3_assets.demo.stack import tiny_target_dir

    os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))
    target = tiny_target_dir()
    runs = []
    for rows in (args.rows, 2 * args.rows):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            text_bytes = write_shard(root, rows, args.sentences)
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(root), "--target", str(target), "--batch-rows", str(args.batch_rows)],
                check=True, capture_output=True, text=True,
            )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result.update(rows=rows, text_bytes=text_bytes, id_bytes=result["tokens"] * 5, peak=result["peak_above_baseline_kib"] * 1024)
        runs.append(result)
        print(
            f"{rows} rows x {result['tokens'] / rows:.0f} tokens: text {text_bytes / 2**20:.1f} MiB, ids+mask {result['id_bytes'] / 2**20:.1f} MiB, "
            f"peak above baseline {result['peak'] / 2**20:.1f} MiB, {result['misaligned']} misaligned, {result['seconds']:.0f}s"
        )
    small, large = runs
    extra_peak = large["peak"] - small["peak"]
    print(
        f"doubling the shard adds {extra_peak / 2**20:.1f} MiB of peak memory = "
        f"{extra_peak / (large['text_bytes'] - small['text_bytes']):.2f} x the added text, "
        f"{extra_peak / (large['id_bytes'] - small['id_bytes']):.2f} x the added ids+mask"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
