"""Regenerate reasoning traces through an OpenAI-compatible server (vLLM, SGLang), fast and resumably.

The requests go through :mod:`.client` (why an aiohttp client and
not the ``openai`` SDK is told there), what they send is a
:class:`.config.GenerationConfig`, what a response becomes is
:mod:`.completions`, and what one shard resumes from and sends again is
:mod:`.shard_resume`; this module schedules the run: one shard, or the shards of
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

Nothing here imports Dagster: the asset (``eagle3_assets/defs/raw_responses.py``)
is a thin wrapper, and the benchmark drives this module directly.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.generation.completions import Sample, prompt_tokens_upper_bound
from eagle3_assets.core.generation.client import (
    DEFAULT_CANARY_MAX_TOKENS,
    DEFAULT_CANARY_PROMPT,
    CanaryClient,
    AttemptTally,
    GenerationClient,
    PreflightReport,
)
from eagle3_assets.core.generation.config import DEFAULT_PROGRESS_INTERVAL_S, GenerationConfig
from eagle3_assets.core.generation.response_rules import PROMPT_TOO_LONG
from eagle3_assets.core.generation.shard_resume import OpenShard, ShardJob, ShardOutcome
from eagle3_assets.core.storage.journal import JournalCorruptError


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
        shards: list[OpenShard] = []
        try:
            for job in jobs:
                try:
                    shards.append(OpenShard.open(job, config, log))
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


class _RangeRun:
    """``concurrency`` workers over one queue of every shard's pending samples; a shard is finished as its last row lands."""

    def __init__(self, client, shards, report, config, log, on_shard_done, outcome):
        self.client: GenerationClient = client
        self.shards: list[OpenShard] = shards
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

    def _finish(self, shard: OpenShard) -> None:
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
