"""How far the acceptance length can be trusted: each prompt's own figure, their spread, and the mean's uncertainty.

**Where each prompt's figure comes from.** vLLM's ``/metrics`` counters sum over
every request, so around a concurrent pass they give the pass's mean and
nothing per prompt. vLLM (0.32 has it) can also count per request:
started with ``--per-request-spec-decode-metrics``, its scheduler
keeps, for each request, a histogram of the draft tokens accepted at each
verify step (``RequestSpecDecodeMetrics.observe``, called in
``Scheduler.update_from_output`` in the same branch, with the same numbers, as
the step's contribution to the ``/metrics`` counters), and the chat completion
returns it in ``metrics.speculative_decoding`` (``num_spec_steps``,
``num_accepted_draft_tokens``...). So the figure is the server's own count, not
an estimate: it does not depend on the client's speed (a streamed response
counted in tokens per chunk would, since vLLM's ``RequestOutputCollector`` merges
the steps of a client that reads slower than the engine writes), and the sum over a pass's requests equals the
counters' difference around it: the mean of the per-prompt figures weighted by
their drafts *is* the pass's mean acceptance length. The level asked for is
``detailed``: beside the histogram, each response carries its per-step counts
(``per_step_accepted``, ``per_step_drafted``), which place every verify step at
its output position (:mod:`~eagle3_assets.core.evaluation.output_position`); a
few bytes per step, one list entry per step in vLLM.

**What is reported.** Over the prompts with a figure (a prompt whose request
failed, or that ended before a draft, has none): min, p10, median, p90, max and
standard deviation of the per-prompt acceptance lengths, their plain mean, and
the standard error of the pass's mean counted with the prompt as the sampled
unit (the ratio estimator's: sqrt(n / (n - 1) * sum((a_i - R d_i)^2)) / sum(d_i),
R = accepted / drafts over the pass), with the 95 % interval mean +- 1.96 SE.
The interval says how much another draw of as many prompts like these could
move the figure; it assumes the held-out prompts are a sample of the traffic
the draft will meet, which no count can check.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_assets.core.evaluation.output_position import DETAILED_LEVEL, RequestSteps

# vLLM's engine argument (``--per-request-spec-decode-metrics``) and the level asked for: the histogram per request
# and, with ``detailed``, every verify step's counts in order (acceptance by output position).
PER_REQUEST_METRICS_ARG = "per_request_spec_decode_metrics"
PER_REQUEST_METRICS_LEVEL = DETAILED_LEVEL
FROM_RESPONSES = "each request's own spec-decode counts (vLLM per-request metrics, in the response), concurrent pass"
FROM_COUNTERS = "the /metrics counters read around each prompt, one prompt at a time"
UNAVAILABLE = (
    "this host's vLLM returns no per-request spec-decode metrics (--per-request-spec-decode-metrics, in vLLM 0.32): "
    "no spread over the standard set's concurrent pass; naming a set in prompt_sets serves every set, the standard one "
    "included, one prompt at a time, with its spread (about three times the evaluation's time)"
)


@dataclass(frozen=True)
class PromptAcceptance:
    """One request's speculative decoding, as the server counted it."""

    drafts: int  # verify steps that carried a draft (vLLM's num_spec_steps; a /metrics "draft")
    accepted: int  # draft tokens accepted over those steps
    # Each of those steps' accepted and drafted counts, in order: only from a server at the ``detailed`` level.
    per_step_accepted: tuple[int, ...] | None = None
    per_step_drafted: tuple[int, ...] | None = None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts, None without a draft (nothing to judge)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @classmethod
    def from_response(cls, response) -> "PromptAcceptance | None":
        """From a chat completion's ``metrics.speculative_decoding`` (an ``openai`` SDK object or its dict), None
        where the server returned none (started without the per-request metrics, or a vLLM without them)."""
        extra = response if isinstance(response, dict) else (getattr(response, "model_extra", None) or {})
        figures = ((extra.get("metrics") or {}).get("speculative_decoding")) or None
        if not isinstance(figures, dict) or "num_spec_steps" not in figures:
            return None
        steps = figures.get("per_step_accepted"), figures.get("per_step_drafted")
        # vLLM leaves both lists out when empty: a request with no verify step has none at the detailed level either.
        if steps[0] is None and int(figures["num_spec_steps"]) == 0:
            steps = ([], [])
        per_step = tuple(tuple(int(v) for v in values) if values is not None else None for values in steps)
        return cls(int(figures["num_spec_steps"]), int(figures["num_accepted_draft_tokens"]), *per_step)

    def steps(self, completion_tokens: int | None) -> RequestSteps | None:
        """This request's verify steps beside its completion (None: no per-step counts, or the request failed)."""
        if completion_tokens is None or self.per_step_accepted is None or self.per_step_drafted is None:
            return None
        return RequestSteps(completion_tokens, self.per_step_accepted, self.per_step_drafted)


