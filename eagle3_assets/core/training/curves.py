"""What a training run looks like to a reader: per-epoch means, a text plot of the loss, accuracy by draft position."""

from __future__ import annotations


def render_curve(values: list[float], width: int = 60, height: int = 12) -> str:
    """A text plot of ``values`` (markdown code block): the UI shows it as is, no image needed."""
    if not values:
        return "(no steps)"
    if len(values) > width:  # mean of equal slices
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:]) if b > a]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    rows = [[" "] * len(values) for _ in range(height)]
    for x, v in enumerate(values):
        rows[height - 1 - round((v - low) / span * (height - 1))][x] = "*"
    lines = [f"{high:8.3f} |" + "".join(rows[0])]
    lines += ["         |" + "".join(r) for r in rows[1:-1]]
    lines += [f"{low:8.3f} |" + "".join(rows[-1]), "         +" + "-" * len(values) + " steps"]
    return "```\n" + "\n".join(lines) + "\n```"


def render_accuracy(accuracy: list[float]) -> str:
    """A markdown table of top-1 accuracy by draft position, with a bar per row."""
    rows = ["| draft position | top-1 accuracy | |", "| --- | --- | --- |"]
    rows += [f"| {i + 1} | {a:.3f} | {'#' * round(a * 30)} |" for i, a in enumerate(accuracy)]
    return "\n".join(rows)


def epoch_means(history: list[dict], key: str) -> list:
    """Per epoch, the mean of the step records' ``key``: a number for ``loss``, element-wise for a list (``accuracy``)."""
    by_epoch: dict[int, list] = {}
    for record in history:
        by_epoch.setdefault(record["epoch"], []).append(record[key])
    if key == "loss":
        return [sum(v) / len(v) for _, v in sorted(by_epoch.items())]
    return [[sum(col) / len(col) for col in zip(*v)] for _, v in sorted(by_epoch.items())]


def expected_accepted_tokens(accuracy: list[float]) -> float:
    """Accepted tokens per draft if draft positions were independent: a rough guide, not a measurement."""
    expected, chain = 0.0, 1.0
    for a in accuracy:
        chain *= a
        expected += chain
    return expected
