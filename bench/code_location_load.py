"""What loading the code location costs: ``eagle3_assets.definitions`` against the same load with torch imported.

Every process that loads the code location (``dagster dev``'s code server, the
daemon, each run's worker: one per shard run of a backfill) imports
``eagle3_assets.definitions``. None of them computes with torch; the stages
that do run in processes of their own on the GPU host. The definitions
therefore import neither torch, transformers, vLLM nor safetensors
(``tests/test_import_graph.py`` keeps it so). This prints, over interleaved
rounds in fresh interpreters, the wall time and peak RSS of the load as it is,
and of the same load after ``import torch`` (what each process paid while two
constants' imports pulled torch in), and their ratios.

    .venv/bin/python bench/code_location_load.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, resource, sys, time
started = time.perf_counter()
{preload}
import eagle3_assets.definitions
print(json.dumps({{"s": time.perf_counter() - started, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "torch": "torch" in sys.modules}}))
"""
LOADS = {"as it is": "", "with torch": "import torch"}


def load_once(preload: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(preload=preload)], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    load_once("")  # the first load compiles the bytecode: not a round
    runs: dict[str, list[dict]] = {name: [] for name in LOADS}
    for _ in range(args.rounds):  # interleaved, so that load on a shared machine falls on both alike
        for name, preload in LOADS.items():
            runs[name].append(load_once(preload))
    if any(run["torch"] for run in runs["as it is"]):
        sys.exit("loading eagle3_assets.definitions imported torch: the figures below would compare torch with itself")
    median = {name: {key: statistics.median(run[key] for run in rounds) for key in ("s", "rss_mib")} for name, rounds in runs.items()}
    print(f"loading eagle3_assets.definitions in a fresh interpreter, median of {args.rounds} interleaved rounds:")
    print("| load | wall s | peak RSS MiB |")
    print("| --- | --- | --- |")
    for name, figures in median.items():
        print(f"| {name} | {figures['s']:.2f} | {figures['rss_mib']:.0f} |")
    now, before = median["as it is"], median["with torch"]
    print(f"as it is / with torch: wall {now['s'] / before['s']:.2f}, peak RSS {now['rss_mib'] / before['rss_mib']:.2f}")


if __name__ == "__main__":
    main()
