"""Adopt responses made elsewhere as a shard's ``raw_responses`` rows, so that hours of generation are not repeated.

The story's operator already held a finished file of responses (synth_10k:
OpenAI chat rows with the reasoning and the answer) when the platform came;
another instance of the platform may hold the shards of the same prompts.
Either file can seed a shard (how its rows are read: :mod:`.response_files`):

- JSONL, one response a line, in any of the shapes such files take: a row with
  ``messages`` (the prompt, optionally followed by the assistant's turn) and
  the response's ``reasoning`` (vLLM's current field; older files and SGLang
  say ``reasoning_content``) and ``content`` beside them or in that assistant
  turn; or a whole chat completion (``choices[0].message``) under the row or
  its ``response``;
- Parquet: the platform's own ``raw_responses`` shards (its row contract), from
  another instance.

A row is matched to the shard's prompts by its ``id`` and else by the prompt's
content (its turns, whitespace-normalised): ``match`` says which
(``auto``: id first, then content). A row whose id is the shard's but whose
prompt is another question is refused, never matched by id alone.

What is taken goes into the shard's generation journal under the shard's
generation fingerprint, one durable row at a time and only for prompts without
a durable row yet: an interrupted import resumes by id, a rerun takes nothing
twice, and generated rows are never replaced. The generation run that follows
treats adopted rows exactly as its own (:func:`.shard_resume.plan_resend`): the
rules validation applies (:mod:`.response_rules`: empty reasoning, empty
answer, a cut generation) decide, and only the rows they reject, plus the
prompts the file has no usable row for, are sent to the server.

Adopted rows are marked: ``server`` is ``import:<file name>``, ``attempts`` 0
(the platform never sent them), and the server's token ids are null unless the
file is the platform's own Parquet that carries them; ``validated_traces``
then builds every trace's ids with the target's tokenizer (re-tokenised), as
for any row without server ids. Each shard records its import in
``<shard>.import.json`` beside its Parquet: the source, its SHA-256, the rows
taken (by id, by content), the rows refused with their reason, and what the
gates will send again. Dagster-free.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.generation.completions import Sample
from eagle3_assets.core.generation.response_files import (
    AdoptionError,
    RowRefused,
    adopted_row,
    finish_reason_of,
    format_of,
    prompt_key,
    prompt_messages,
    source_rows,
)
from eagle3_assets.core.generation.response_rules import content_failures
from eagle3_assets.core.storage.files import file_hash, write_json_atomic
from eagle3_assets.core.storage.journal import ShardJournal, parquet_fingerprint
from eagle3_assets.core.storage.shard_paths import IMPORT_SUFFIX, PARQUET_SUFFIX

MATCH_MODES = ("auto", "id", "content")
MAX_EXAMPLES = 20
RETOKENISED = "re-tokenised: the file carries no token ids; validated_traces builds them with the target's tokenizer"
SERVER_IDS = "the other instance's server ids, kept and checked by validated_traces against the target's tokenizer"

# Why a row of the file is not taken (a reason code and what it means).
REFUSALS: dict[str, str] = {
    "not_json": "the line is not a JSON object",
    "prompt_differs": "the row's id is a prompt of this shard but its prompt is another question",
    "no_response": "neither reasoning nor an answer (content) in the row",
    "malformed_response": "the response's fields have the wrong types or shape",
    "request_error": "the row records a failed request, not a response",
    "duplicate": "another row of the file was already taken for this prompt",
}


@dataclass
class AdoptionReport:
    """What one import into one shard did; ``record()`` is what ``<shard>.import.json`` holds."""

    source: str
    source_sha256: str
    source_format: str
    match: str
    rows_in_file: int = 0
    taken_by: Counter = field(default_factory=Counter)  # "id" | "content" -> rows taken this way
    already_durable: int = 0  # matched rows of prompts that had a durable row: left as they are
    refused: Counter = field(default_factory=Counter)  # reason -> rows
    refused_examples: list[dict[str, str]] = field(default_factory=list)
    rows_of_other_prompts: int = 0  # rows of prompts not in this shard (other shards', or none)
    to_send_again: Counter = field(default_factory=Counter)  # taken rows the content rules reject, by reason
    finish_reason_assumed: int = 0  # rows without finish_reason taken as "stop" (their answer is complete)
    token_ids: str = RETOKENISED
    shard_finished: bool = False  # the shard already had its finished Parquet: nothing was imported

    @property
    def rows_taken(self) -> int:
        return sum(self.taken_by.values())

    def refuse(self, reason: str, where: str, detail: str = "") -> None:
        self.refused[reason] += 1
        if len(self.refused_examples) < MAX_EXAMPLES:
            self.refused_examples.append({"row": where, "reason": reason, "detail": detail[:200] or REFUSALS[reason]})

    def record(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_sha256": self.source_sha256,
            "source_format": self.source_format,
            "match": self.match,
            "rows_in_file": self.rows_in_file,
            "rows_taken": self.rows_taken,
            "rows_taken_by": dict(self.taken_by),
            "rows_already_durable": self.already_durable,
            "rows_refused": sum(self.refused.values()),
            "rows_refused_by_reason": dict(self.refused),
            "refused_examples": self.refused_examples,
            "rows_of_other_prompts": self.rows_of_other_prompts,
            "taken_rows_to_send_again": dict(self.to_send_again),
            "finish_reason_assumed_stop": self.finish_reason_assumed,
            "token_ids": self.token_ids,
            "shard_finished_before": self.shard_finished,
        }

    def line(self) -> str:
        text = (
            f"adopted {self.rows_taken} rows from {Path(self.source).name} (sha256 {self.source_sha256[:12]}; "
            f"{dict(self.taken_by)}), {sum(self.refused.values())} refused {dict(self.refused)}, "
            f"{self.already_durable} already durable, {self.rows_of_other_prompts} rows of other prompts"
        )
        if self.to_send_again:
            text += f"; sent again as the gates reject them: {dict(self.to_send_again)}"
        return text


def import_record_path(parquet_path: Path) -> Path:
    """``<shard>.import.json`` beside the shard's Parquet (``ShardPaths.import_record``)."""
    return Path(parquet_path).with_name(Path(parquet_path).name.removesuffix(PARQUET_SUFFIX) + IMPORT_SUFFIX)


