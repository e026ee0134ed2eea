"""Plots as markdown: Dagster's UI renders markdown metadata as is, so no image pipeline is needed."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_histogram(values: Sequence[int], *, label: str, empty: str, bins: int = 12, bar_width: int = 40) -> str:
    """Equal-width bins covering [min, max] as a markdown table of bars."""
    values = [v for v in values if v is not None]
    if not values:
        return empty
    low, high = min(values), max(values)
    width = max(1, -(-(high - low + 1) // bins))  # ceil
    counts = [0] * (((high - low) // width) + 1)
    for v in values:
        counts[(v - low) // width] += 1
    peak = max(counts)
    lines = [f"| {label} | rows | |", "| ---: | ---: | :--- |"]
    for i, count in enumerate(counts):
        start = low + i * width
        bar = "█" * round(bar_width * count / peak) if count else ""
        lines.append(f"| {start}–{start + width - 1} | {count} | {bar} |")
    return "\n".join(lines)
