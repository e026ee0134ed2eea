"""Training memory: each setting that cuts the step's peak computes the same gradients, and the estimate holds.

CPU only, float32, a small draft with grouped-query attention (2 query heads
per key head) over random states: what is compared is the loss's gradients
with a setting on and off, and the planner's estimate
(:func:`eagle3_assets.core.training.memory.estimate_step_bytes`) against the
peak measured by the profiler's allocator events
(:func:`~eagle3_assets.core.training.memory.allocated_peak_during`) plus the
bytes of the tensors alive before the step. At the user's lengths (2,048
tokens of one sample, where the attention is most of the peak) the estimate's
every term worth 5 % of it at Kimi width is shown to be needed: without it the
estimate falls under the measured peak.
"""

from __future__ import annotations

import pytest
import torch

from eagle3_assets.core.draft.model import DraftConfig, Eagle3Draft
from eagle3_assets.core.target.head import TargetHead
from eagle3_assets.core.training.losses import LOSSES
from eagle3_assets.core.training.loss import TrainingTimeTest
from eagle3_assets.core.training.memory import (
    MemoryPlanError,
    StepShape,
    allocated_peak_during,
    estimate_step_bytes,
    plan_micro_batch,
)
from eagle3_assets.core.draft.vocab import build_vocab_mapping

# Float32 on one thread: the settings change the order of some sums (chunks, recomputation), not the maths.
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
# The estimate against the measured peak, as a ratio: never much under (a run planned on it must not run out of
# memory), at most a fifth over (memory left unused). Allocator rounding and what one kernel allocates and frees
# inside itself are in neither figure. Seen here: 0.99 to 1.07 for the Llama form at 64 to 1,536 tokens, 1.09 to
# 1.13 for the MLA form (bench/training_memory.py at 2,048 to 8,192 tokens: docs/performance.md).
ESTIMATE_RATIO = (0.95, 1.20)


def small_draft(hidden=64, heads=4, kv_heads=2, head_dim=32, intermediate=160, vocab=700, draft_vocab=300, seed=0):
    torch.manual_seed(seed)
    mapping = build_vocab_mapping(torch.randint(0, 1000, (vocab,)), draft_vocab)
    config = DraftConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=hidden, aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    draft = Eagle3Draft(config)
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    draft.embed_tokens.weight.requires_grad_(False)
    head = TargetHead(lm_head=torch.randn(vocab, hidden) * 0.1, norm_weight=torch.ones(hidden), eps=1e-5)
    return draft, head, mapping


def small_mla_draft(seed=0, **shape):
    """The MLA form at the measured width, its latents wider than the hidden size as the built Kimi target's are."""
    from eagle3_assets.core.draft.model_mla import Eagle3MLADraft, MLADraftConfig

    torch.manual_seed(seed)
    shape = {**MEASURED_DRAFT, **shape}
    mapping = build_vocab_mapping(torch.randint(0, 1000, (shape["vocab"],)), shape["draft_vocab"])
    config = MLADraftConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"], q_lora_rank=64,
        kv_lora_rank=192, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=shape["vocab"],
        draft_vocab_size=shape["draft_vocab"], target_hidden_size=shape["hidden"], aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    draft = Eagle3MLADraft(config)
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    draft.embed_tokens.weight.requires_grad_(False)
    head = TargetHead(lm_head=torch.randn(shape["vocab"], shape["hidden"]) * 0.1, norm_weight=torch.ones(shape["hidden"]), eps=1e-5)
    return draft, head, mapping