def read_import_record(parquet_path: Path) -> dict[str, Any] | None:
    """The shard's import record (every file adopted into it, by SHA-256), or None when nothing was ever adopted."""
    path = import_record_path(parquet_path)
    return json.loads(path.read_text()) if path.is_file() else None


def adopt_responses(
    source: Path | str,
    samples: Sequence[Sample],
    journal_path: Path,
    parquet_path: Path,
    fingerprint: str,
    *,
    match: str = "auto",
    allow_truncated: bool = False,
    log: Callable[[str], None] = print,
) -> AdoptionReport:
    """Put the rows of ``source`` that answer the shard's prompts into its journal; record and return what happened.

    ``fingerprint`` is the shard's generation fingerprint
    (:func:`.shard_resume.generation_fingerprint`): the journal the generation
    run resumes from. A shard whose finished Parquet has this fingerprint is
    left alone (it has a row per prompt already).
    """
    if match not in MATCH_MODES:
        raise AdoptionError(f"adopting responses: match {match!r} is not one of {MATCH_MODES}")
    path = Path(source).expanduser()
    if not path.is_file():
        raise AdoptionError(f"adopting responses: {path} does not exist or is not a file")
    report = AdoptionReport(str(path), file_hash(path, length=64), format_of(path), match)
    if parquet_fingerprint(parquet_path) == fingerprint:
        report.shard_finished = True
        log(f"{Path(parquet_path).name} is finished with these prompts and settings: nothing adopted from {path.name}")
        return report

    journal = ShardJournal(Path(journal_path), fingerprint)
    durable = journal.load()
    if journal.set_aside:
        log(f"journal {Path(journal_path).name} was written for other prompts or sampling; moved aside to {journal.set_aside.name}")
    taken = _match_rows(path, report, samples, durable)
    report.to_send_again.update(Counter(content_failures(taken, allow_truncated).values()))
    journal.open()
    try:
        for row in taken:  # each row durable on its own: a killed import resumes by id
            journal.append(row)
    finally:
        journal.close()
    _write_record(parquet_path, report)
    log(report.line())
    return report


def _match_rows(path: Path, report: AdoptionReport, samples: Sequence[Sample], durable: Mapping[str, Any]) -> list[dict[str, Any]]:
    by_id = {s.id: s for s in samples}
    by_content = {}
    for sample in samples:
        by_content.setdefault(prompt_key(sample.messages), sample)
    taken: dict[str, dict[str, Any]] = {}
    for where, row, problem in source_rows(path, report.source_format):
        report.rows_in_file += 1
        if problem is not None:
            report.refuse("not_json", where, problem)
            continue
        prompt = prompt_messages(row)
        sample, how = None, None
        row_id = row.get("id")
        if report.match in ("auto", "id") and isinstance(row_id, (str, int)) and str(row_id) in by_id:
            sample, how = by_id[str(row_id)], "id"
            if prompt is not None and prompt_key(prompt) != prompt_key(sample.messages):
                report.refuse("prompt_differs", where, f"id {row_id}: the file's question is not the shard's")
                continue
        elif report.match in ("auto", "content") and prompt is not None:
            sample, how = by_content.get(prompt_key(prompt)), "content"
        if sample is None:
            report.rows_of_other_prompts += 1
            continue
        if sample.id in durable:
            report.already_durable += 1
            continue
        if sample.id in taken:
            report.refuse("duplicate", where, f"prompt {sample.id} already taken from an earlier row")
            continue
        try:
            adopted = adopted_row(row, sample.id, path.name, report.source_format)
        except RowRefused as refused:
            report.refuse(refused.reason, where, refused.detail)
            continue
        if row.get("finish_reason") is None and finish_reason_of(row) is None:
            report.finish_reason_assumed += 1
        if adopted["output_token_ids"] is not None:
            report.token_ids = SERVER_IDS
        taken[sample.id] = adopted
        report.taken_by[how] += 1
    return list(taken.values())


def _write_record(parquet_path: Path, report: AdoptionReport) -> None:
    """Add this import to the shard's record: per source hash, the rows taken add up over resumed imports."""
    existing = read_import_record(parquet_path) or {"imports": {}}
    earlier = existing["imports"].get(report.source_sha256)
    entry = report.record()
    if earlier is not None:
        entry["rows_taken_by"] = dict(Counter(earlier.get("rows_taken_by", {})) + report.taken_by)
        entry["rows_taken"] = sum(entry["rows_taken_by"].values())
    entry["imported_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    existing["imports"][report.source_sha256] = entry
    write_json_atomic(import_record_path(parquet_path), existing)


def lineage(parquet_path: Path) -> dict[str, Any]:
    """What a shard's data version takes from its imports: the hashes of the files adopted into it ({} when none)."""
    record = read_import_record(parquet_path)
    taken = sorted(h for h, entry in (record or {}).get("imports", {}).items() if entry.get("rows_taken"))
    return {"adopted_from": taken} if taken else {}
