"""The gates on a ``hidden_states`` shard, computed where the files are (the GPU host).

- ``target_matches_traces``: the model that extracts is the one that rendered
  the traces (same config hash), checked before anything is extracted;
- ``states_finite``: no NaN or Inf anywhere in the stored states;
- ``states_match_traces``: the shard holds exactly the ids of its
  ``validated_traces`` shard, each with the same tokens and loss mask;
- ``final_state_reproduces_logits``: the target's ``lm_head`` applied to the
  stored final states (after the target's final norm when the sidecar says
  ``pre_norm``) gives the argmax of the engine that produced them on sampled
  positions, held at ``min_argmax_agreement`` (99.9 %). For the vLLM backend
  that argmax comes from the very pass that captured the states (its prompt
  logprobs, :func:`keep_logits_references`): a second pass of a bf16 MoE
  target may route some tokens to other experts, and would then check
  another forward than the one stored. A flip between two tokens whose logits
  are closer than the storage dtype's rounding (and the engine's own logit
  rounding) can separate is a tie, not a fault (a flat distribution after a
  sampled token has many of them in bf16, and more in 8-bit storage, whose
  bound :func:`storage_unit_roundoff` derives). Where a transformers fp32
  forward is at hand for a vLLM extraction, the agreement *across engines* is
  its own figure with its own tolerance (:data:`DEFAULT_CROSS_ENGINE_MIN_AGREEMENT`):
  bf16 against fp32 differs by more than rounding ties even on a dense model;
- ``aux_states_match_layer_ids``: the sidecar's layer ids are the configured
  ones, and, where a transformers reference is at hand, each stored aux block
  is closest to ``hidden_states[k]`` for exactly the id ``k`` the sidecar
  names (the off-by-one that silently ruins acceptance).

Each gate returns its figure, threshold and a few offending ids. Dagster-free.

The gates are declared (name, blocking, threshold, description) in
:data:`eagle3_assets.core.extraction.gates.HIDDEN_STATE_GATES`, beside this
module, which computes them: the declarations load without torch.

Why one file of about 450 lines: the five gates are one table,
reported together by :func:`gate_extracted_shard`, and the two gates that
sample (logits, aux states) share the draw (:func:`checked_ids`) and the
storage's rounding bound; apart, each would be read with the others open.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.core.reporting.checks import CheckOutcome
from eagle3_assets.core.extraction.gates import HIDDEN_STATE_GATES
from eagle3_assets.core.extraction.shard_extraction import storage_order
from eagle3_assets.core.extraction.shard_reading import iter_samples, read_sidecar
from eagle3_assets.core.extraction.traces import TargetFacts, Trace
from eagle3_assets.core.extraction.state_layout import FP8_DTYPE
from eagle3_assets.core.target.head import TargetHead
from eagle3_assets.core.target.identity import TargetIdentity

MAX_EXAMPLES = 10
DEFAULT_MIN_ARGMAX_AGREEMENT = HIDDEN_STATE_GATES["final_state_reproduces_logits"].threshold
# Stored states of a bf16 engine against an fp32 forward of another engine (transformers). Measured: a tiny-target
# shard extracted in bf16 on an H200 and in fp32 on a CPU agree on 99.78 % of final-state argmaxes (a dense
# model); the bf16 MoE tiny Kimi target, vLLM against transformers here: see docs/hidden-states.md. Not a tie
# bound: bf16 moves every state, and a token routed to other experts moves further.
DEFAULT_CROSS_ENGINE_MIN_AGREEMENT = 0.99


def storage_unit_roundoff(dtype: str, width: int) -> float:
    """The most that storing a state of ``width`` elements in ``dtype`` moves it, relative to its norm.

    A float format rounds each element to within half an ulp: ``u = eps / 2``
    of itself (bf16: 2^-9). The 8-bit format stores ``x / s`` with the row's
    scale ``s = max|x| / 448``: an element in e4m3's normal range is off by at
    most ``u = 2^-4`` of itself; one below its smallest normal (2^-6) sits on a
    fixed grid of 2^-9, so it is off by at most ``2^-10 · s`` absolute. Over the
    row: ``|err| <= u·|x| + sqrt(width) · 2^-10 · max|x| / 448
    <= (u + sqrt(width) · 2^-10 / 448) · |x|``.
    """
    if dtype == FP8_DTYPE:
        info = torch.finfo(torch.float8_e4m3fn)
        subnormal_half_step = info.smallest_normal * info.eps / 2  # 2^-6 · 2^-3 / 2 = 2^-10
        return info.eps / 2 + math.sqrt(width) * subnormal_half_step / info.max
    return torch.finfo(getattr(torch, dtype)).eps / 2


def rounding_margin(
    head: TargetHead,
    normed: torch.Tensor,
    token_a: torch.Tensor,
    token_b: torch.Tensor,
    dtype: str,
    logits: torch.Tensor | None = None,
    reference_dtype: str | None = None,
) -> torch.Tensor:
    """How far apart rounding the states to ``dtype`` can move the logits of ``token_a`` and ``token_b``.

    A state stored in ``dtype`` moves by at most ``u * |h|``
    (:func:`storage_unit_roundoff`: the unit roundoff for a float format,
    the scaled 8-bit format's bound for it), so the gap
    ``(w_a - w_b) . h`` moves by at most ``u * |h| * |w_a - w_b|``.
    Doubled: the final norm and the reference's own forward (bf16 on a
    GPU) round once more. An engine that hands out its logits in a 16-bit
    ``reference_dtype`` (vLLM serving bf16) rounds each of them once more,
    to within ``u' * |l|``: two logits closer than that are equal to it.
    """
    unit_roundoff = storage_unit_roundoff(dtype, normed.shape[-1])
    spread = (head.lm_head[token_a] - head.lm_head[token_b]).norm(dim=-1)
    margin = 2 * unit_roundoff * normed.norm(dim=-1) * spread
    if logits is not None and reference_dtype is not None and reference_dtype != "float32":
        engine_roundoff = torch.finfo(getattr(torch, reference_dtype)).eps / 2
        pair = logits.gather(1, token_a[:, None])[:, 0].abs() + logits.gather(1, token_b[:, None])[:, 0].abs()
        margin = margin + engine_roundoff * pair.to(margin.device)
    return margin


# -- the gates ---------------------------------------------------------------------------


def check_states_finite(shard_dir: Path) -> CheckOutcome:
    """Every stored state is finite; reads one sample at a time."""
    bad_samples: list[str] = []
    bad_values = 0
    tokens = 0
    for sample in iter_samples(shard_dir):
        tokens += sample.aux.shape[0]
        bad = int((~torch.isfinite(sample.aux)).sum()) + int((~torch.isfinite(sample.final)).sum())
        if bad:
            bad_values += bad
            bad_samples.append(sample.id)
    passed = bad_values == 0
    return CheckOutcome(
        name="states_finite",
        passed=passed,
        description="every stored state is finite"
        if passed
        else f"{bad_values} NaN/Inf values in {len(bad_samples)} samples (e.g. {', '.join(bad_samples[:3])})",
        metadata={"non_finite_values": bad_values, "samples_with_non_finite": len(bad_samples), "tokens": tokens, "offending_ids": bad_samples[:MAX_EXAMPLES]},
    )


def check_states_match_traces(shard_dir: Path, traces: Sequence[Trace]) -> CheckOutcome:
    """The shard holds exactly the traces' ids, each with the traces' tokens and loss mask."""
    sidecar = read_sidecar(shard_dir)
    by_id = {t.id: t for t in traces}
    stored_ids = list(sidecar["sample_ids"])
    duplicates = sorted(i for i, n in Counter(stored_ids).items() if n > 1)
    missing = sorted(set(by_id) - set(stored_ids))
    extra = sorted(set(stored_ids) - set(by_id))
    wrong_count = [i for i, n in zip(stored_ids, sidecar["num_tokens"]) if i in by_id and by_id[i].num_tokens != n]
    wrong_tokens: list[str] = []
    for sample in iter_samples(shard_dir):
        trace = by_id.get(sample.id)
        if trace is None:
            continue
        if not torch.equal(sample.input_ids, trace.input_ids) or not torch.equal(sample.loss_mask, trace.loss_mask):
            wrong_tokens.append(sample.id)
    problems = {
        "missing": missing,
        "unexpected": extra,
        "duplicated": duplicates,
        "token_count_differs": wrong_count,
        "tokens_or_mask_differ": wrong_tokens,
    }
    offending = [i for ids in problems.values() for i in ids]
    passed = not offending
    summary = ", ".join(f"{len(v)} {k.replace('_', ' ')}" for k, v in problems.items() if v)
    return CheckOutcome(
        name="states_match_traces",
        passed=passed,
        description=f"the {len(stored_ids)} stored samples are exactly the {len(traces)} validated traces"
        if passed
        else f"stored samples differ from validated_traces: {summary}",
        metadata={
            "stored_samples": len(stored_ids),
            "trace_samples": len(traces),
            **{f"{k}_count": len(v) for k, v in problems.items()},
            "offending_ids": offending[:MAX_EXAMPLES],
        },
    )


def checked_ids(ids_in_storage_order: Sequence[str], count: int, seed: int) -> list[str]:
    """The ``count`` sample ids a gate checks, drawn with ``seed`` from a shard's ids in storage order."""
    ids = list(ids_in_storage_order)
    return sorted(random.Random(seed).sample(ids, min(count, len(ids))))


