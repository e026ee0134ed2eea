"""Cost of loading one prompt shard: the last shard of a large dataset against the first.

Loading a shard used to read the dataset from row 0, so the last shard of a
400k-row file cost the whole file and a backfill the square of it. Now a JSONL
shard is one seek through the line index and a Parquet shard one row slice, and
the duplicate check asks the id index: the last shard should cost about what the
first does. Goal: last / first within 1.5x, per format.

For each format this writes a 400k-row dataset (open-perfectblend rows) into a
temporary directory, then prints:
- the one-off costs on a fresh file: counting the rows (the line index, what the
  new-shards sensor pays once per file version) and the first load of the last
  shard (the id index: every row parsed once);
- the warm cost of the first and of the last shard over interleaved rounds, and
  their ratio, of CPU time (median of rounds; on a shared machine wall time also
  counts the time other processes held the CPU) and of wall time (best, median);
- for scale, a last-shard load the old way: every row before it parsed.

    .venv/bin/python bench/prompt_loading.py [--rows 400000] [--shard-size 128] [--rounds 21]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import polars as pl  # noqa: E402

from eagle3_assets.core.prompts.loading import count_rows, load_shard  # noqa: E402
from eagle3_assets.core.prompts.records import normalise_record  # noqa: E402
from eagle3_assets.core.prompts.sources import iter_dataset_rows  # noqa: E402
from eagle3_assets.core.prompts.sharding import shard_keys_for  # noqa: E402

PARQUET_ROW_GROUP = 10_000


def record(i: int) -> dict:
    return {
        "id": f"pb-{i}",
        "conversations": [
            {"from": "system", "value": "You are a careful assistant."},
            {"from": "human", "value": f"Question {i}: what is {i % 997} times {i % 89}? Explain each step of the calculation."},
            {"from": "gpt", "value": f"{(i % 997) * (i % 89)}"},
        ],
    }


def write_jsonl(path: Path, rows: int) -> None:
    with open(path, "w") as fh:
        for i in range(rows):
            fh.write(json.dumps(record(i)) + "\n")


def write_parquet(path: Path, rows: int) -> None:
    pl.DataFrame([record(i) for i in range(rows)]).write_parquet(path, row_group_size=PARQUET_ROW_GROUP)


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def old_way_last_shard(source: str, first_row: int, stop: int) -> int:
    """The former load_shard: parse and normalise every row up to the shard's end."""
    kept = 0
    for row in iter_dataset_rows(source, stop=stop):
        if row.parse_error is None:
            normalise_record(row.record)
            kept += row.row_index >= first_row
    return kept


def bench(fmt: str, source: Path, rows: int, shard_size: int, rounds: int) -> float:
    started = time.perf_counter()
    (write_jsonl if fmt == "jsonl" else write_parquet)(source, rows)
    note = f", row groups of {PARQUET_ROW_GROUP:,}" if fmt == "parquet" else ""
    print(f"{fmt}: {rows:,} rows, {source.stat().st_size / 1e6:.1f} MB{note} (written in {time.perf_counter() - started:.1f}s)", flush=True)

    count_s, counted = timed(lambda: count_rows(str(source)))
    assert counted == rows, (counted, rows)
    keys = shard_keys_for(rows, shard_size)
    first, last = keys[0], keys[-1]
    cold_s, cold = timed(lambda: load_shard(str(source), last, shard_size))
    print(f"  one-off: count rows {count_s * 1000:.0f} ms; cold {last} {cold_s:.2f}s (indexes: {cold.indexes})")

    wall: dict[str, list[float]] = {first: [], last: []}
    cpu: dict[str, list[float]] = {first: [], last: []}
    for r in range(rounds):  # interleaved, alternating order, so drift hits both alike
        for key in (first, last) if r % 2 == 0 else (last, first):
            cpu_started = time.process_time()
            elapsed, shard = timed(lambda: load_shard(str(source), key, shard_size))
            cpu[key].append(time.process_time() - cpu_started)
            assert shard.accepted.height == min(shard_size, rows - int(key[-5:]) * shard_size), key
            wall[key].append(elapsed)
    # The ratio is of CPU time (all threads of this process), median of rounds: on a
    # shared machine wall time also counts the time other processes held the CPU.
    cpu_ms = {key: statistics.median(values) * 1000 for key, values in cpu.items()}
    wall_ms = {key: (min(values) * 1000, statistics.median(values) * 1000) for key, values in wall.items()}
    ratio = cpu_ms[last] / cpu_ms[first]
    verdict = "meets" if ratio <= 1.5 else "MISSES"
    for key in (first, last):
        print(f"  warm {key}: CPU {cpu_ms[key]:.2f} ms; wall best {wall_ms[key][0]:.2f} ms, median {wall_ms[key][1]:.2f} ms ({rounds} rounds)")
    print(
        f"  {fmt} ratio last / first: CPU {ratio:.2f} ({verdict} the goal <= 1.5); "
        f"wall best {wall_ms[last][0] / wall_ms[first][0]:.2f}, wall median {wall_ms[last][1] / wall_ms[first][1]:.2f}"
    )
    last_s = wall_ms[last][0] / 1000

    start_row = (rows - 1) // shard_size * shard_size
    old_s, _ = timed(lambda: old_way_last_shard(str(source), start_row, rows))
    print(f"  for scale: {last} read the old way (every earlier row parsed): {old_s:.2f}s = {old_s / last_s:.0f}x the best warm load", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--formats", default="jsonl,parquet")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-prompts-") as tmp:
        os.environ["EAGLE3_DATA_DIR"] = str(Path(tmp) / "data")  # where an index goes if not beside the file
        ratios = {fmt: bench(fmt, Path(tmp) / f"prompts.{fmt}", args.rows, args.shard_size, args.rounds) for fmt in args.formats.split(",")}
    print("summary: " + ", ".join(f"{fmt} last/first {ratio:.2f}" for fmt, ratio in ratios.items()))


if __name__ == "__main__":
    main()
