"""Chain attention in blocks (core/draft/model.py) against the one-matrix reference, at 2,048 / 4,096 / 8,192 tokens.

For one sample of each length, the draft's training-time-test attention of
step 2 (step 0's keys causally plus two chain keys a query), forward and
backward, float32 on the CPU, one thread: the most bytes allocated at once
(``allocated_peak_during``, the profiler's allocator events, as the memory
estimate's tests measure) and the seconds per token, of ``chain_attention``
(blocks of ``ATTENTION_BLOCK`` query rows, each recomputed in backward) and of
``reference_chain_attention`` (tests/test_chain_attention.py: the whole
[T, T + 2] matrix at once, as the draft computed it before), in the same run,
alternating, the best of ``--repeats``; and their ratios. The width is what
this CPU affords for the reference at 8,192 tokens (2 heads of 64: each of its
[T, T] float32 tensors is 0.5 GB); both memories scale with the heads.

    nice -n 10 .venv/bin/python bench/chain_attention.py                 # the table in docs/performance.md
    .venv/bin/python bench/chain_attention.py --lengths 2048 --repeats 1
    nice -n 10 .venv/bin/python bench/chain_attention.py --window 256   # a sliding window against full attention

With ``--window W`` the two compared are ``chain_attention`` with the draft's
sliding window of W (``draft_sliding_window``: each block reads only the keys
its window reaches) and without it (full causal attention, in blocks).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from eagle3_assets.core.draft.model import ATTENTION_BLOCK, chain_attention  # noqa: E402
from eagle3_assets.core.training.memory import allocated_peak_during  # noqa: E402
from tests.test_chain_attention import reference_chain_attention  # noqa: E402


def one_pass(attention, length: int, heads: int, head_dim: int, steps: int) -> float:
    """Seconds of one forward and backward of ``attention`` over fresh leaves of one sample."""
    generator = torch.Generator().manual_seed(length)

    def leaf():
        return torch.randn(1, heads, length, head_dim, generator=generator).requires_grad_()

    q, keys, values = leaf(), [leaf() for _ in range(steps)], [leaf() for _ in range(steps)]
    started = time.perf_counter()
    attention(q, keys, values, head_dim**-0.5).sum().backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="unrolled steps: the attention of the last (steps - 1 chain keys)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--window", type=int, default=None, help="compare a sliding window of this many positions with full attention")
    args = parser.parse_args()
    torch.set_num_threads(1)
    one_pass(chain_attention, 2 * ATTENTION_BLOCK, 1, 8, 2)  # the first checkpoint imports torch._dynamo: not timed
    if args.window:
        impls = {f"window {args.window}": functools.partial(chain_attention, window=args.window), "full": chain_attention}
    else:
        impls = {"blocked": chain_attention, "reference": reference_chain_attention}
    first, second = impls
    print(f"Measured (CPU, float32, 1 thread, forward + backward of one sample), {args.heads} heads of {args.head_dim}, "
          f"step {args.steps - 1}, ATTENTION_BLOCK {ATTENTION_BLOCK}, best of {args.repeats}:")  # fmt: skip
    print(f"  {'tokens':>6} {first + ' MB':>14} {second + ' MB':>12} {'memory ratio':>12} {first + ' us/token':>20} "
          f"{second + ' us/token':>18} {'time ratio':>10}")  # fmt: skip
    for length in args.lengths:
        peak = {name: allocated_peak_during(lambda f=f: one_pass(f, length, args.heads, args.head_dim, args.steps)) for name, f in impls.items()}
        seconds = {name: [] for name in impls}
        for repeat in range(args.repeats):
            for name in impls if repeat % 2 == 0 else reversed(impls):  # alternating, so that the load falls on both
                seconds[name].append(one_pass(impls[name], length, args.heads, args.head_dim, args.steps))
        per_token = {name: min(each) / length * 1e6 for name, each in seconds.items()}
        print(f"  {length:>6} {peak[first] / 1e6:14.1f} {peak[second] / 1e6:12.1f} {peak[first] / peak[second]:12.3f} "
              f"{per_token[first]:20.1f} {per_token[second]:18.1f} {per_token[first] / per_token[second]:10.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
