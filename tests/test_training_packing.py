"""Packed micro-batches (``pack_samples``): the samples end to end in one row, trained exactly as when padded.

What packing changes is which samples share a micro-batch and the padding;
what each sample is trained towards must not change. So a packed row's loss,
step figures and gradients are held to those of the same samples right-padded
(float32, CPU): a sample that attended into its neighbour, or a chain that
predicted the next sample's first tokens, would each change them. A position
count that ran on across samples would not (rotary encoding is relative, so
attention within a sample is the same at any offset: that mutation passes the
figures), but it would feed the draft positions no vLLM request has (each counts
from 0); so the positions fed to the draft's attention are held to the padded
ones too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_assets.core.training.data import epoch_micro_batches, epoch_steps, index_hidden_states, load_batch
from eagle3_assets.core.training.launch import run_training
from eagle3_assets.core.training.loss import TrainingTimeTest, sample_starts
from eagle3_assets.core.training.memory import allocated_peak_during
from tests.demo_hidden_states import cached_demo_hidden_states
from tests.test_training import final_weights, small_config
from tests.test_training_memory import GRAD_ATOL, GRAD_RTOL, gradients, random_batch, small_draft, small_mla_draft

LENGTHS = (20, 13, 7)  # the samples of one micro-batch, padded to 20


@pytest.fixture(scope="module")
def hidden_states(tiny_target) -> list[Path]:
    return cached_demo_hidden_states(tiny_target, shards=2, count=24)  # tests/test_training.py's states (cached)


def recorded_positions(draft) -> list[torch.Tensor]:
    """The positions each step of the chain feeds the draft's attention (its rotary embedding), as they are fed."""
    seen, step_states = [], draft.step_states

    def recording(input_ids, hidden, positions, *args, **kwargs):
        seen.append(positions.detach().clone())
        return step_states(input_ids, hidden, positions, *args, **kwargs)

    draft.step_states = recording  # this instance only
    return seen


def packed_from_padded(batch, lengths):
    """The padded rows' samples end to end in one row, with each token's sample."""
    row = [torch.cat([t[i, :n] for i, n in enumerate(lengths)])[None] for t in batch]
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return (*row, documents)


