"""Chain attention in blocks of query rows (core/draft/model.py) against the one-matrix reference, at the user's lengths.

The draft's training-time-test attention attends a sample longer than
``ATTENTION_BLOCK`` (1,024) tokens a block of query rows at a time, each block
recomputed in backward, so that no [T, T] tensor of a sample is built or kept.
Here it is held, output and gradients, to :func:`reference_chain_attention`,
which builds the whole [T, T + k] score matrix of a row at once as the draft did
before, over several blocks and a remainder, padded rows and packed rows whose
samples cross the blocks' boundaries; and its memory is held to one block's.
CPU, float32, a narrow head (the blocks' arithmetic does not depend on it).
"""

from __future__ import annotations

import pytest
import torch

from eagle3_assets.core.draft.model import ATTENTION_BLOCK, chain_attention
from eagle3_assets.core.training.memory import allocated_peak_during

# Float32, a different order of the same sums (a block's keys stop at its last row; the reference adds masked zeros):
# over ~3,000 keys both sit ~1e-6 of the largest value from the float64 result (seen: q's gradient 1.8e-5 off at 16
# for both), so the tolerance is relative to the largest value.
RTOL, ATOL_OF_LARGEST = 1e-5, 2e-6
HEADS, HEAD_DIM = 1, 16


def reference_chain_attention(q, keys, values, scale, documents=None):
    """The reference: one [B, heads, T, T + k] matrix of the whole row, masked causally within each sample (``documents``
    [1, T]: the same sample) plus each later step's key of the same chain, one softmax, as the draft computed it before
    its attention was blocked (and with the packed row's samples in one matrix, not one at a time)."""
    length = q.shape[2]
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    if documents is not None:
        allowed &= documents[0][:, None] == documents[0][None, :]
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
    scores += [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :length] @ values[0]
    for j, value in enumerate(values[1:]):
        out = out + probs[..., length + j : length + j + 1] * value
    return out


def inputs(rows: int, length: int, steps: int, seed: int = 0):
    """q and each step's keys and values, leaves that take gradients. Step 0's key of a position leans towards its
    query (half of it plus noise), so that each query's own key and its neighbours weigh, as in a trained draft: a
    mask one key off then changes the output by far more than the float32 noise."""
    generator = torch.Generator().manual_seed(seed)

    def randn():
        return torch.randn(rows, HEADS, length, HEAD_DIM, generator=generator) * 2

    q = randn()
    keys = [0.5 * q + randn(), *(randn() for _ in range(steps - 1))]
    return q.requires_grad_(), [k.requires_grad_() for k in keys], [randn().requires_grad_() for _ in range(steps)]


def output_and_gradients(attention, q, keys, values, documents=None):
    for t in (q, *keys, *values):
        t.grad = None
    out = attention(q, keys, values, HEAD_DIM**-0.5, documents)
    # A weight per output element, so that every row's and every head's gradient differs.
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weight).sum().backward()
    # A key no query may see (a window narrower than the chain) takes no gradient: zeros, as the reference's.
    return out.detach(), [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in (q, *keys, *values)]


# 3 blocks and a remainder of 401 rows. Packed: samples of 1,500 (crosses 1,024), 1,900 (starts at 1,500, crosses
# 2,048 and 3,072, and is itself blocked from its own first token), 72 (under a block: the one-matrix path), one token.
LENGTH = 3 * ATTENTION_BLOCK + 401
SAMPLES = [1500, 1900, 72, 1]


@pytest.mark.parametrize("packed", [False, True], ids=["padded rows", "packed row"])
def test_blocked_chain_attention_equals_the_one_matrix_reference_over_several_blocks(packed):
    """Output and the gradients of q and of every step's keys and values, at depth 3 (two chain keys a query).

    Mutations, each run by hand, each failing on the output (the largest difference against 1.4e-5 allowed): the
    block's causal offset one off in ``attention_rows`` (``tril(diagonal=first_row + 1)``: 4.5; ``first_row - 1``:
    8.6); a block's step-0 keys and values stopping one short (``keys[0][:, :, : end - 1]``, likewise the values:
    0.0046, at the last row); every block taking the first block's chain keys (``k[:, :, : end - start]``): 1.8.
    """
    torch.set_num_threads(1)
    assert LENGTH > 3 * ATTENTION_BLOCK and sum(SAMPLES) == LENGTH
    rows = 1 if packed else 2
    q, keys, values = inputs(rows, LENGTH, steps=3)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(SAMPLES)])[None] if packed else None
    out, grads = output_and_gradients(chain_attention, q, keys, values, documents)
    ref_out, ref_grads = output_and_gradients(reference_chain_attention, q, keys, values, documents)
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL_OF_LARGEST * float(ref_out.abs().max()))
    for name, grad, ref in zip(["q", "key 0", "key 1", "key 2", "value 0", "value 1", "value 2"], grads, ref_grads):
        assert ref.abs().max() > 0, f"{name}: no gradient, the comparison would be empty"
        atol = ATOL_OF_LARGEST * float(ref.abs().max())
        torch.testing.assert_close(grad, ref, rtol=RTOL, atol=atol, msg=f"{name}'s gradient differs from the reference")


