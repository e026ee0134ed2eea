"""Reading vLLM's Prometheus ``/metrics`` page: health figures and speculative-decoding counters."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        samples.append(Sample(match.group("name"), dict(_LABEL.findall(match.group("labels") or "")), value))
    return samples


def parse_prometheus(text: str) -> dict[str, float]:
    """Each metric summed over its label sets (several engines report one series each)."""
    totals: dict[str, float] = {}
    for sample in parse_samples(text):
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def fetch_metrics_text(base_url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s) as response:
        return response.read().decode(errors="replace")


@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: list[float]

    @classmethod
    def from_metrics(cls, text: str) -> "SpecDecodeCounters":
        samples = parse_samples(text)
        totals = parse_prometheus(text)
        per_pos: dict[int, float] = {}
        for sample in samples:
            if sample.name == ACCEPTED_PER_POS and "position" in sample.labels:
                position = int(sample.labels["position"])
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
        positions = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
        return cls(totals.get(DRAFTS, 0.0), totals.get(DRAFT_TOKENS, 0.0), totals.get(ACCEPTED, 0.0), positions)

    def minus(self, before: "SpecDecodeCounters") -> "SpecDecodeCounters":
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        pad = lambda xs: list(xs) + [0.0] * (width - len(xs))  # noqa: E731
        return SpecDecodeCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [a - b for a, b in zip(pad(self.accepted_per_position), pad(before.accepted_per_position))],
        )

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per target forward pass (1.0 = the draft never helps)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]