@pytest.mark.parametrize(
    "form, settings",
    [
        ("llama", {}),
        ("llama", {"checkpoint_steps": True, "loss_chunk_tokens": 7}),  # the defaults' memory settings
        ("deepseek_mla", {}),
    ],
    ids=["llama", "llama, memory settings on", "MLA form"],
)
def test_a_packed_row_trains_exactly_as_its_samples_padded(form, settings):
    torch.set_num_threads(1)
    draft, head, mapping = small_mla_draft() if form == "deepseek_mla" else small_draft()
    padded = random_batch(draft.config, rows=len(LENGTHS), length=max(LENGTHS))
    aux, final, ids, mask = padded
    for i, n in enumerate(LENGTHS):  # what load_batch pads with: nothing supervised, token 0, zero states
        mask[i, n:], ids[i, n:], aux[i, n:], final[i, n:] = False, 0, 0.0, 0.0
    positions = recorded_positions(draft)
    loss_padded, stats_padded, grads_padded = gradients(draft, head, mapping, padded, ttt=3, **settings)
    padded_positions, positions[:] = positions[:3], []  # the 3 steps' forward (activation checkpointing runs them again)
    *row, documents = packed_from_padded(padded, LENGTHS)
    loss_packed, stats_packed, grads_packed = gradients(draft, head, mapping, tuple(row), ttt=3, documents=documents, **settings)
    packed_positions = positions[:3]

    assert stats_padded[2].sum() > 0 and float(loss_padded) > 0
    torch.testing.assert_close(stats_packed, stats_padded, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    for name, grad in grads_padded.items():
        assert grad.abs().max() > 0, f"{name}: no gradient, the comparison would be empty"
        torch.testing.assert_close(grads_packed[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{name} differs packed")
    # Each sample's positions restart at 0 in the packed row, as its own row counts them (step k: k, k + 1, ...).
    # Fails on the mutation of TrainingTimeTest.forward that drops ``positions = positions - sample_starts(documents)``.
    start = 0
    for i, n in enumerate(LENGTHS):
        for k, (packed, alone) in enumerate(zip(packed_positions, padded_positions)):
            assert torch.equal(packed[0, start : start + n], alone[i, :n]), f"sample {i}, step {k}: positions {packed[0, start : start + n].tolist()}"
            assert torch.equal(alone[i, :n], torch.arange(n) + k)
        start += n
    # Without the sample boundaries the same row is one long sample: other figures (the comparison can fail).
    loss_joined, _, _ = gradients(draft, head, mapping, tuple(row), ttt=3, **settings)
    assert not torch.isclose(loss_joined, loss_padded, rtol=1e-4)


def test_packed_micro_batches_hold_every_sample_once_within_the_budget_without_padding(hidden_states):
    index = index_hidden_states(hidden_states)
    lengths = [min(s.length, 60) for s in index.samples]
    budget = 150
    epochs = [epoch_micro_batches(lengths, budget, seed=3, epoch=e, packed=True) for e in (0, 1)]
    for micro in epochs:
        assert sorted(i for batch in micro for i in batch) == list(range(len(lengths)))
        tokens = [sum(lengths[i] for i in batch) for batch in micro]
        assert all(n <= budget or len(batch) == 1 for n, batch in zip(tokens, micro))
        # First fit: a sample opens a micro-batch only where none has room, so at most one is half empty or less.
        assert sum(n <= budget // 2 for n in tokens) <= 1, tokens
    assert epochs[0] != epochs[1], "each epoch packs another order"

    members = epochs[0][0]
    samples = [index.samples[i] for i in members]
    packed, padded = load_batch(samples, 60, packed=True), load_batch(samples, 60)
    assert packed.input_ids.shape == (1, packed.num_tokens) == (1, sum(lengths[i] for i in members))
    assert packed.num_tokens == padded.num_tokens and padded.input_ids.numel() >= packed.num_tokens
    # Each sample counts its positions from 0, as vLLM does for each request (the rotary angles of a late sample in a
    # long row would otherwise be those of no request; attention itself is the same, rotary encoding being relative).
    positions = torch.arange(packed.num_tokens) - sample_starts(packed.documents)[0]
    start = 0
    for row, i in enumerate(members):
        n = lengths[i]
        assert torch.equal(packed.documents[0, start : start + n], torch.full((n,), row))
        assert torch.equal(positions[start : start + n], torch.arange(n))
        for name in ("aux", "final", "input_ids", "loss_mask"):
            assert torch.equal(getattr(packed, name)[0, start : start + n], getattr(padded, name)[row, :n]), name
        start += n


def test_a_packed_step_needs_no_more_memory_than_its_samples_padded():
    """Attended a sample at a time, a packed row's scores are each sample's own: the memory plan's padded shapes hold.

    Four samples of equal length, so that padding wastes nothing: scores over the whole row would be four times
    the padded batch's (512 keys a query against 128), and the step's peak with them (seen: 2.4 times).
    """
    torch.set_num_threads(1)
    draft, head, mapping = small_draft(hidden=64, heads=8, kv_heads=2, head_dim=16, intermediate=128, vocab=400, draft_vocab=100)
    padded = random_batch(draft.config, rows=4, length=128)
    padded[3][-1, 64:] = True  # every position of every sample supervised alike
    *row, documents = packed_from_padded(padded, (128,) * 4)
    ttt = TrainingTimeTest(draft, 3, 0.8)

    def step(batch, documents=None):
        aux, final, ids, mask = batch
        logits, top = head.draft_logits(final, "post_norm", mapping.draft_to_target, chunk=final.shape[0] * final.shape[1])
        loss, _ = ttt(aux, ids, mask, logits, top, documents)
        loss.backward()
        draft.zero_grad(set_to_none=True)

    step(padded)  # allocations of the first call (kernels' workspaces) are not the step's
    peak_padded = allocated_peak_during(lambda: step(padded))
    peak_packed = allocated_peak_during(lambda: step(tuple(row), documents))
    print("peak bytes packed, padded:", peak_packed, peak_padded)
    assert peak_packed <= 1.05 * peak_padded, (peak_packed, peak_padded)


def test_packed_training_runs_through_the_loop_and_the_run_records_it(hidden_states, tiny_target, tmp_path):
    runs = {packed: small_config(hidden_states, tiny_target, tmp_path / str(packed), epochs=1, pack_samples=packed) for packed in (False, True)}
    results = {packed: run_training(config) for packed, config in runs.items()}
    states = {packed: json.loads((Path(r["checkpoint"]) / "state.json").read_text()) for packed, r in results.items()}
    assert states[True]["config"]["pack_samples"] is True and states[False]["config"]["pack_samples"] is False
    assert results[True]["fingerprint"] != results[False]["fingerprint"], "a packed run resumes no padded one"
    lengths = [min(s.length, 40) for s in index_hidden_states(hidden_states).samples]
    assert states[True]["step"] == len(epoch_steps(lengths, runs[True].model_copy(update={"batch_tokens": 256}), 1, 0))
    history = json.loads((Path(runs[True].training_dir) / "history.json").read_text())["history"]
    assert sum(r["tokens"] for r in history) >= sum(lengths) and all(r["loss"] > 0 for r in history)
    weights = {packed: final_weights(r) for packed, r in results.items()}
    assert all(torch.isfinite(t).all() for t in weights[True].values())
    assert not torch.allclose(weights[True]["fc.weight"], weights[False]["fc.weight"]), "other micro-batches, other steps"