def test_a_sample_of_one_block_or_less_takes_the_one_matrix_path_bit_for_bit():
    """At ATTENTION_BLOCK tokens and below, the output and gradients are the reference's to the bit (the same ops).

    Mutation: the softmax in float64 (``.double()`` for ``.float()`` in ``attention_rows``): the 55-token case differs
    in its last bits, fails. (Blocking from 512 tokens passes here: on the CPU its 1,024-token case came out the
    same to the bit, so the blocks' own arithmetic is not what this test can tell apart.)
    """
    torch.set_num_threads(1)
    for length in (55, ATTENTION_BLOCK):
        q, keys, values = inputs(2, length, steps=2, seed=length)
        out, grads = output_and_gradients(chain_attention, q, keys, values)
        ref_out, ref_grads = output_and_gradients(reference_chain_attention, q, keys, values)
        assert torch.equal(out, ref_out), length
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads)), length


def test_the_blocked_attentions_memory_is_one_blocks_not_the_samples_square():
    """Forward and backward of one 8,192-token sample, one head: the most allocated at once stays under 5 blocks of
    float32 scores ([1,024, 8,192] each, 33.6 MB; the step needs about three at once, and a [T, d] tensor or two),
    where one [T, T] matrix is 268 MB.

    Measured here: 110 MB. Mutations, each run by hand: blocks computed without their recomputation
    (``attention_rows`` called directly under autograd, keeping every block's probabilities): 265 MB, fails; no
    blocking at all (``if True:`` for the one-matrix path in chain_attention): 940 MB, fails.
    """
    torch.set_num_threads(1)
    length = 8 * ATTENTION_BLOCK
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, length, 8, generator=generator).requires_grad_() for _ in range(3))

    def step():
        chain_attention(q, [k, k * 1.0], [v, v * 1.0], 8**-0.5).sum().backward()

    peak = allocated_peak_during(step)
    block_scores = ATTENTION_BLOCK * length * 4
    print(f"peak {peak / 1e6:.1f} MB, one block's scores {block_scores / 1e6:.1f} MB, [T, T] {length * length * 4 / 1e6:.1f} MB")
    assert peak < 5 * block_scores, f"{peak} B allocated at once: more than 5 blocks of scores ({block_scores} B each)"
    assert q.grad.abs().max() > 0


def windowed_reference(q, keys, values, scale, window, documents=None):
    """The one-matrix reference with a sliding ``window`` as vLLM's Llama draft applies it: the query of row t at step
    s stands at position t + s and sees the step-0 keys of positions t + s - window + 1 .. t and the chain's own keys
    (positions t + 1 .. t + s) within ``window`` of it. Written from the positions, apart from ``attention_rows``."""
    length, step = q.shape[2], len(keys) - 1
    t = torch.arange(length)[:, None]
    c = torch.arange(length)[None, :]
    allowed = (c <= t) & (c >= t + step - window + 1)
    if documents is not None:
        allowed &= documents[0][:, None] == documents[0][None, :]
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
    for j, key in enumerate(keys[1:], start=1):
        own = (q * key).sum(-1, keepdim=True) * scale
        scores.append(own if step - j <= window - 1 else torch.full_like(own, float("-inf")))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :length] @ values[0]
    for j, value in enumerate(values[1:]):
        out = out + probs[..., length + j : length + j + 1] * value
    return out


@pytest.mark.parametrize(("window", "steps", "packed"), [(40, 3, False), (40, 3, True), (2, 4, False), (1, 2, False)])
def test_a_sliding_window_sees_the_last_positions_of_each_steps_query_in_blocks(monkeypatch, window, steps, packed):
    """``draft_sliding_window``: output and gradients against the windowed reference, over blocks (64 rows here, so
    that a 300-token row crosses several and each block reads only the keys its window reaches), at each step's
    position, with windows wider and narrower than the chain (w = 2 at depth 4: the chain's own first keys fall out).

    Mutations, each run by hand: the window counted from the row, not from the step's position (``row + step -
    window`` -> ``row - window`` in ``attention_rows``): fails at every window here; a block's keys sliced from one
    position later (``start + step - window + 2``): fails at w = 40; the chain's own keys never masked: fails
    at w = 2."""
    torch.set_num_threads(1)
    monkeypatch.setattr("eagle3_assets.core.draft.model.ATTENTION_BLOCK", 64)
    length = 300
    q, keys, values = inputs(1 if packed else 2, length, steps=steps, seed=window)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate([130, 150, 20])])[None] if packed else None

    def windowed(q, keys, values, scale, documents=None):
        return chain_attention(q, keys, values, scale, documents, window=window)

    def reference(q, keys, values, scale, documents=None):
        if documents is None:
            return windowed_reference(q, keys, values, scale, window)
        sizes = torch.unique_consecutive(documents[0], return_counts=True)[1].tolist()
        parts = zip(q.split(sizes, 2), zip(*(k.split(sizes, 2) for k in keys)), zip(*(v.split(sizes, 2) for v in values)))
        return torch.cat([windowed_reference(qs, list(ks), list(vs), scale, window) for qs, ks, vs in parts], dim=2)

    out, grads = output_and_gradients(windowed, q, keys, values, documents)
    ref_out, ref_grads = output_and_gradients(reference, q, keys, values, documents)
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL_OF_LARGEST * float(ref_out.abs().max()))
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=RTOL, atol=ATOL_OF_LARGEST * float(ref.abs().max()))
    # The window is not the full attention: the same inputs without it give another output.
    full, _ = output_and_gradients(chain_attention, q, keys, values, documents)
    assert not torch.allclose(full, out, atol=1e-3)