def random_batch(config: DraftConfig, rows: int, length: int, seed=1):
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(rows, length, 3 * config.target_hidden_size, generator=generator)
    final = torch.randn(rows, length, config.target_hidden_size, generator=generator)
    ids = torch.randint(0, config.vocab_size, (rows, length), generator=generator)
    mask = torch.rand(rows, length, generator=generator) < 0.8
    mask[-1, length // 2 :] = False  # a shorter sample: padding at the end
    return aux, final, ids, mask


def random_anchors(rows: int, length: int, k: int = 3, seed=3) -> torch.Tensor:
    """A refinement round's anchors (core/refinement/anchors.py) at random: a third of the positions rejected."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (rows, length, k), generator=generator).to(torch.int8)


def gradients(draft, head, mapping, batch, *, ttt=3, checkpoint_steps=False, loss_chunk_tokens=0, target_chunk=0, loss="kl", documents=None):
    aux, final, ids, mask = batch
    anchors = random_anchors(*ids.shape) if LOSSES[loss].anchored else None
    draft.zero_grad(set_to_none=True)
    chunk = target_chunk or final.shape[0] * final.shape[1]
    target_logits, target_top = head.draft_logits(final, "post_norm", mapping.draft_to_target, chunk=chunk)
    ttt_module = TrainingTimeTest(draft, ttt, 0.8, checkpoint_steps=checkpoint_steps, loss_chunk_tokens=loss_chunk_tokens, loss=loss)
    total, stats = ttt_module(aux, ids, mask, target_logits, target_top, documents, anchors)
    total.backward()
    return total.detach(), stats, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "setting",
    [
        {"checkpoint_steps": True},
        {"loss_chunk_tokens": 7},  # chunks that do not divide the positions
        {"target_chunk": 5},
        {"checkpoint_steps": True, "loss_chunk_tokens": 16, "target_chunk": 9},
    ],
    ids=["activation_checkpointing", "loss_chunk_tokens", "target_head_chunk_tokens", "all three"],
)
def test_each_memory_setting_computes_the_same_gradients(setting):
    torch.set_num_threads(1)
    draft, head, mapping = small_draft()
    batch = random_batch(draft.config, rows=3, length=20)
    loss_off, stats_off, off = gradients(draft, head, mapping, batch)
    loss_on, stats_on, on = gradients(draft, head, mapping, batch, **setting)
    assert float(loss_off) > 0 and stats_off[2].sum() > 0  # something is supervised
    torch.testing.assert_close(loss_on, loss_off, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(stats_on, stats_off, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    assert off.keys() == on.keys() and "lm_head.weight" in off and "fc.weight" in off
    for name in off:
        assert off[name].abs().max() > 0, f"{name}: no gradient at all, the comparison would be empty"
        torch.testing.assert_close(on[name], off[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{name} differs with {setting}")


@pytest.mark.parametrize("loss", LOSSES)
def test_each_losss_chunked_gradient_is_the_autograd_gradient_of_the_unchunked_loss(loss):
    """The chunked loss's backward is written out (no graph is kept); unchunked, autograd differentiates the same loss."""
    torch.set_num_threads(1)
    draft, head, mapping = small_draft()
    batch = random_batch(draft.config, rows=3, length=20)
    loss_off, stats_off, off = gradients(draft, head, mapping, batch, loss=loss)
    loss_on, stats_on, on = gradients(draft, head, mapping, batch, loss=loss, loss_chunk_tokens=7, checkpoint_steps=True)
    assert float(loss_off) > 0 and stats_off[2].sum() > 0
    torch.testing.assert_close(loss_on, loss_off, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(stats_on, stats_off, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    for name in off:
        assert off[name].abs().max() > 0, f"{name}: no gradient at all, the comparison would be empty"
        torch.testing.assert_close(on[name], off[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{name} differs for loss {loss}")
    if loss != "kl":  # another loss: other gradients than the default's, or the setting reached nothing
        _, _, kl = gradients(draft, head, mapping, batch)
        assert not torch.allclose(kl["lm_head.weight"], off["lm_head.weight"], rtol=1e-3, atol=1e-6)


def measured_step_peak(draft, head, mapping, rows: int, length: int, ttt: int, *, checkpoint: bool, loss_chunk: int, target_chunk: int, loss="kl") -> int:
    """Peak bytes of one optimizer step: the tensors alive before it plus the most it allocated at once."""
    batch = random_batch(draft.config, rows, length)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ttt_module = TrainingTimeTest(draft, ttt, 0.8, checkpoint_steps=checkpoint, loss_chunk_tokens=loss_chunk, loss=loss)

    def step(batch):
        aux, final, ids, mask = batch
        tokens = ids.numel()
        logits, top = head.draft_logits(final, "post_norm", mapping.draft_to_target, chunk=min(target_chunk or tokens, tokens))
        loss, _ = ttt_module(aux, ids, mask, logits, top)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # The optimizer's state exists from the first step on; its size is the weights', so a short batch makes it (the
    # long ones' first step would cost as much as the measured one).
    step(random_batch(draft.config, 1, min(length, 32), seed=2))
    alive = [*draft.parameters(), *draft.buffers(), head.lm_head, head.norm_weight, *batch]
    alive += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    before = sum(t.numel() * t.element_size() for t in alive)
    return before + allocated_peak_during(lambda: step(batch))


MEASURED_DRAFT = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=3000, draft_vocab=1200)


def measured_draft(form: str):
    return small_mla_draft() if form == "deepseek_mla" else small_draft(**MEASURED_DRAFT)


def measure_in_this_process(rows: int, length: int, settings: dict, form: str = "llama", shape: dict | None = None, ttt: int = 3) -> int:
    """``settings`` may name the loss; ``shape``: the llama draft's widths (default: MEASURED_DRAFT)."""
    torch.set_num_threads(1)
    draft, head, mapping = small_draft(**shape) if shape else measured_draft(form)
    return measured_step_peak(draft, head, mapping, rows, length, ttt, **settings)


def measure_cases(cases: list[tuple[int, int, dict, dict]]) -> list[int]:
    """Each (rows, length, settings, shape) measured one after another in one fresh interpreter."""
    return [measure_in_this_process(rows, length, settings, "llama", shape) for rows, length, settings, shape in cases]


@pytest.mark.parametrize(
    "memory_settings, form, loss",
    # The LK losses are measured in the test below, with the settings off where their own tensors count: with them on,
    # at these sizes, an LK loss's peak was KL's to the byte (issue 39), so that case tested nothing of its own.
    [(False, "llama", "kl"), (True, "llama", "kl"), (False, "deepseek_mla", "kl")],
    ids=["settings off", "settings on", "MLA form"],
)
def test_the_estimate_holds_the_measured_peak_at_two_sizes(memory_settings, form, loss):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    draft, _, _ = measured_draft(form)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert StepShape.of(draft.config, 1, 1, 3, bf16=False).trainable_parameters == trainable
    figures = []
    for rows, length in ((2, 64), (4, 160)):
        settings = dict(checkpoint=memory_settings, loss_chunk=32 if memory_settings else 0, target_chunk=48 if memory_settings else 0, loss=loss)
        # Measured in a fresh interpreter: what earlier tests left in this process (seen: 17.7 MB instead of 21.2 MB
        # after the bounded-disk tests) is not the step's.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            measured = pool.submit(measure_in_this_process, rows, length, settings, form).result()
        shape = StepShape.of(
            draft.config, rows * length, length, 3, bf16=False, activation_checkpointing=settings["checkpoint"],
            loss_chunk_tokens=settings["loss_chunk"], target_head_chunk_tokens=settings["target_chunk"], loss=loss,
        )  # fmt: skip
        estimate = estimate_step_bytes(shape)["total"]
        figures.append((rows * length, estimate, measured, estimate / measured))
    print("tokens, estimate, measured, ratio:", figures)
    for tokens, estimate, measured, ratio in figures:
        assert ESTIMATE_RATIO[0] <= ratio <= ESTIMATE_RATIO[1], f"{tokens} tokens: estimate {estimate} B against measured {measured} B"
    assert figures[1][2] > 1.5 * figures[0][2], "the two sizes differ enough for the comparison to mean something"


# The user's lengths (issue 39): a draft of 8 narrow query heads over 1 key/value head, whose attention is 0.45 to 0.8
# of the step's memory at 1,024 to 8,192 tokens (its one-matrix probabilities up to a block, its blocks' past it), as
# it is a large part at Kimi width; bench/training_memory.py runs the full grid (2,048, 4,096 and 8,192 tokens, KL and
# nla, the memory settings on and off) on the same functions.
LONG_DRAFT = dict(MEASURED_DRAFT, heads=8, kv_heads=1, head_dim=16)
# The same with a draft vocabulary whose loss tensors are most of the step: what an LK loss keeps is seen there.
LOSS_DRAFT = dict(LONG_DRAFT, vocab=8000, draft_vocab=4000)
# And one whose attention projections (8 heads of 64 over 4 key/value heads) are a large part of it: q/k/v and the
# grouped heads' copies (8.4 % at Kimi width since the attention is blocked; 2.8 to 4.6 % before) are seen there.
PROJECTION_DRAFT = dict(hidden=64, heads=8, kv_heads=4, head_dim=64, intermediate=128, vocab=3000, draft_vocab=300)
# Terms worth >= 5 % at Kimi width that no case here can show to be needed, and why (each listed, so that a term that
# crosses 5 % later is not skipped unseen).
NOT_SHOWN_NEEDED = {
    "bf16_weight_copies": "training on the CPU runs in float32: there are none to measure",
    # 5.7 % at Kimi width with the shipped settings (4.0 % before the attention was blocked). With the settings on,
    # PROJECTION_DRAFT at 512 tokens measured the estimate at 1.097 of its peak, and without this term 1.013: the
    # estimate over-counts something of a checkpointed step there, not yet found.
    "checkpointed_step_inputs": "the checkpointed estimate is 1.10 of the peak where they are a large part",
}
KIMI_DRAFT = DraftConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64, head_dim=128,
                         vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168, aux_layer_ids=(2, 30, 58))  # fmt: skip
# A term worth this share of the estimate at Kimi width must be caught when dropped (issue 39).
TERM_SHARE_THAT_MATTERS = 0.05


def kimi_term_shares() -> dict[str, dict[str, float]]:
    """Each term's share of the estimate at Kimi width: what the total loses without it (``peak_of``, the module's own).

    8,192 tokens per micro-batch, depth 7, bf16; the shipped memory settings (and loss) and the settings off, for KL
    and nla; of samples of the shipped ``max_seq_len`` (4,096: blocked attention) and of one attention block (1,024:
    the one-matrix attention, whose probabilities are kept), the two regimes the planner's estimate takes the larger of.
    """
    from eagle3_assets.core.draft.model import ATTENTION_BLOCK
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.memory import estimate_terms, peak_of

    defaults = TrainConfig(hidden_state_dirs=["x"], vocab_mapping="v", target_path="t", training_dir="d")
    shipped = dict(activation_checkpointing=defaults.activation_checkpointing, loss_chunk_tokens=defaults.loss_chunk_tokens,
                   target_head_chunk_tokens=defaults.target_head_chunk_tokens)  # fmt: skip
    shares = {}
    for seq_len in (defaults.max_seq_len, ATTENTION_BLOCK):
        for name, settings in (("defaults", shipped), ("settings off", {})):
            for loss in (defaults.loss, "nla"):
                terms = estimate_terms(StepShape.of(KIMI_DRAFT, 8192, seq_len, defaults.ttt_steps, bf16=True, loss=loss, **settings))
                total = peak_of(terms)["total"]
                shares[f"{seq_len}: {name}, {loss}"] = {term: 1 - peak_of({**terms, term: 0})["total"] / total for term in terms}
    return shares


def long_case_shape(tokens: int, on: bool, loss: str, ttt: int = 3, rows: int = 1, draft: dict = LONG_DRAFT) -> tuple[dict, StepShape]:
    """The measurement's settings and the estimate's shape of ``rows`` samples of ``tokens`` tokens of ``draft``."""
    # The chunks a quarter and an eighth of the micro-batch: at 8,192 tokens, the shipped 2,048 and 1,024.
    settings = dict(checkpoint=on, loss_chunk=tokens // 4 if on else 0, target_chunk=tokens // 8 if on else 0, loss=loss)
    config = small_draft(**draft)[0].config
    shape = StepShape.of(config, rows * tokens, tokens, ttt, bf16=False, activation_checkpointing=on,
                         loss_chunk_tokens=settings["loss_chunk"], target_head_chunk_tokens=settings["target_chunk"], loss=loss)  # fmt: skip
    return settings, shape


# (tokens of one sample, memory settings on, loss, draft): the fewest cases on which dropping each term worth 5 % at
# Kimi width fails, and nla's own entry.
ESTIMATE_CASES = [
    (64, True, "kl", "long"), (1024, False, "kl", "long"), (1536, False, "kl", "long"), (1536, True, "nla", "long"), (1024, False, "nla", "loss"),
    (512, False, "kl", "projection"),
]  # fmt: skip
CASE_DRAFTS = {"long": LONG_DRAFT, "loss": LOSS_DRAFT, "projection": PROJECTION_DRAFT}


def test_the_estimate_holds_the_measured_peak_with_attention_in_blocks_and_each_term_that_matters_at_kimi_width_is_needed():
    """The estimate within ESTIMATE_RATIO of the measured peak, and without any term worth >= 5 % at Kimi width, under it.

    Six cases, measured as above (one fresh interpreter, float32, one thread), depth 3, one sample each: LONG_DRAFT
    at 64 tokens with the memory settings on and KL (the weights' terms are a large part of it), at 1,024 tokens with
    the settings off and KL (the one-matrix attention, its probabilities kept: 0.60 of the estimate), at 1,536
    tokens off/KL and on/nla (the blocked attention, two blocks: 0.36 and 0.66), LOSS_DRAFT at 1,024 tokens,
    settings off, nla (the loss's tensors are most of it), and PROJECTION_DRAFT at 512 tokens, off, KL (q/k/v and
    the grouped copies). bench/training_memory.py runs the 2,048 / 4,096 / 8,192 grid
    (docs/performance.md#chain-attention-in-blocks-at-2k--4k--8k-tokens). Seen: 0.993 to 1.035.

    Each term worth >= 5 % at Kimi width (kimi_term_shares: hidden 7,168, 64 heads, depth 7, 8,192 tokens, bf16, the
    shipped settings and off, KL and nla, 4,096- and 1,024-token samples; its largest share) is dropped by the test
    itself and some case must fall under 0.95 (the lowest, computed on the measured peaks): draft_weights 10.1 %
    (64 tokens: 0.889), embedding 10.0 % (0.897), gradients 10.1 % (0.889), optimizer_state 20.3 % (0.743),
    target_head 10.0 % (0.897), norms 20.2 % (1,536 off: 0.910), mlp 9.4 % (0.899), loss_vocabulary 23.0 %
    (1,024 nla: 0.622), attention_probabilities 14.6 % (1,024 off: 0.613), attention_transient 9.5 % (1,536 on:
    0.400), grouped_kv_copies 8.4 % (512, PROJECTION_DRAFT: 0.856); NOT_SHOWN_NEEDED lists the two it cannot show,
    and why. By hand in memory.py, each failing: the blocked attention's moment of two block tensors, not three
    (1,536 off: 0.874); ``attention_probabilities`` 0 for one-matrix samples too (1,024 off: 0.613).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from eagle3_assets.core.training.memory import estimate_terms, peak_of

    cases = [long_case_shape(tokens, on, loss, draft=CASE_DRAFTS[draft]) for tokens, on, loss, draft in ESTIMATE_CASES]
    plan = [(1, case[0], settings, CASE_DRAFTS[case[3]]) for case, (settings, _) in zip(ESTIMATE_CASES, cases)]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        measured = pool.submit(measure_cases, plan).result()
    terms = [estimate_terms(shape) for _, shape in cases]
    ratios = [peak_of(each)["total"] / peak for each, peak in zip(terms, measured)]
    print("case, estimate / measured:", list(zip(ESTIMATE_CASES, [round(r, 3) for r in ratios])))
    for case, ratio, peak in zip(ESTIMATE_CASES, ratios, measured):
        assert ESTIMATE_RATIO[0] <= ratio <= ESTIMATE_RATIO[1], f"{case}: estimate {ratio:.3f} of the measured {peak} B"
    for case, each in zip(ESTIMATE_CASES, terms):
        if case[0] >= 1024 and case[3] == "long":  # the attention is what the long cases are for: one-matrix and blocked
            attention = (each["attention_probabilities"] + each["attention_transient"]) / peak_of(each)["total"]
            assert attention >= 0.30, f"{case}: the attention is {attention:.2f} of the estimate"
    shares = kimi_term_shares()
    that_matter = sorted({term for column in shares.values() for term, share in column.items() if share >= TERM_SHARE_THAT_MATTERS})
    assert {"attention_probabilities", "attention_transient", "optimizer_state", "loss_vocabulary"} <= set(that_matter), that_matter
    assert set(NOT_SHOWN_NEEDED) <= set(that_matter), "a term under 5 % at Kimi width needs no excuse"
    for term in that_matter:
        if term in NOT_SHOWN_NEEDED:
            continue
        without = [peak_of({**each, term: 0})["total"] / peak for each, peak in zip(terms, measured)]
        assert min(without) < ESTIMATE_RATIO[0], f"{term} ({max(c[term] for c in shares.values()):.1%} at Kimi width): dropped, still {min(without):.3f} of the peak"


def test_the_planner_splits_the_micro_batch_to_fit_and_refuses_what_cannot_fit():
    from eagle3_assets.core.training.config import TrainConfig

    draft, _, _ = small_draft(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=3000, draft_vocab=1200)
    config = TrainConfig(hidden_state_dirs=["x"], vocab_mapping="v", target_path="t", training_dir="d", batch_tokens=4096, grad_accumulation=2, max_seq_len=256, ttt_steps=3, memory_fraction=0.5)
    cpu = torch.device("cpu")
    roomy = plan_micro_batch(draft.config, config, longest=256, device=cpu, bf16=False, free=(2**40, 2**40))
    assert (roomy.batch_tokens, roomy.grad_accumulation, roomy.split) == (4096, 2, 1)
    full = estimate_step_bytes(StepShape.of(draft.config, 4096, 256, 3, bf16=False, activation_checkpointing=True,
                                            loss_chunk_tokens=2048, target_head_chunk_tokens=1024))["total"]  # fmt: skip
    tight = plan_micro_batch(draft.config, config, longest=256, device=cpu, bf16=False, free=(int(full * 0.7 / 0.5), 2**40))
    assert tight.split > 1 and tight.batch_tokens * tight.split >= 4096 and tight.grad_accumulation == 2 * tight.split
    assert tight.estimate_bytes <= tight.budget_bytes
    def one(length: int) -> int:
        return estimate_step_bytes(StepShape.of(draft.config, length, length, 3, bf16=False, activation_checkpointing=True,
                                                loss_chunk_tokens=2048, target_head_chunk_tokens=1024))["total"]  # fmt: skip

    free = one(256) + one(128)  # at memory_fraction 0.5: room for a sequence of 128 tokens, not of 256
    with pytest.raises(MemoryPlanError, match=rf"one sequence of 256 tokens needs an estimated {one(256)} B .* the device has {free} B free .*what would fit: max_seq_len: 128"):
        plan_micro_batch(draft.config, config, longest=256, device=cpu, bf16=False, free=(free, 2**40))
    with pytest.raises(MemoryPlanError, match=r"the device has 1000 B free .*what would fit: a device with more free memory"):
        plan_micro_batch(draft.config, config, longest=256, device=cpu, bf16=False, free=(1000, 2**40))


def test_a_kimi_width_draft_at_depth_7_fits_a_96_gb_card_by_the_defaults():
    """The issue's shape: hidden 7168, target vocabulary 163,840, draft vocabulary 32,000, depth 7, 8,192 tokens."""
    from eagle3_assets.core.training.config import TrainConfig

    kimi = DraftConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64, head_dim=128,
                       vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168, aux_layer_ids=(2, 30, 58))  # fmt: skip
    defaults = TrainConfig(hidden_state_dirs=["x"], vocab_mapping="v", target_path="t", training_dir="d")
    settings = dict(activation_checkpointing=defaults.activation_checkpointing, loss_chunk_tokens=defaults.loss_chunk_tokens,
                    target_head_chunk_tokens=defaults.target_head_chunk_tokens)  # fmt: skip
    on = estimate_step_bytes(StepShape.of(kimi, 8192, 2048, 7, bf16=True, **settings))["total"]
    off = estimate_step_bytes(StepShape.of(kimi, 8192, 2048, 7, bf16=True))["total"]
    assert on <= 90e9 < off, (on, off)


def test_one_8192_token_sample_at_kimi_width_is_planned_on_a_96_gb_card_by_the_defaults():
    """The user's longest traces (issue 39): ``max_seq_len`` 8,192 at Kimi width, depth 7, bf16, the shipped settings,
    96 GB free. With the attention blocked the planner plans it (one sample: 47.5 GB); with the whole matrix it
    refused (92.8 GB, over 0.9 x 96 GB). And the planner's estimate is the larger regime: 8,192 tokens of one-block
    samples, settings off, keep every step's probabilities (107 GB), over one 8,192-token sample (93 GB).

    Mutation: the planner's estimate of samples of ``seq_len`` only (``lengths = {shape.seq_len}`` in
    estimate_step_bytes): the settings-off comparison fails.
    """
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.memory import estimate_terms, peak_of

    config = TrainConfig(hidden_state_dirs=["x"], vocab_mapping="v", target_path="t", training_dir="d", max_seq_len=8192, batch_tokens=8192)
    plan = plan_micro_batch(KIMI_DRAFT, config, longest=8192, device=torch.device("cpu"), bf16=True, free=(96 * 10**9, 96 * 10**9))
    assert plan.batch_tokens == 8192 and plan.split == 1 and plan.estimate_bytes < 0.6 * 96e9, plan.describe()
    one_sample = StepShape.of(KIMI_DRAFT, 8192, 8192, 7, bf16=True)
    assert estimate_step_bytes(one_sample)["total"] > 1.1 * peak_of(estimate_terms(one_sample))["total"]
