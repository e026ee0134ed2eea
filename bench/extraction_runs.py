"""P11: target loads of a backfill of ``hidden_states``, counted from the stage's own record of engine builds.

A backfill of ``hidden_states`` under ``BackfillPolicy.multi_run(N)`` runs
consecutive ranges of at most N shards; each run here is what the backfill
daemon launches (``materialize`` of the asset with the run's partition-range
tags, the real stage on the local GPU host, the tiny target). Two backfills of
the same shards, in fresh data directories:

- ``per shard``: N = 1, one run and one stage per shard (the behaviour before
  #25: every shard loaded the target);
- ``per run``: N = ``--shards-per-run`` (default: ``EAGLE3_EXTRACTION_SHARDS_PER_RUN``).

Engine builds are read from ``<data>/hidden_states/engine_builds.jsonl``, which
the stage appends to each time it builds an engine. Prints builds per backfill,
builds per run, and the wall time of the second over the first (on this CPU
the tiny target loads in about a second, so the time saved here is the stage
start and the load; on a 1T target the load alone is hours per build).

    .venv/bin/python bench/extraction_runs.py [--shards 20] [--per-shard 4] [--backend transformers]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))


def backfill(keys: list[str], shards_per_run: int, target: Path, backend: str) -> tuple[int, int, float]:
    """Runs the backfill's runs one after another (the GPU pool's limit is 1); (runs, engine builds, wall seconds)."""
    from dagster import DagsterInstance, RunConfig, materialize

    from eagle3_assets.core.extraction.shard_record import engine_builds
    from eagle3_assets.core.storage.shard_paths import data_dir
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
    from eagle3_assets.glue.partitions import register_shards
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    instance = DagsterInstance.ephemeral()
    register_shards(instance, keys)
    config = HiddenStatesConfig(backend=backend, dtype="float32" if backend == "transformers" else "bfloat16", cpu_threads=1)
    ranges = [keys[i : i + shards_per_run] for i in range(0, len(keys), shards_per_run)]
    started = time.monotonic()
    for chunk in ranges:
        result = materialize(
            [hidden_states], instance=instance, raise_on_error=False,
            tags={"dagster/asset_partition_range_start": chunk[0], "dagster/asset_partition_range_end": chunk[-1]},
            resources={"target_model": TargetModel(path=str(target)), "gpu_host": GPUHost()},
            run_config=RunConfig(ops={"hidden_states": config}),
        )  # fmt: skip
        if not result.success:
            raise SystemExit(f"run over {chunk[0]} .. {chunk[-1]} failed")
    wall = time.monotonic() - started
    return len(ranges), len(engine_builds(data_dir() / "hidden_states")), wall


def main() -> None:
    from eagle3_assets.core.settings.environment import EXTRACTION_SHARDS_PER_RUN

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--per-shard", type=int, default=4, help="traces per shard")
    parser.add_argument("--shards-per-run", type=int, default=EXTRACTION_SHARDS_PER_RUN.get())
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    args = parser.parse_args()

    from eagle3_assets.demo.stack import tiny_target_dir
    from eagle3_assets.demo.validated_traces import write_validated_traces

    target = tiny_target_dir()
    keys = [f"shard-{i:05d}" for i in range(args.shards)]
    figures = {}
    for label, per_run in (("per shard", 1), ("per run", args.shards_per_run)):
        with tempfile.TemporaryDirectory(prefix="eagle3-bench-runs-") as work:
            os.environ["EAGLE3_DATA_DIR"] = work
            for seed, key in enumerate(keys):
                write_validated_traces(Path(work), key, target, count=args.per_shard, seed=seed + 1)
            runs, builds, wall = backfill(keys, per_run, target, args.backend)
            figures[label] = (runs, builds, wall)
            print(f"{label:>9}: {args.shards} shards in {runs} run(s), {builds} engine build(s), {wall:.1f} s")
    (_, before, wall_before), (runs, after, wall_after) = figures["per shard"], figures["per run"]
    print(f"P11 engine builds for a backfill of {args.shards} shards: {after} (per run: {after / runs:.2f}; before: {before}); goal 1 per run")
    print(f"wall time, one engine per run over one per shard: {wall_after / wall_before:.2f}")


if __name__ == "__main__":
    main()
