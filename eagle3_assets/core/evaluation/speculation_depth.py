"""Choosing ``num_speculative_tokens`` (k): the acceptance curve over k, and the k to deploy.

**The curve from one server.** vLLM takes k at start-up, so measuring k = 1..5
directly costs one server per k. One server at the largest k, K, gives the
per-position acceptance counters instead: position i counts the drafts whose
first i tokens were all accepted. With greedy verification a step accepts the
longest prefix of the chain that matches the target, and the first k tokens of
vLLM's EAGLE chain do not depend on how many more follow, so *for each drafting
step* the tokens a k-chain would get accepted are min(accepted at K, k), and

    acceptance length at k = 1 + sum of the rates of positions 1..k.

What this does not capture: a k-run drafts from other places in the text than
the K-run did (it advances by fewer tokens per step), so the derived figure
weighs the text's easy and hard stretches as the K-run met them. It is an
estimate, labelled ``derived``; a GPU host measures each k on its own server
(``measured``), and needs to anyway, since throughput at k cannot be derived.
``bench/k_curve_derivation.py`` compares derived with measured figures: the
derived ones run slightly low, closer the nearer k is to the served one.

**The k to deploy.** Where throughput is measured (a GPU host), the k with the
most output tokens/s. Elsewhere, the cost model: a step costs one target
verification plus k draft forwards, each ``c`` of a target step, and yields
L(k) tokens, so the estimated speedup is L(k) / (1 + k c). ``c`` is the
deployment's ratio (``draft_cost_ratio``); the ratio on the measuring host is
recorded beside it, but on a CPU a tiny draft costs about as much as the tiny
target, which says nothing about the GPUs the draft will run on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

DEFAULT_K_VALUES = (1, 2, 3, 4, 5)
DEFAULT_DRAFT_COST_RATIO = 0.1  # one draft layer beside a many-layer target on GPUs: ~0.05-0.15 of a step


@dataclass(frozen=True)
class CurvePoint:
    k: int
    acceptance_length: float
    rates_per_position: list[float]
    source: str  # "measured" (a server at this k) or "derived" (positions 1..k of a server at a larger k)
    output_tokens_per_s: float | None = None
    speedup: float | None = None  # measured tokens/s against the target alone, or the cost model's estimate
    speedup_source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def validated_k_values(k_values: Sequence[int]) -> list[int]:
    ks = sorted(set(int(k) for k in k_values))
    if not ks or ks[0] < 1:
        raise ValueError(f"draft_evaluation k_values {list(k_values)}: give one or more num_speculative_tokens, each >= 1")
    return ks


def derived_curve(rates_per_position: Sequence[float], k_values: Sequence[int]) -> list[CurvePoint]:
    """Acceptance length at each k from the per-position rates of one server at k >= max(k_values)."""
    ks = validated_k_values(k_values)
    if ks[-1] > len(rates_per_position):
        raise ValueError(f"per-position rates cover {len(rates_per_position)} positions, k_values ask for {ks[-1]}")
    served = len(rates_per_position)
    return [
        CurvePoint(k, 1.0 + sum(rates_per_position[:k]), list(rates_per_position[:k]), "measured" if k == served else "derived")
        for k in ks
    ]


def measured_ratio(reference_tokens_per_s: float, speculative_tokens_per_s: float, acceptance_length: float, k: int) -> float | None:
    """The draft's cost per forward relative to a target step, solved from two passes on this host.

    Time per step with the draft is (1 + k c) target steps and yields L tokens:
    tokens/s with draft = L * reference / (1 + k c).
    """
    if reference_tokens_per_s <= 0 or speculative_tokens_per_s <= 0 or k < 1:
        return None
    return max(0.0, (acceptance_length * reference_tokens_per_s / speculative_tokens_per_s - 1.0) / k)


def with_estimated_speedup(curve: Sequence[CurvePoint], draft_cost_ratio: float) -> list[CurvePoint]:
    return [
        CurvePoint(**{**p.to_dict(), "speedup": p.acceptance_length / (1.0 + p.k * draft_cost_ratio), "speedup_source": "cost model"})
        for p in curve
    ]


def with_measured_speedup(curve: Sequence[CurvePoint], tokens_per_s: Mapping[int, float], reference_tokens_per_s: float) -> list[CurvePoint]:
    return [
        CurvePoint(
            **{
                **p.to_dict(),
                "output_tokens_per_s": tokens_per_s[p.k],
                "speedup": tokens_per_s[p.k] / reference_tokens_per_s if reference_tokens_per_s else 0.0,
                "speedup_source": "measured",
            }
        )
        for p in curve
    ]


def recommend(curve: Sequence[CurvePoint]) -> CurvePoint:
    """The point with the highest speedup; on a tie (within 1 %), the smaller k (less draft work for the same gain)."""
    best = max(p.speedup or 0.0 for p in curve)
    return min((p for p in curve if (p.speedup or 0.0) >= best * 0.99), key=lambda p: p.k)


def render_curve_table(curve: Sequence[CurvePoint], recommended_k: int) -> str:
    """Markdown the UI shows: one row per k, with a bar for the acceptance length."""
    longest = max(p.acceptance_length for p in curve)
    rows = [
        "| k | acceptance length | | per-position rates | speedup | source |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in curve:
        bar = "#" * round(p.acceptance_length / longest * 20) if longest else ""
        rates = " ".join(f"{r:.2f}" for r in p.rates_per_position)
        speedup = f"{p.speedup:.2f} ({p.speedup_source})" if p.speedup is not None else ""
        mark = " **recommended**" if p.k == recommended_k else ""
        rows.append(f"| {p.k}{mark} | {p.acceptance_length:.3f} | `{bar:<20}` | {rates} | {speedup} | {p.source} |")
    return "\n".join(rows)


def cost_model_note(draft_cost_ratio: float, host_ratio: float | None) -> str:
    host = f"{host_ratio:.2f}" if host_ratio is not None else "not measurable"
    return (
        f"estimated speedup(k) = L(k) / (1 + k * c), c = {draft_cost_ratio:g} (draft_cost_ratio: one draft forward "
        f"relative to one target step on the deployment's GPUs). Measured on the evaluation host: c = {host}; not "
        "used, since the deployment's hardware sets the ratio (on a CPU a tiny draft costs a large share of a tiny "
        "target's step). Acceptance lengths at k below the served one are derived from the per-position rates "
        "(see the curve's source column)."
    )

