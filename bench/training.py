"""Benchmark of draft training: tokens/s, achieved TFLOP/s and its share of the device's matrix-product rate, peak memory, per depth.

The benchmark itself is eagle3_assets/core/training/throughput.py (also run by
``eagle3-gpu-check``); its docstring says what is counted and how.

    .venv/bin/python bench/training.py                                  # the demo's tiny draft on CPU
    .venv/bin/python bench/training.py --preset small --ttt 1 3 7       # docs/performance.md's CPU figures
    .venv/bin/python bench/training.py --norms plain eagle3.1 speculators --rounds 3   # what the norm flags cost per step
    python bench/training.py --device cuda --preset kimi-k2 --ttt 1 3 7 # a GPU host: Kimi width
    python bench/training.py --device cuda --target /models/Kimi-K2 --plan   # the target's width, the planned micro-batch
    python bench/training.py --device cuda --preset kimi-k2 --ttt 7 --lengths bench/long_trace_lengths.json   # packed vs padded
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.core.training.throughput import main  # noqa: E402

if __name__ == "__main__":
    main()
