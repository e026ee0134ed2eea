"""Acceptance by output position: how the draft does 500 tokens into a trace against 5,000 tokens into it.

**Where the steps come from.** vLLM (0.32) started with
``--per-request-spec-decode-metrics detailed`` returns, in each chat completion's
``metrics.speculative_decoding``, ``per_step_accepted`` and ``per_step_drafted``:
one entry per verify step that carried drafts, in order, appended by
``RequestSpecDecodeMetrics.observe`` in ``Scheduler.update_from_output`` with the
same numbers as that step's contribution to the ``/metrics`` counters (one
``num_drafts``, ``accepted`` to ``num_accepted_tokens``). Only for ``n == 1``, and
only for steps that scheduled drafts.

**How positions line up** (read from the same scheduler code). A step samples
``accepted + 1`` tokens (the accepted drafts and the target's own next token).
The prefill step samples output token 0 and carries no draft (drafts are proposed
after a step, for the next one), so verify step ``i`` starts at output position
``1 + sum(accepted_j + 1 for j < i)``. A step is placed by that start: the position
at which its drafts were proposed, i.e. how much of its own output the draft had
to condition on. A step that starts at 510 and samples 4 tokens counts for 0-512.

**The check that the steps add up.** The scheduler appends a step's tokens one by
one and stops at the first stop condition (EOS, ``max_tokens``), dropping the
rest of that step, so only the last step can come short. A request's steps add up
when its ``completion_tokens`` lies in ``[P + 1, P + accepted_last + 1]``, ``P``
the start of the last step: token 0 plus every earlier step whole, plus 1 to all
of the last. More tokens mean steps without drafts after the prefill (the
scheduler gave the request no draft that step: a token budget, the model's length
limit), which the lists do not show, so the later steps' positions would be
wrong; fewer mean the lists and the completion disagree. Such a request is left
out of the buckets and counted: the report gives the share of requests that agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Output-position buckets, tokens [low, high): the user's traces run to 8,192 tokens, about 4,000 on average.
OUTPUT_POSITION_BUCKETS: tuple[tuple[int, int], ...] = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192))

DETAILED_LEVEL = "detailed"  # the --per-request-spec-decode-metrics level that returns the per-step lists

NOT_DETAILED = (
    "the responses carry no per-step counts (vLLM's --per-request-spec-decode-metrics detailed, in vLLM 0.32): "
    "no acceptance by output position"
)
POSITION_NOTE = (
    "each verify step placed by the output position where its drafts were proposed (token 0 comes from the prefill, "
    "then each step adds accepted + 1), from each request's own per-step counts (vLLM --per-request-spec-decode-metrics "
    "detailed); mean acceptance length per bucket = 1 + accepted / steps; decay = the last filled bucket over the first"
)


def bucket_name(low: int, high: int) -> str:
    return f"{low:,}-{high:,}"


@dataclass(frozen=True)
class RequestSteps:
    """One request's verify steps as vLLM counted them, and how many tokens it returned."""

    completion_tokens: int
    accepted: tuple[int, ...]  # draft tokens accepted at each verify step, in order
    drafted: tuple[int, ...]  # draft tokens proposed at each verify step (k, or fewer where the scheduler trimmed)

    def __post_init__(self):
        if len(self.accepted) != len(self.drafted):
            raise ValueError(f"per-step counts of unequal length: {len(self.accepted)} accepted, {len(self.drafted)} drafted")
        if any(a < 0 or a > d for a, d in zip(self.accepted, self.drafted)):
            raise ValueError("a step accepted more draft tokens than it drafted, or fewer than 0")

    def starts(self) -> list[int]:
        """Each verify step's first output position: 1 (token 0 is the prefill's) plus every earlier step whole."""
        position, starts = 1, []
        for accepted in self.accepted:
            starts.append(position)
            position += accepted + 1
        return starts

    def adds_up(self) -> bool:
        """Whether the steps account for the completion: every step whole except the last, which a stop may cut."""
        if not self.accepted:
            return self.completion_tokens <= 1  # the prefill's one token at most, or none (the request ended before it)
        last_start = self.starts()[-1]
        return last_start + 1 <= self.completion_tokens <= last_start + self.accepted[-1] + 1


