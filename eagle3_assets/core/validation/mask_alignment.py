"""The alignment gate's reading: the written traces checked, token by token, against their raw rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from eagle3_assets.core.validation.chat_rendering import ChatRenderer
from eagle3_assets.core.validation.trace_files import rows_in_batches, scan_raw_responses


@dataclass(frozen=True)
class MaskAlignment:
    """What the alignment gate found in the written traces."""

    rows_checked: int
    rows_checked_against_server_ids: int  # of which compared token by token with the raw row's output_token_ids
    problems: dict[str, str]  # id -> why its mask or ids are wrong


def mask_alignment_problems(kept_path: Path, raw_path: Path, renderer: ChatRenderer, batch_rows: int = 128) -> MaskAlignment:
    """Re-read the written traces and the raw file in batches; return what is misaligned.

    Reads what is on disk, not what the pass meant to write. Each trace is
    checked against its own raw row: its finish reason says whether an
    end-of-turn token belongs to the completion (a trace with no finished raw
    row must not end with one); the supervised tokens must decode to the
    completion rebuilt from the text fields; and where the raw row carries the
    server's ids, the supervised ids must equal ``output_token_ids`` and the
    ids before them ``prompt_token_ids``, token by token.

    Both files are streamed side by side: the traces were written in the raw
    file's order (kept rows are a subsequence of it), so each trace's raw row
    is found by reading on, and no more than a batch of either file's token
    ids is held at once. A trace with no raw row further on is a problem.
    """
    raw_rows = rows_in_batches(
        scan_raw_responses(raw_path).select("id", "finish_reason", "prompt_token_ids", "output_token_ids"), batch_rows
    )
    traces = pl.scan_parquet(kept_path).select("id", "messages", "reasoning", "content", "input_ids", "loss_mask")
    checked, against_server, problems = 0, 0, {}
    for row in rows_in_batches(traces, batch_rows):
        checked += 1
        raw = next((r for r in raw_rows if r["id"] == row["id"]), None)
        if raw is None:
            problems[row["id"]] = (
                "no raw row with this id after the previous trace's (the traces are not in the raw file's order, "
                "or the id is not in it)"
            )
            continue
        ids, mask = row["input_ids"] or [], row["loss_mask"] or []
        found = [
            renderer.supervised_text_problem(
                ids, mask, row["messages"] or [], row["reasoning"] or "", row["content"] or "", finished=raw["finish_reason"] == "stop"
            )
        ]
        if raw["output_token_ids"] is not None and len(ids) == len(mask):
            against_server += 1
            supervised = [i for i, m in zip(ids, mask) if m]
            unsupervised_head = ids[: mask.index(1)] if 1 in mask else ids
            if difference := renderer.token_difference(supervised, raw["output_token_ids"], "supervised"):
                found.append(f"supervised ids differ from the server's output_token_ids at {difference}")
            if raw["prompt_token_ids"] is not None and (
                difference := renderer.token_difference(unsupervised_head, raw["prompt_token_ids"], "prompt")
            ):
                found.append(f"ids before supervision differ from the server's prompt_token_ids at {difference}")
        if problem := "; ".join(f for f in found if f):
            problems[row["id"]] = problem
    return MaskAlignment(checked, against_server, problems)

