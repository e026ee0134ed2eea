"""The training memory estimate against the measured peak at the user's lengths: 2,048, 4,096 and 8,192 tokens.

For each micro-batch of one sample of ``--tokens`` tokens (attention over all
of them: the scores of the last unrolled step are tokens² x heads), the
default loss and an LK loss, the memory settings on and off, it measures one
optimizer step's peak on the CPU as tests/test_training_memory.py does (the
profiler's allocator events plus the tensors alive before the step, each case
in a fresh interpreter, float32, one thread) and prints it beside
``core/training/memory.py``'s estimate of that micro-batch (``peak_of`` its
``estimate_terms``), their ratio, and the attention terms' share of the
estimate; and the planner's figure for the same tokens (``estimate_step_bytes``:
the larger of samples of that length and of one attention block, whose
probabilities are kept). Past 1,024 tokens the attention is blocked
(core/draft/model.py). The draft is narrow (hidden 128, 8 query heads of 16
over 1 key/value head, depth 3, draft vocabulary 1,200) so that an
8,192-token step runs in under two minutes and the attention terms are about
half of the peak or more (``--shares`` prints each term's share at Kimi width).

    .venv/bin/python bench/training_memory.py                       # the grid in docs/performance.md
    .venv/bin/python bench/training_memory.py --tokens 2048 --losses kl
    .venv/bin/python bench/training_memory.py --shares              # the terms' shares at Kimi width only
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.test_training_memory import LONG_DRAFT, kimi_term_shares, long_case_shape, measure_in_this_process  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--losses", nargs="+", default=["kl", "nla"])
    parser.add_argument("--settings", nargs="+", choices=["on", "off"], default=["off", "on"])
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--shares", action="store_true", help="print the terms' shares at Kimi width and stop")
    args = parser.parse_args()

    print("Each term's share of the estimate at Kimi width (hidden 7,168, 64 heads, depth 7, 8,192 tokens of 4,096-token "
          "samples, bf16; computed by core/training/memory.py, not measured):")  # fmt: skip
    shares = kimi_term_shares()
    columns = list(shares)
    print(f"  {'term':<26}" + "".join(f"{c:>22}" for c in columns))
    for term in next(iter(shares.values())):
        print(f"  {term:<26}" + "".join(f"{shares[c][term] * 100:21.1f}%" for c in columns))
    if args.shares:
        return

    from eagle3_assets.core.training.memory import estimate_step_bytes, estimate_terms, peak_of

    print(f"\nMeasured (CPU, float32, 1 thread, each case in a fresh interpreter), draft {LONG_DRAFT}, ttt_steps {args.ttt}:")
    print(f"  {'tokens':>6} {'settings':>8} {'loss':>9} {'estimate MB':>12} {'peak MB':>9} {'estimate/peak':>13} {'attention share':>15} {'planner MB':>10} {'s':>5}")
    for tokens in args.tokens:
        for on in args.settings:
            for loss in args.losses:
                settings, shape = long_case_shape(tokens, on == "on", loss, args.ttt)
                started = time.monotonic()
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    measured = pool.submit(measure_in_this_process, 1, tokens, settings, "llama", LONG_DRAFT, args.ttt).result()
                elapsed = time.monotonic() - started
                terms = estimate_terms(shape)
                estimate = peak_of(terms)["total"]
                planner = estimate_step_bytes(shape)["total"]
                attention = (terms["attention_probabilities"] + terms["attention_transient"]) / estimate
                print(f"  {tokens:>6} {on:>8} {loss:>9} {estimate / 1e6:12.1f} {measured / 1e6:9.1f} {estimate / measured:13.3f} {attention:15.2f} {planner / 1e6:10.1f} {elapsed:5.0f}", flush=True)


if __name__ == "__main__":
    main()