def by_output_position(requests: Iterable[RequestSteps | None], buckets: Sequence[tuple[int, int]] = OUTPUT_POSITION_BUCKETS) -> dict:
    """Steps, accepted tokens and mean acceptance length per output-position bucket, over the requests whose steps add
    up (None: a request with no per-step counts, failed or from a server without them), and the decay ratio."""
    counted = [r for r in requests if r is not None]
    agreeing = [r for r in counted if r.adds_up()]
    rows = [{"bucket": bucket_name(low, high), "low": low, "high": high, "steps": 0, "accepted": 0, "drafted": 0, "requests": 0} for low, high in buckets]
    beyond = 0  # steps that start at or past the last bucket's end (max_tokens above it)
    for request in agreeing:
        touched = set()
        for start, accepted, drafted in zip(request.starts(), request.accepted, request.drafted):
            index = next((i for i, (low, high) in enumerate(buckets) if low <= start < high), None)
            if index is None:
                beyond += 1
                continue
            row = rows[index]
            row["steps"] += 1
            row["accepted"] += accepted
            row["drafted"] += drafted
            touched.add(index)
        for index in touched:
            rows[index]["requests"] += 1
    for row in rows:
        row["mean_acceptance_length"] = round(1.0 + row["accepted"] / row["steps"], 4) if row["steps"] else None
    filled = [row for row in rows if row["steps"]]
    described = {
        "buckets": rows,
        "requests": len(counted),
        "requests_adding_up": len(agreeing),
        "share_adding_up": round(len(agreeing) / len(counted), 4) if counted else None,
        "steps": sum(row["steps"] for row in rows),
        "steps_beyond_buckets": beyond,
    }
    if len(filled) >= 2:
        first, last = filled[0], filled[-1]
        described["decay_ratio"] = round(last["mean_acceptance_length"] / first["mean_acceptance_length"], 4)
        described["decay_over"] = f"{last['bucket']} over {first['bucket']}"
    else:
        described["decay_ratio"] = None
        described["decay_over"] = f"only {filled[0]['bucket']} filled" if filled else "no bucket filled"
    return described


def render_position_table(by_label: dict[str, dict | None]) -> str:
    """Markdown the UI shows: per output-position bucket, each served draft's steps and mean acceptance length, the
    decay ratio, and how many requests' steps added up to their completion."""
    labels = list(by_label)
    header = "| output position (tokens) | " + " | ".join(f"{label} steps | {label} acceptance length" for label in labels) + " |"
    rows = [header, "| --- |" + " --- | --- |" * len(labels)]
    reference = next((d for d in by_label.values() if d), None)
    for index, bucket in enumerate((reference or {}).get("buckets", [])):
        cells = []
        for label in labels:
            row = (by_label[label] or {}).get("buckets", [{}] * (index + 1))[index]
            mean = row.get("mean_acceptance_length")
            cells.append(f"{row.get('steps', 0)} | {mean:.3f}" if mean is not None else f"{row.get('steps', 0)} | empty")
        rows.append(f"| {bucket['bucket']} | " + " | ".join(cells) + " |")
    decay = [
        f"{d['decay_ratio']:.3f} ({d['decay_over']})" if d and d.get("decay_ratio") is not None else (d or {}).get("decay_over", "no figure")
        for d in by_label.values()
    ]
    # The summary rows put their figure under each draft's acceptance-length column, its steps column left blank.
    rows.append("| decay (last filled / first) | " + " | ".join(f" | {cell}" for cell in decay) + " |")
    rows.append("| requests whose steps add up | " + " | ".join(f" | {adding_up(d)}" for d in by_label.values()) + " |")
    return "\n".join(rows)


def adding_up(described: dict | None) -> str:
    """'32 of 32', or why there is no figure."""
    if not described or not described.get("requests"):
        return "no per-step counts"
    return f"{described['requests_adding_up']} of {described['requests']}"
