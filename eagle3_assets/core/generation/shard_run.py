"""Regenerate reasoning traces through an OpenAI-compatible server (vLLM, SGLang), fast and resumably.

The requests go through :mod:`.generation_client` (why an aiohttp client and
not the ``openai`` SDK is told there), what they send is a
:class:`.generation_config.GenerationConfig`, and what a response becomes is
:mod:`.completions`; this module runs shards over them: one, or the shards of
a run under ONE in-flight budget (:func:`generate_shards`), so that a run over a
range of shards keeps the server's batch full across shard boundaries.

What the client gets right, because the story this project comes from got it wrong:

- one read timeout long enough for a whole generation (default 1,800 s), apart
  from a short connect timeout; a request that times out reading is *not*
  re-sent (re-sending slow requests makes retry storms);
- retries with exponential backoff and jitter on connection errors, 408, 429
  and 5xx only; a 400 (a bad request stays bad) is recorded, never retried;
- the reasoning is read from ``message.reasoning`` (vLLM since late 2025) and
  else from ``message.reasoning_content`` (older vLLM, SGLang), and every row
  records which field carried it;
- a pre-flight (``/health``, ``/v1/models``, one canary request that must come
  back with reasoning) runs before the first sample is sent, so a server without
  a reasoning parser fails the run at once instead of after 10,000 requests;
- every finished row goes to the shard's journal (:mod:`.journal`) as it
  arrives; a rerun sends only the ids not yet durable, the rows that ended in an
  error, and the rows whose response validation would reject for a reason a new
  generation can fix (:mod:`.response_rules`: empty reasoning, empty answer, a
  cut or aborted generation), up to ``max_attempts_per_sample`` requests per
  sample over its whole life. A content failure is *not* re-sent within the run
  that got it: when the server itself is at fault (no reasoning parser), instant
  retries would only spend the sample's attempts before anyone can fix it;
- a finished shard is never overwritten by a generation with other settings:
  it is kept under ``superseded/`` (:func:`.journal.keep_superseded`), and
  reused if the settings come back;
- credentials in a server URL are used for requests and shown nowhere
  (:mod:`.redaction`): rows, logs and errors name the server without them;
- the token ids the server saw and generated are asked for (vLLM's
  ``return_token_ids``) and kept beside the text (``prompt_token_ids``,
  ``output_token_ids``), so that validation can check the supervised tokens
  against what the target really produced, not only against a re-tokenisation
  of the parser's text fields. Asking for them changes no response, so it is no
  part of a shard's identity.

Nothing here imports Dagster: the asset (``eagle3_assets/raw_responses.py``)
is a thin wrapper, and the benchmark drives this module directly.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.generation.completions import ROW_SCHEMA, Sample, prompt_tokens_upper_bound
from eagle3_assets.core.generation.client import (
    DEFAULT_CANARY_MAX_TOKENS,
    DEFAULT_CANARY_PROMPT,
    CanaryClient,
    AttemptTally,
    GenerationClient,
    PreflightReport,
)
from eagle3_assets.core.generation.config import GenerationConfig
from eagle3_assets.core.storage.journal import JournalCorruptError, ShardJournal, keep_superseded, parquet_fingerprint, parquet_generation
from eagle3_assets.core.generation.response_rules import PROMPT_TOO_LONG, content_failures
from eagle3_assets.core.storage.shard_paths import superseded_path
from eagle3_assets.core.storage.files import stable_hash

DEFAULT_PROGRESS_INTERVAL_S = 5.0


class ServerUnavailableError(RuntimeError):
    """Too many samples in a row failed after all retries; the run stops, the journal keeps what is done."""


# ------------------------------------------------------------------ a shard
@dataclass
class Progress:
    """What the run log shows every few seconds."""

    done: int
    total: int
    errors: int
    output_tokens_per_s: float
    elapsed_s: float
    eta_s: float | None
    shards_done: int = 0
    shards: int = 1

    def line(self) -> str:
        eta = "?" if self.eta_s is None else _duration(self.eta_s)
        share = self.done / self.total if self.total else 1.0
        of_shards = f", {self.shards_done}/{self.shards} shards durable" if self.shards > 1 else ""
        return (
            f"{self.done}/{self.total} rows ({share:.0%}){of_shards}, {self.errors} errors, "
            f"{self.output_tokens_per_s:,.0f} output tok/s, elapsed {_duration(self.elapsed_s)}, ETA {eta}"
        )


@dataclass
class ShardOutcome:
    frame: pl.DataFrame  # the shard's rows, as written to Parquet
    preflight: PreflightReport
    reused: int  # rows already durable (journal or earlier Parquet), good, and not sent again
    sent: int  # samples this run sent (or settled without a request)
    wall_s: float  # of the generation, pre-flight excluded
    output_tokens: int  # completion tokens generated by this run
    set_aside: Path | None  # a journal of other inputs, moved aside
    failed_attempts_by_server: dict[str, int] = field(default_factory=dict)  # retryable failures, per server (shown names)
    failovers: int = 0  # retries sent to another server than the attempt that failed
    resent: dict[str, int] = field(default_factory=dict)  # durable rows sent again, by why: error kinds, content failures
    attempts_exhausted: list[str] = field(default_factory=list)  # content failures kept: max_attempts_per_sample reached
    superseded: Path | None = None  # the finished shard of other settings this run moved aside (kept, not deleted)
    reused_from: Path | None = None  # an earlier finished file of these very settings that seeded this run

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def generation_fingerprint(samples: Sequence[Sample], config: GenerationConfig) -> str:
    """What a shard's rows are made of: the prompts themselves and the generation identity.

    A journal or Parquet file with another fingerprint is never resumed from.
    """
    return stable_hash({"prompts": [[s.id, s.messages] for s in samples], "generation": config.identity()})


@dataclass(frozen=True)
class ShardJob:
    """One shard of a run: its samples and where its journal and Parquet file go."""

    key: str
    samples: Sequence[Sample]
    journal_path: Path
    parquet_path: Path


@dataclass
class RunOutcome:
    """What a run over several shards ended with: each durable shard's outcome, and why the others stopped."""

    preflight: PreflightReport
    finished: dict[str, ShardOutcome]  # shard -> its outcome, in the order the shards became durable
    stopped: dict[str, BaseException]  # shard -> why it is not durable (its journal keeps what is done)