def sample_ids_for_checks(shard_dir: Path, count: int, seed: int) -> list[str]:
    return checked_ids(read_sidecar(shard_dir)["sample_ids"], count, seed)


def keep_logits_references(backend: Any, traces: Sequence[Trace], samples: int, seed: int) -> None:
    """Before extraction: name to ``backend`` the samples ``final_state_reproduces_logits`` will check.

    A backend that can (vLLM's) then records its own greedy choice for them in
    the pass that captures their states, so the gate compares the stored states
    with the logits of that same forward. The draw is the gate's own
    (:func:`checked_ids` over the storage order that the sidecar will list).
    """
    keep = getattr(backend, "keep_references", None)
    if keep is None:
        return
    chosen = set(checked_ids([traces[i].id for i in storage_order(traces)], samples, seed))
    keep([trace.input_ids for trace in traces if trace.id in chosen])


def check_final_state_reproduces_logits(
    shard_dir: Path,
    head: TargetHead,
    reference_argmax: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    *,
    samples: int = 8,
    max_positions: int = 4096,
    min_agreement: float = DEFAULT_MIN_ARGMAX_AGREEMENT,
    seed: int = 0,
    reference_dtype: str | None = None,
    cross_engine_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    cross_engine_min_agreement: float = DEFAULT_CROSS_ENGINE_MIN_AGREEMENT,
) -> CheckOutcome:
    """The ``lm_head`` on the stored final states picks the same token as the engine that produced them.

    ``reference_argmax`` is that engine's greedy choice per position (for the
    vLLM backend, from the capture pass itself where the samples were named
    before extraction); ``reference_dtype`` the dtype its logits come in.
    ``cross_engine_argmax`` (optional) is another engine's choice for one
    sequence, e.g. transformers in fp32 for a vLLM extraction: its agreement is
    reported as its own figure and held at ``cross_engine_min_agreement``,
    with exact comparison (a precision difference is not a tie).
    """
    sidecar = read_sidecar(shard_dir)
    chosen = set(sample_ids_for_checks(shard_dir, samples, seed))
    sequences = {sample.id: sample.input_ids for sample in iter_samples(shard_dir, only=chosen)}
    engine = getattr(reference_argmax, "__self__", None)
    passes_before = dict(getattr(engine, "reference_passes", None) or {})
    references = dict(zip(sequences, reference_argmax(list(sequences.values()))))  # one call: vLLM batches them
    passes = {k: v - passes_before.get(k, 0) for k, v in (getattr(engine, "reference_passes", None) or {}).items()}
    rng = random.Random(seed + 1)
    per_sample_budget = max(1, max_positions // max(1, len(chosen)))
    agree = total = ties = 0
    cross_agree = cross_total = 0
    disagreements: list[dict[str, Any]] = []
    for sample in iter_samples(shard_dir, only=chosen):
        reference = references[sample.id].cpu()
        length = sample.final.shape[0]
        positions = sorted(rng.sample(range(length), min(length, per_sample_budget)))
        index = torch.tensor(positions, dtype=torch.long)
        normed = head.normed(sample.final[index], sidecar["final_state"])
        logits = (normed @ head.lm_head.T).cpu()
        stored = logits.argmax(dim=-1)
        expected = reference[index]
        gap = logits.gather(1, stored[:, None])[:, 0] - logits.gather(1, expected[:, None])[:, 0]
        margin = rounding_margin(head, normed, stored, expected, sidecar["dtype"], logits, reference_dtype).cpu()
        tie = (stored != expected) & (gap <= margin)
        same = (stored == expected) | tie
        agree += int(same.sum())
        ties += int(tie.sum())
        total += len(positions)
        if cross_engine_argmax is not None:
            other = cross_engine_argmax(sample.input_ids).cpu()[index]
            cross_agree += int((other == stored).sum())
            cross_total += len(positions)
        for j in (~same).nonzero().flatten().tolist()[:3]:
            disagreements.append(
                {
                    "id": sample.id,
                    "position": positions[j],
                    "target_argmax": int(expected[j]),
                    "stored_argmax": int(stored[j]),
                    "logit_gap": round(float(gap[j]), 6),
                    "rounding_margin": round(float(margin[j]), 6),
                }
            )
    agreement = agree / total if total else 0.0
    cross_agreement = cross_agree / cross_total if cross_total else None
    same_engine_passed = total > 0 and agreement >= min_agreement
    cross_passed = cross_agreement is None or cross_agreement >= cross_engine_min_agreement
    passed = same_engine_passed and cross_passed
    how = ", ".join(f"{n} from {k.replace('_', ' ')}" for k, n in passes.items() if n) or "from the engine's own forward"
    description = (
        f"argmax agreement {agreement:.4%} with the producing engine on {total} sampled positions of {len(chosen)} samples "
        f"({'>=' if same_engine_passed else '<'} {min_agreement:.1%}; references {how}; final state {sidecar['final_state']}; "
        f"{ties} rounding ties)"
    )
    if cross_agreement is not None:
        description += (
            f"; across engines (stored states against transformers fp32) {cross_agreement:.4%} "
            f"({'>=' if cross_passed else '<'} the tolerance {cross_engine_min_agreement:.1%})"
        )
    return CheckOutcome(
        name="final_state_reproduces_logits",
        passed=passed,
        description=description,
        metadata={
            "argmax_agreement": agreement,
            "threshold": min_agreement,
            "positions": total,
            "rounding_ties": ties,
            "samples": len(chosen),
            "final_state": sidecar["final_state"],
            "reference_passes": passes or {"own_forward": len(chosen)},
            "reference_logits_dtype": reference_dtype or "float32",
            **(
                {"cross_engine_argmax_agreement": cross_agreement, "cross_engine_tolerance": cross_engine_min_agreement}
                if cross_agreement is not None
                else {}
            ),
            "disagreements": disagreements[:MAX_EXAMPLES],
            "offending_ids": sorted({d["id"] for d in disagreements})[:MAX_EXAMPLES],
        },
    )


def check_aux_states_match_layer_ids(
    shard_dir: Path,
    expected_layer_ids: Sequence[int],
    target: TargetFacts,
    reference_hidden_states: Callable[[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    *,
    samples: int = 4,
    max_relative_error: float | None = None,
    seed: int = 0,
) -> CheckOutcome:
    """The sidecar names the configured layer ids, and the stored blocks are the states at those ids.

    With ``reference_hidden_states`` (an unpadded transformers forward giving
    every ``hidden_states[k]``), each stored aux block must be closer to
    ``hidden_states[k]`` for the id the sidecar names than to any other layer's,
    and within ``max_relative_error`` of it (default: 1e-3 for fp32 storage,
    5e-2 for 16-bit storage or a 16-bit target; 8-bit storage adds its own
    rounding bound, :func:`storage_unit_roundoff`, to the 16-bit figure).
    """
    sidecar = read_sidecar(shard_dir)
    stored_ids = [int(i) for i in sidecar.get("aux_layer_ids") or []]
    problems: list[str] = []
    if stored_ids != list(expected_layer_ids):
        problems.append(f"sidecar aux_layer_ids {stored_ids}, configured {list(expected_layer_ids)}")
    if int(sidecar.get("num_layers", -1)) != target.num_layers or int(sidecar.get("hidden_size", -1)) != target.hidden_size:
        problems.append(
            f"sidecar says L={sidecar.get('num_layers')} H={sidecar.get('hidden_size')}, "
            f"the target has L={target.num_layers} H={target.hidden_size}"
        )
    hidden = target.hidden_size
    verified: list[dict[str, Any]] = []
    offending: list[str] = []
    if reference_hidden_states is not None and len(stored_ids) == 3:
        tolerance = max_relative_error
        if tolerance is None:
            tolerance = 1e-3 if sidecar["dtype"] == "float32" else 5e-2
            if sidecar["dtype"] == FP8_DTYPE:
                tolerance += storage_unit_roundoff(FP8_DTYPE, hidden)
        for sample in iter_samples(shard_dir, only=set(sample_ids_for_checks(shard_dir, samples, seed))):
            states = reference_hidden_states(sample.input_ids)
            for block, claimed in enumerate(stored_ids):
                stored = sample.aux[:, block * hidden : (block + 1) * hidden].float()
                errors = {k: float((stored - states[k]).norm() / states[k].norm().clamp_min(1e-12)) for k in range(len(states) - 1)}
                closest = min(errors, key=errors.get)
                entry = {"id": sample.id, "block": block, "sidecar_layer_id": claimed, "closest_layer_id": closest}
                if claimed >= len(states) - 1:
                    entry["note"] = "id L (pre-norm) is not in the reference; not compared"
                else:
                    entry["relative_error"] = round(errors[claimed], 7)
                    if closest != claimed or errors[claimed] > tolerance:
                        offending.append(sample.id)
                        problems.append(
                            f"{sample.id}: aux block {block} matches hidden_states[{closest}] best "
                            f"(relative error {errors[closest]:.2e}), the sidecar says layer {claimed} ({errors[claimed]:.2e})"
                        )
                verified.append(entry)
    passed = not problems
    how = "against a transformers forward" if verified else "sidecar only (no transformers reference)"
    return CheckOutcome(
        name="aux_states_match_layer_ids",
        passed=passed,
        description=f"aux states are at layer ids {stored_ids} (vLLM's convention), checked {how}"
        if passed
        else "; ".join(dict.fromkeys(problems))[:1000],
        metadata={
            "sidecar_aux_layer_ids": stored_ids,
            "configured_aux_layer_ids": list(expected_layer_ids),
            "verified_against": how,
            "comparisons": verified[: 3 * MAX_EXAMPLES],
            "problems": list(dict.fromkeys(problems))[:MAX_EXAMPLES],
            "offending_ids": sorted(set(offending))[:MAX_EXAMPLES],
        },
    )


def check_target_matches_traces(extracting: TargetIdentity, rendering: dict[str, Any] | None) -> CheckOutcome:
    """The model whose states were stored is the model whose tokenizer and template rendered the traces.

    Without this gate a target resource that fell back to another model (a
    launchpad override that lost the path) extracts *that* model's states over
    the user's traces, and every other gate passes: the states are finite, the
    tokens match, and that model's own head reproduces its own argmax.
    """
    metadata = {"extracting_target": extracting.as_dict(), "rendering_target": rendering}
    if rendering is None:
        return CheckOutcome(
            "target_matches_traces", False,
            "the traces carry no target identity (written by an older version): materialise validated_traces for this shard again",
            metadata,
        )  # fmt: skip
    mismatch = extracting.mismatch(rendering)
    if mismatch:
        return CheckOutcome(
            "target_matches_traces", False,
            f"the extracting target {mismatch}, which rendered the traces: set target_model.path to the traces' target "
            "(or materialise validated_traces again with this one)",
            metadata,
        )  # fmt: skip
    return CheckOutcome("target_matches_traces", True, f"extracted with the target that rendered the traces ({extracting.config_hash})", metadata)


def gate_extracted_shard(
    shard_dir: Path,
    traces: Sequence[Trace],
    head: TargetHead,
    reference_argmax: Callable,
    aux_layer_ids: Sequence[int],
    facts: TargetFacts,
    reference_states: Callable | None,
    recipe: Any,
    seed: int,
) -> list[CheckOutcome]:
    """Every gate after extraction (all of ``HIDDEN_STATE_GATES`` but the first), with ``recipe``'s thresholds and samples.

    ``recipe`` is an :class:`~eagle3_assets.core.extraction.job.ExtractionRecipe`: the
    ``hidden_states`` stage and bounded-disk training gate their shards alike.
    ``reference_argmax`` is the producing backend's; for a vLLM extraction with a
    transformers reference at hand (``reference_states``), the agreement across
    engines is computed too, from that reference's post-norm ``hidden_states[L]``.
    """
    engine = getattr(reference_argmax, "__self__", None)
    cross_engine = None
    if reference_states is not None and getattr(engine, "name", None) == "vllm":

        def cross_engine(input_ids: torch.Tensor) -> torch.Tensor:
            return head.logits(reference_states(input_ids)[-1], "post_norm").argmax(dim=-1)

    return [
        check_states_finite(shard_dir),
        check_states_match_traces(shard_dir, traces),
        check_final_state_reproduces_logits(
            shard_dir,
            head,
            reference_argmax,
            samples=recipe.logits_check_samples,
            max_positions=recipe.logits_check_positions,
            min_agreement=recipe.min_argmax_agreement,
            seed=seed,
            reference_dtype=getattr(engine, "logits_dtype", None),
            cross_engine_argmax=cross_engine,
            cross_engine_min_agreement=getattr(recipe, "cross_engine_min_argmax_agreement", DEFAULT_CROSS_ENGINE_MIN_AGREEMENT),
        ),
        check_aux_states_match_layer_ids(shard_dir, aux_layer_ids, facts, reference_states, samples=recipe.aux_check_samples, seed=seed),
    ]