def per_request_metrics_supported() -> bool:
    """Whether this host's vLLM takes ``--per-request-spec-decode-metrics`` (an older one would refuse to start)."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return False
    return any(f.name == PER_REQUEST_METRICS_ARG for f in dataclasses.fields(EngineArgs))


def mean_standard_error(lengths: Sequence[float], drafts: Sequence[int]) -> float | None:
    """Standard error of the drafts-weighted mean acceptance length, prompts as the sampled unit (None below 2)."""
    n = len(lengths)
    total = sum(drafts)
    if n < 2 or not total:
        return None
    accepted = [(length - 1.0) * d for length, d in zip(lengths, drafts)]
    rate = sum(accepted) / total
    return math.sqrt(n / (n - 1) * sum((a - rate * d) ** 2 for a, d in zip(accepted, drafts))) / total


def spread(lengths: Sequence[float | None], drafts: Sequence[int | None] | None = None, source: str = "") -> dict:
    """The per-prompt acceptance lengths' spread (prompts without a figure, None, left out and counted).

    With ``drafts`` (each prompt's, aligned): the drafts-weighted mean (the pass's figure), its standard error and 95 %
    interval.
    """
    kept = [i for i, length in enumerate(lengths) if length is not None]
    if not kept:
        return {"prompts": 0, "prompts_without_figure": len(lengths), "source": source}
    ordered = sorted(lengths[i] for i in kept)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731  the nearest-rank quantile
    described = {
        "prompts": len(ordered), "prompts_without_figure": len(lengths) - len(ordered),
        "min": round(ordered[0], 4), "p10": round(at(0.1), 4), "median": round(statistics.median(ordered), 4),
        "p90": round(at(0.9), 4), "max": round(ordered[-1], 4),
        "stdev": round(statistics.pstdev(ordered), 4), "mean_over_prompts": round(statistics.fmean(ordered), 4),
    }  # fmt: skip
    if drafts is not None:
        weights = [int(drafts[i] or 0) for i in kept]
        values = [lengths[i] for i in kept]
        total = sum(weights)
        mean = 1.0 + sum((v - 1.0) * w for v, w in zip(values, weights)) / total if total else None
        error = mean_standard_error(values, weights)
        described["drafts"] = total
        described["drafts_weighted_mean"] = round(mean, 4) if mean is not None else None
        described["standard_error"] = round(error, 4) if error is not None else None
        described["ci95"] = [round(mean - 1.96 * error, 4), round(mean + 1.96 * error, 4)] if error is not None else None
    if source:
        described["source"] = source
    return described


def render_spread_table(spreads: dict[str, dict]) -> str:
    """Markdown the UI shows: one row per served draft, its per-prompt spread and the mean's 95 % interval."""
    rows = [
        "| draft | prompts | mean (95 % interval) | min / p10 / median / p90 / max | stdev |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, s in spreads.items():
        if not s.get("prompts"):
            rows.append(f"| {label} | 0 | no per-prompt figure | | |")
            continue
        interval = f" ({s['ci95'][0]:.2f} - {s['ci95'][1]:.2f})" if s.get("ci95") else ""
        mean = s.get("drafts_weighted_mean")
        mean_cell = f"{mean:.3f}{interval}" if mean is not None else f"{s['mean_over_prompts']:.3f} (unweighted)"
        quantiles = " / ".join(f"{s[k]:.2f}" for k in ("min", "p10", "median", "p90", "max"))
        missing = f" ({s['prompts_without_figure']} without a figure)" if s.get("prompts_without_figure") else ""
        rows.append(f"| {label} | {s['prompts']}{missing} | {mean_cell} | {quantiles} | {s['stdev']:.3f} |")
    return "\n".join(rows)