# Called as each shard becomes durable, from one reporting thread (in the order the shards became durable),
# while the other shards generate on.
ShardDone = Callable[[str, ShardOutcome], None]


def generate_shard(
    config: GenerationConfig,
    samples: Sequence[Sample],
    journal_path: Path,
    parquet_path: Path,
    *,
    log: Callable[[str], None] = print,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    canary_prompt: str = DEFAULT_CANARY_PROMPT,
    canary_max_tokens: int = DEFAULT_CANARY_MAX_TOKENS,
    canary_client: CanaryClient | None = None,
) -> ShardOutcome:
    """Pre-flight, then generate every sample of a shard not yet durable, then write the shard's Parquet.

    Raises PreflightError before anything is written when the server is unfit,
    and ServerUnavailableError (journal kept) when the server goes away mid-shard.
    """
    job = ShardJob(Path(parquet_path).name.split(".")[0], samples, Path(journal_path), Path(parquet_path))
    outcome = generate_shards(
        config, [job], log=log, progress_interval_s=progress_interval_s,
        canary_prompt=canary_prompt, canary_max_tokens=canary_max_tokens, canary_client=canary_client,
    )  # fmt: skip
    if job.key in outcome.stopped:
        raise outcome.stopped[job.key]
    return outcome.finished[job.key]


def generate_shards(
    config: GenerationConfig,
    jobs: Sequence[ShardJob],
    *,
    on_shard_done: ShardDone | None = None,
    log: Callable[[str], None] = print,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    canary_prompt: str = DEFAULT_CANARY_PROMPT,
    canary_max_tokens: int = DEFAULT_CANARY_MAX_TOKENS,
    canary_client: CanaryClient | None = None,
) -> RunOutcome:
    """Pre-flight once, then generate the shards of ``jobs`` under ONE in-flight budget of ``config.concurrency``.

    The samples of every shard form one queue, in shard order: when the last
    samples of a shard are in flight (its long traces), the free places already
    go to the next shard's samples, so the server keeps ``concurrency`` requests
    in flight across shard boundaries instead of draining at the end of each
    shard. Each shard keeps its own journal and Parquet file; as soon as its
    last row is durable its Parquet is written and ``on_shard_done`` is called,
    while the others go on. A shard that cannot start (bad samples, a journal of
    another writer) or that the server left unfinished is in ``stopped``; its
    journal keeps what is done and a rerun resumes it. Raises PreflightError
    before anything is written when the server is unfit.
    """
    keys = [job.key for job in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a shard occurs more than once in the run: {sorted(k for k, n in Counter(keys).items() if n > 1)}")
    return asyncio.run(
        _generate_shards(
            config, list(jobs), on_shard_done, log, progress_interval_s, canary_prompt, canary_max_tokens, canary_client
        )
    )


async def _generate_shards(
    config: GenerationConfig,
    jobs: list[ShardJob],
    on_shard_done: ShardDone | None,
    log: Callable[[str], None],
    progress_interval_s: float,
    canary_prompt: str,
    canary_max_tokens: int,
    canary_client: CanaryClient | None,
) -> RunOutcome:
    async with GenerationClient(config, log=log) as client:
        report = await client.preflight(canary_prompt, canary_max_tokens, canary_client)
        log(
            f"pre-flight ok: {', '.join(report.servers)} serve {config.model!r} (max_model_len {report.max_model_len}); "
            f"canary reasoning in message.{report.canary_reasoning_field}"
        )
        outcome = RunOutcome(report, {}, {})
        shards: list[_OpenShard] = []
        try:
            for job in jobs:
                try:
                    shards.append(_OpenShard.open(job, config, log))
                except (ValueError, JournalCorruptError) as exc:  # this shard's inputs or files: the others go on
                    log(f"{job.key}: not generated: {exc}")
                    outcome.stopped[job.key] = exc
            run = _RangeRun(client, shards, report, config, log, on_shard_done, outcome)
            await run.execute(progress_interval_s)
        finally:
            for shard in shards:
                shard.journal.close()  # everything finished is durable, also when the run fails
        if run.abort:
            stopped = ServerUnavailableError(run.abort)
            for shard in shards:
                if shard.job.key not in outcome.finished:
                    outcome.stopped[shard.job.key] = stopped
    return outcome


SUPERSEDED_NOTE = "superseded/<shard>.<fingerprint>.parquet (nothing is deleted)"


@dataclass
class _ResendPlan:
    """What a run of a shard sends, given the rows already durable."""

    pending: list[Sample]
    reused: int  # durable rows kept as they are, good ones
    reasons: Counter[str]  # why durable rows are sent again: "error: <kind>" or a content-failure reason
    exhausted: list[str]  # content failures kept as they are: the sample used its attempts

    def line(self, total: int, max_attempts: int) -> str:
        text = f"resuming: {self.reused} of {total} rows already durable and usable; {len(self.pending)} to send"
        if self.reasons:
            text += f" (sent again: {dict(sorted(self.reasons.items()))})"
        if self.exhausted:
            text += (
                f"; {len(self.exhausted)} rows kept as they are after {max_attempts} attempts each (e.g. {self.exhausted[:3]}): "
                "raise vllm_server.max_attempts_per_sample to send them again"
            )
        return text


def _plan_resend(samples: Sequence[Sample], rows: Mapping[str, Mapping[str, Any]], config: GenerationConfig) -> _ResendPlan:
    """Which samples to send: those without a row, error rows, and content failures with attempts left."""
    failures = content_failures((rows[s.id] for s in samples if s.id in rows), config.allow_truncated)
    plan = _ResendPlan(pending=[], reused=0, reasons=Counter(), exhausted=[])
    for sample in samples:
        row = rows.get(sample.id)
        if row is None:
            plan.pending.append(sample)
        elif row.get("error") is not None:
            plan.pending.append(sample)
            plan.reasons[f"error: {str(row['error']).split(':', 1)[0]}"] += 1
        elif sample.id in failures:
            if (row.get("attempts") or 0) < config.max_attempts_per_sample:
                plan.pending.append(sample)
                plan.reasons[failures[sample.id]] += 1
            else:
                plan.exhausted.append(sample.id)
        else:
            plan.reused += 1
    return plan


def _settings_change(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    """What differs between two generation settings, for the log: ``temperature 0.7 -> 0.71``."""
    if old is None:
        return "settings not recorded in the file"
    keys = sorted(set(old) | set(new), key=str)
    changes = [f"{k} {old.get(k, 'unset')} -> {new.get(k, 'unset')}" for k in keys if old.get(k) != new.get(k)]
    return ", ".join(changes) or "same settings, other prompts"


class _OpenShard:
    """One shard while a run generates it: its journal open, its rows, what it still has to send, its counters."""

    def __init__(self, job: ShardJob, fingerprint: str, journal: ShardJournal, rows, plan: _ResendPlan, reused_from: Path | None):
        self.job, self.fingerprint, self.journal, self.rows, self.plan = job, fingerprint, journal, rows, plan
        self.reused_from = reused_from
        self.left = len(plan.pending)  # samples not answered yet
        self.finished = self.errors = self.output_tokens = 0
        self.tally = AttemptTally()
        self.started: float | None = None  # when its first sample was sent

    @classmethod
    def open(cls, job: ShardJob, config: GenerationConfig, log: Callable[[str], None]) -> _OpenShard:
        """Read what the shard already has (journal, finished Parquet, a kept generation), plan what to send, open its journal."""
        key, samples, journal_path, parquet_path = job.key, job.samples, job.journal_path, job.parquet_path
        ids = [s.id for s in samples]
        duplicated = [i for i, n in Counter(ids).items() if n > 1]
        if duplicated:
            raise ValueError(f"{len(duplicated)} sample ids occur more than once in the shard (first: {duplicated[:5]}); ids must be unique")
        fingerprint = generation_fingerprint(samples, config)
        journal = ShardJournal(journal_path, fingerprint)
        rows = journal.load()
        if journal.set_aside:
            log(f"{key}: journal {journal_path.name} was written for other prompts or sampling; moved aside to {journal.set_aside.name}")
        seed: list[dict[str, Any]] = []
        reused_from = None
        finished_fingerprint = parquet_fingerprint(parquet_path)
        if finished_fingerprint not in (None, fingerprint):
            log(
                f"{key}: {parquet_path.name} was generated with other settings ({_settings_change(parquet_generation(parquet_path), config.settings())}); "
                f"it stays in place until this run finishes, then is kept as {SUPERSEDED_NOTE}"
            )
        if not rows:
            # Re-materialising a finished shard with unchanged inputs (or inputs that come back to those of a
            # kept one): every row is seeded into the journal, so the attempts of rows sent again count on.
            kept = superseded_path(parquet_path, fingerprint)
            source = parquet_path if finished_fingerprint == fingerprint else (kept if kept.is_file() else None)
            if source is not None:
                seed = pl.read_parquet(source).to_dicts()
                rows = {r["id"]: r for r in seed}
                if source == kept:
                    reused_from = kept
                    log(f"{key}: reusing {kept.parent.name}/{kept.name}: generated earlier with these very prompts and settings")
        plan = _plan_resend(samples, rows, config)
        if rows:
            log(f"{key}: {plan.line(len(samples), config.max_attempts_per_sample)}")
        journal.open(seed)
        return cls(job, fingerprint, journal, rows, plan, reused_from)

    def finish(self, config: GenerationConfig, report: PreflightReport, wall_s: float, log: Callable[[str], None]) -> ShardOutcome:
        """Every row durable: keep an earlier generation of other settings, write the Parquet file, drop the journal."""
        self.journal.close()
        parquet_path = self.job.parquet_path
        superseded = keep_superseded(parquet_path, self.fingerprint, config.settings())
        if superseded is not None:
            log(
                f"{self.job.key}: kept the earlier generation of this shard (other settings) as {superseded.parent.name}/{superseded.name}, "
                f"with its settings in {superseded.with_suffix('.json').name}"
            )
        frame = self.journal.finalize(parquet_path, [s.id for s in self.job.samples], self.rows, ROW_SCHEMA, generation=config.settings())
        return ShardOutcome(
            frame, report, self.plan.reused, len(self.plan.pending), wall_s, self.output_tokens, self.journal.set_aside,
            dict(self.tally.failed_attempts), self.tally.failovers, resent=dict(self.plan.reasons),
            attempts_exhausted=self.plan.exhausted, superseded=superseded, reused_from=self.reused_from,
        )  # fmt: skip


class _RangeRun:
    """``concurrency`` workers over one queue of every shard's pending samples; a shard is finished as its last row lands."""

    def __init__(self, client, shards, report, config, log, on_shard_done, outcome):
        self.client: GenerationClient = client
        self.shards: list[_OpenShard] = shards
        self.report: PreflightReport = report
        self.max_model_len: int | None = report.max_model_len
        self.config: GenerationConfig = config
        self.log = log
        self.on_shard_done: ShardDone | None = on_shard_done
        self.outcome: RunOutcome = outcome
        self.total = sum(len(s.job.samples) for s in shards)
        self.reused = sum(s.plan.reused for s in shards)
        self.pending = sum(s.left for s in shards)
        self.finished = self.errors = self.output_tokens = 0
        self.consecutive_failures = 0
        self.abort: str | None = None
        self.started = time.perf_counter()
        # Reporting a durable shard (its checks, its records in the orchestrator's database) takes from
        # milliseconds to seconds; on the event loop it would hold back every response that lands meanwhile,
        # and with it the next requests. One thread reports the shards, in the order they became durable.
        self.reporting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-report")
        self.reports: list[Future] = []

    async def execute(self, progress_interval_s: float) -> None:
        self.started = time.perf_counter()
        try:
            await self._generate(progress_interval_s)
        finally:
            self.reporting.shutdown(wait=True)  # every durable shard reported before the run returns (or fails)
        for report in self.reports:
            report.result()  # a report that failed fails the run

    async def _generate(self, progress_interval_s: float) -> None:
        for shard in self.shards:
            if shard.left == 0:  # nothing to send: durable at once
                self._finish(shard)
        # One queue over the shards in order: a worker freed by the last samples of one shard takes the next one's.
        queue = ((shard, sample) for shard in self.shards for sample in shard.plan.pending)
        ticker = asyncio.create_task(self._report_every(progress_interval_s))
        workers = [asyncio.create_task(self._work(queue)) for _ in range(min(self.config.concurrency, self.pending))]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for worker in workers:  # one failed (e.g. the disk): stop the others before the session closes
                worker.cancel()
            raise
        finally:
            ticker.cancel()
        elapsed = time.perf_counter() - self.started
        self.log(self.progress(elapsed).line())

    async def _work(self, queue) -> None:
        for shard, sample in queue:  # a shared iterator: each sample goes to exactly one worker
            if self.abort:
                return
            if shard.started is None:
                shard.started = time.perf_counter()
            prior = (shard.rows.get(sample.id) or {}).get("attempts") or 0
            may_be_too_long = self.max_model_len is not None and prompt_tokens_upper_bound(sample.messages) >= self.max_model_len
            if may_be_too_long:
                row = await self._checked(sample, prior, shard.tally)
            else:
                row = await self.client.complete(sample, prior_attempts=prior, tally=shard.tally)
            exhausted = row.pop("_retries_exhausted", False)
            shard.rows[sample.id] = row
            shard.journal.append(row)
            tokens = row["completion_tokens"] or 0
            shard.finished += 1
            shard.output_tokens += tokens
            shard.left -= 1
            self.finished += 1
            self.output_tokens += tokens
            if row["error"]:
                shard.errors += 1
                self.errors += 1
            self.consecutive_failures = self.consecutive_failures + 1 if exhausted else 0
            if self.consecutive_failures >= self.config.max_consecutive_failures and not self.abort:
                self.abort = (
                    f"{self.consecutive_failures} samples in a row failed after {self.config.max_retries} retries "
                    f"(last: {row['error']}); the server looks unavailable. The journal keeps the "
                    f"{self.reused + self.finished - self.errors} finished rows: rerun the shard to resume."
                )
            if shard.left == 0:
                self._finish(shard)

    def _finish(self, shard: _OpenShard) -> None:
        """The shard's last row is durable: write its Parquet file and report it, while the other shards generate on."""
        now = time.perf_counter()
        outcome = shard.finish(self.config, self.report, now - (shard.started or now), self.log)
        self.outcome.finished[shard.job.key] = outcome
        if len(self.shards) > 1:
            self.log(
                f"{shard.job.key}: durable, {outcome.frame.height} rows ({outcome.sent} sent, {outcome.reused} reused, {shard.errors} errors); "
                f"{len(self.outcome.finished)} of {len(self.shards)} shards done"
            )
        if self.on_shard_done is not None:
            self.reports.append(self.reporting.submit(self.on_shard_done, shard.job.key, outcome))

    async def _checked(self, sample: Sample, prior: int, tally: AttemptTally) -> dict[str, Any]:
        """A prompt that might not fit: count it exactly; settle it without a generation request if it does not fit."""
        assert self.max_model_len is not None
        count = await self.client.prompt_tokens(sample.messages, sample.id)
        if count is None:  # no /tokenize (not vLLM), or it timed out: let the server judge
            return await self.client.complete(sample, prior_attempts=prior, tally=tally)
        if count >= self.max_model_len:
            return self.client._error_row(sample, f"{PROMPT_TOO_LONG}: {count} prompt tokens >= max_model_len {self.max_model_len}; not sent", "", prior, 0.0)
        return await self.client.complete(sample, max_tokens=min(self.config.max_tokens, self.max_model_len - count), prior_attempts=prior, tally=tally)

    def progress(self, now: float | None = None) -> Progress:
        elapsed = (time.perf_counter() - self.started) if now is None else now
        left = self.pending - self.finished
        rate = self.finished / elapsed if elapsed > 0 else 0.0
        return Progress(
            done=self.reused + self.finished,
            total=self.total,
            errors=self.errors,
            output_tokens_per_s=self.output_tokens / elapsed if elapsed > 0 else 0.0,
            elapsed_s=elapsed,
            eta_s=left / rate if rate > 0 else (0.0 if left == 0 else None),
            shards_done=len(self.outcome.finished),
            shards=len(self.shards),
        )

    async def _report_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.log(self.progress().line())


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")
