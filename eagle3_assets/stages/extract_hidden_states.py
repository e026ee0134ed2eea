"""``extract_hidden_states``: the hidden states of a run's shards, with one engine, on the GPU host, speaking Dagster Pipes.

Run by the GPU host resource (``python -m eagle3_assets.stages extract_hidden_states``
after its pre-flight). Its Pipes extras are an
:class:`eagle3_assets.core.extraction.job.ExtractionJob` listing the run's
shards (paths relative to ``$EAGLE3_DATA_DIR`` on the host, or absolute),
refused with the key's name when a key is unknown, missing or of the wrong type.

The target is loaded once per run (hours for a 1T target), never per shard:

1. every shard is looked at first, without the engine: its traces are read and
   checked, the target compared with the one that rendered them
   (``target_matches_traces``), and a shard already finished with the same
   data version and settings (:mod:`eagle3_assets.core.extraction.shard_record`)
   is reported as it is;
2. when shards are left, the engine is built once (a line in
   ``<data>/hidden_states/engine_builds.jsonl``) and each shard is extracted in
   turn under its own lease (resuming from its durable parts), gated where the
   files are, recorded, and reported at once.

Each shard is reported as a ``report_custom_message`` (:data:`~eagle3_assets.core.extraction.job.EXTRACTION_SHARD_MESSAGE`)
the moment it is done: Pipes' own ``report_asset_materialization`` takes no
partition and one call per asset, so the orchestrator turns each message into
that partition's materialisation and check results as it arrives. A SIGKILL
part-way keeps every shard reported before it. A shard whose input is bad
(traces unreadable, another run writing it) is reported as stopped, naming why,
and the others go on.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eagle3_assets.core.settings.environment import ALLOW_CPU
from eagle3_assets.core.extraction.backends import make_backend  # the recipe's backend, from its registered entry
from eagle3_assets.core.extraction.job import EXTRACTION_SHARD_MESSAGE, ExtractionJob, ExtractionRecipe, ExtractionShard, StageTarget

STAGE = "extract_hidden_states"
PROGRESS_EVERY_S = 5.0


def _resolve(path: str) -> Path:
    from eagle3_assets.core.storage.files import data_dir

    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else data_dir() / candidate


def _peak_memory() -> dict[str, float]:
    import torch

    peak = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available():
        peak["peak_gpu_mib"] = round(max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**20, 1)
    return peak


class Progress:
    """One log line every few seconds: tokens done of the total, tokens/s, ETA."""

    def __init__(self, log):
        self.log = log
        self.total = 0
        self.last = 0.0

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "start":
            self.total = event["tokens"]
            self.log(f"{STAGE}: {event['samples']} samples, {event['tokens']} tokens in {event['parts']} part(s)")
        elif kind == "quarantined":
            self.log(f"{STAGE}: {event['line']}")
        elif kind == "part" and event["reused"]:
            self.log(f"{STAGE}: {event['part']} already durable ({event['samples']} samples), kept")
        elif kind == "batch" and time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            done, elapsed = event["tokens_done"], event["elapsed_s"]
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = (self.total - done) / rate if rate > 0 else float("nan")
            self.log(f"{STAGE}: {done}/{self.total} tokens computed, {rate:.0f} tokens/s, ETA {eta:.0f}s")


def aux_reference(job: ExtractionRecipe, target: StageTarget, backend) -> tuple[Any, list]:
    """The aux gate's reference forward (or None) per ``aux_check_reference``, and any backend opened for it (to close)."""
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend

    reference = job.aux_check_reference
    if reference == "auto":
        reference = "transformers" if backend.name == "transformers" else "none"
    if reference != "transformers":
        return None, []
    if isinstance(backend, TransformersBackend):
        return (lambda ids: backend.reference_forward(ids)[1]), []
    other = TransformersBackend(target.path, target.aux_layer_ids, trust_remote_code=target.trust_remote_code)
    return (lambda ids: other.reference_forward(ids)[1]), [other]


@dataclass
class ShardResult:
    """One shard of the run as the orchestrator records it: done (metadata and gate outcomes), or stopped (why)."""

    shard: str
    data_version: str
    metadata: dict[str, Any]
    outcomes: list
    stopped: str | None = None

    def message(self) -> dict[str, Any]:
        """The custom Pipes message's payload (plain JSON)."""
        return {
            "kind": EXTRACTION_SHARD_MESSAGE,
            "shard": self.shard,
            "data_version": self.data_version,
            "metadata": self.metadata,
            "checks": [{"name": o.name, "passed": o.passed, "description": o.description, "metadata": o.metadata} for o in self.outcomes],
            "stopped": self.stopped,
        }


@dataclass
class _Pending:
    spec: ExtractionShard
    traces: list | None  # None: read from the shard's file where it is extracted (a Ray engine on another node)
    shard_dir: Path
    target_check: Any
    key: str


def run(job: ExtractionJob, log=print, run_id: str | None = None, on_shard: Callable[[ShardResult], None] | None = None) -> list[ShardResult]:
    """Extract and gate every shard of ``job`` with one engine (none when nothing is left); each result as it is done."""
    from eagle3_assets.core.extraction.gates import HIDDEN_STATE_GATES
    from eagle3_assets.core.extraction.hidden_state_checks import check_target_matches_traces
    from eagle3_assets.core.extraction.traces import ExtractionInputError, TargetFacts, read_traces, traces_digest
    from eagle3_assets.core.extraction.shard_record import reusable, reuse_key
    from eagle3_assets.core.reporting.checks import CheckOutcome
    from eagle3_assets.core.target.identity import identity_in_parquet, target_identity

    results: list[ShardResult] = []

    def done(result: ShardResult) -> None:
        results.append(result)
        if on_shard is not None:
            on_shard(result)

    facts = TargetFacts.from_path(job.target.path)
    identity = target_identity(job.target.path)
    pending: list[_Pending] = []
    for spec in job.shards:
        traces_path, shard_dir = _resolve(spec.traces), _resolve(spec.output)
        try:
            traces = read_traces(traces_path, facts.vocab_size)
            if not traces:
                raise ExtractionInputError(f"validated_traces {traces_path}: the shard has no traces to extract")
        except ExtractionInputError as exc:
            log(f"{STAGE}: {spec.shard}: {exc}")
            done(ShardResult(spec.shard, spec.data_version, {}, [], stopped=str(exc)))
            continue
        # The states of another model than the one that rendered the traces pass every other gate; a 1T
        # target takes hours per shard: compare before anything is loaded, and extract nothing on a mismatch.
        target_check = check_target_matches_traces(identity, identity_in_parquet(traces_path))
        if not target_check.passed:
            log(f"{STAGE}: {spec.shard}: {target_check.description}; nothing extracted")
            not_run = [
                CheckOutcome(name, False, "not computed: the target does not match the traces (see target_matches_traces)")
                for name in HIDDEN_STATE_GATES.names[1:]
            ]
            done(ShardResult(spec.shard, spec.data_version, {"target": identity.as_dict()}, [target_check, *not_run]))
            continue
        key = reuse_key(job, spec, traces_digest(traces), identity.config_hash)
        if job.recompute:
            why = "recompute requested"
        else:
            record, why = reusable(shard_dir, key)
            if record is not None:
                log(f"{STAGE}: {spec.shard}: kept as stored ({why})")
                done(ShardResult(spec.shard, spec.data_version, {**record.metadata, "reused": True}, record.outcomes))
                continue
        log(f"{STAGE}: {spec.shard}: to extract ({why})")
        pending.append(_Pending(spec, traces, shard_dir, target_check, key))

    if not pending:
        log(f"{STAGE}: nothing left to extract in this run's {len(job.shards)} shard(s): no engine built")
        return results
    _extract_pending(job, pending, log, run_id, done)
    return results


def _extract_pending(job: ExtractionJob, pending: list[_Pending], log, run_id: str | None, done: Callable[[ShardResult], None]) -> None:
    """Build the engine once (once per node on a Ray cluster), then extract, gate, record and report each pending shard."""
    from eagle3_assets.core.cluster.placement import on_ray_cluster

    # vLLM's context is sized from the longest trace of every shard it will see.
    longest = max(trace.num_tokens for each in pending for trace in each.traces)
    if on_ray_cluster():
        from eagle3_assets.core.extraction.ray_engines import extract_on_cluster

        # The engines read each shard's traces from the shared data directory: only names travel.
        light = [dataclasses.replace(each, traces=None) for each in pending]
        extract_on_cluster(Engine, job, light, longest, log, run_id, done, stopped=_stopped)
        return
    engine = Engine(job, longest, [each.spec.shard for each in pending], run_id, log)
    try:
        for position, each in enumerate(pending, 1):
            log(f"{STAGE}: shard {position}/{len(pending)}: {each.spec.shard}")
            done(engine.extract(each))
    finally:
        engine.close()


def _stopped(each: _Pending, why: str) -> ShardResult:
    return ShardResult(each.spec.shard, each.spec.data_version, {}, [], stopped=why)


class Engine:
    """The run's engine on one host: built once (a line in ``engine_builds.jsonl``), then extracting shard after shard.

    In this process, or as a Ray actor on each node of a Ray cluster GPU host
    (:mod:`eagle3_assets.core.extraction.ray_engines`).
    """

    def __init__(self, job: ExtractionJob, longest: int, shards: list[str], run_id: str | None, log=print):
        import torch

        from eagle3_assets.core.extraction.shard_record import record_engine_build
        from eagle3_assets.core.extraction.traces import TargetFacts

        # Where the engine is built, not where the stage's driver runs: a Ray cluster's head has no GPU.
        if not torch.cuda.is_available() and not ALLOW_CPU.get():
            raise RuntimeError(f"{STAGE}: no CUDA device on {socket.gethostname()} and EAGLE3_ALLOW_CPU is not 1: refusing to run on CPU")
        self.job, self.run_id, self.log = job, run_id, log
        self.facts = TargetFacts.from_path(job.target.path)
        if job.cpu_threads > 0:
            torch.set_num_threads(job.cpu_threads)
        started = time.monotonic()
        # What sizing reads of the run's traces is their length (a Ray engine gets the longest, not the traces).
        self.backend = make_backend(job, job.target, [SimpleNamespace(num_tokens=longest)])
        self.build = {
            "id": uuid.uuid4().hex[:12],
            "backend": self.backend.name,
            "load_s": round(time.monotonic() - started, 1),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": run_id,
            "shards": shards,
        }
        self.opened = [self.backend]
        record_engine_build(_resolve(job.shards[0].output).parent, self.build)
        log(
            f"{STAGE}: {self.backend.name} backend ready in {self.build['load_s']:.0f}s ({'cuda' if torch.cuda.is_available() else 'cpu'}), "
            f"engine {self.build['id']} for {len(shards)} shard(s)"
        )
        try:
            self.reference_states, extra = aux_reference(job, job.target, self.backend)
        except BaseException:
            self.close()  # the engine holds the target: never left open by a failed start
            raise
        self.opened += extra
        self.engine = {"engine_build": {k: self.build[k] for k in ("id", "backend", "load_s", "host")}, "model_load_s": self.build["load_s"]}

    def extract(self, each: _Pending) -> ShardResult:
        """One shard under its lease; done (metadata, gate outcomes) or stopped (why)."""
        from eagle3_assets.core.extraction.traces import ExtractionInputError, read_traces
        from eagle3_assets.core.storage.shard_lease import ShardBusyError, ShardLease

        log, spec = self.log, each.spec
        # One writer per shard, taken here on the host (so a remote host works too), beside the shard's directory.
        # A killed run's lease names a dead pid: it is taken over and its `.partial` files are removed, each logged.
        try:
            if each.traces is None:
                each = dataclasses.replace(each, traces=read_traces(_resolve(spec.traces), self.facts.vocab_size))
            with ShardLease(each.shard_dir.parent, each.shard_dir.name, asset="hidden_states", run_id=self.run_id, log=log):
                metadata, outcomes = _extract_and_check(self.job, each, self.backend, self.reference_states, self.facts, log, self.engine)
        except (ExtractionInputError, ShardBusyError) as exc:
            log(f"{STAGE}: {spec.shard}: {exc}")
            return _stopped(each, str(exc))
        return ShardResult(spec.shard, spec.data_version, {**metadata, "reused": False}, outcomes)

    def close(self) -> None:
        for each in self.opened:
            each.close()


def _extract_and_check(
    job: ExtractionJob, shard: _Pending, backend, reference_states, facts, log, engine: dict[str, Any]
) -> tuple[dict[str, Any], list]:
    """One shard: its files (resuming from durable parts), its gates, its record; the metadata and the gates' outcomes."""
    from eagle3_assets.core.extraction.hidden_state_checks import gate_extracted_shard, keep_logits_references
    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.shard_record import ShardRecord, forget
    from eagle3_assets.core.extraction.state_layout import state_bytes_per_token
    from eagle3_assets.core.target.head import TargetHead

    target, traces, shard_dir, spec = job.target, shard.traces, shard.shard_dir, shard.spec
    identity = shard.target_check.metadata["extracting_target"]
    if job.recompute and shard_dir.is_dir():
        log(f"{STAGE}: {spec.shard}: recompute requested: discarding {shard_dir}")
        shutil.rmtree(shard_dir)
    forget(shard_dir)  # from here until the gates are done, the stored record would not describe the files
    settings = ExtractionSettings(
        target_path=target.path,
        target_config_hash=identity["config_hash"],
        aux_layer_ids=tuple(target.aux_layer_ids),
        dtype=job.dtype,
        part_bytes=job.part_size_bytes,
    )
    # The logits gate compares with the engine's own choice in the pass that captures the states.
    keep_logits_references(backend, traces, job.logits_check_samples, spec.check_seed)
    report = extract_shard(traces, shard_dir, settings, backend, on_event=Progress(log))
    log(
        f"{STAGE}: {spec.shard}: {report.parts_written} part(s) written, {report.parts_reused} kept, "
        f"{report.tokens_computed} tokens computed in {report.wall_s:.1f}s"
    )
    # On the CPU: the GPUs are full of the target (or of vLLM's reservation), and a few thousand positions are cheap.
    head = TargetHead.from_checkpoint(target.path)
    gates = gate_extracted_shard(
        shard_dir, traces, head, backend.reference_argmax, target.aux_layer_ids, facts, reference_states, job, spec.check_seed
    )
    outcomes = [shard.target_check, *gates]
    for outcome in outcomes:
        if not outcome.passed:
            log(f"{STAGE}: {spec.shard}: {outcome.name} FAILED: {outcome.description}")
    per_token = report.bytes_on_disk / report.tokens
    metadata = {
        "path": str(shard_dir),
        "samples": report.samples,
        "tokens": report.tokens,
        "dagster/row_count": report.samples,
        "parts": report.parts,
        "parts_written": report.parts_written,
        "parts_reused": report.parts_reused,
        "parts_quarantined": report.parts_quarantined,
        "bytes": report.bytes_on_disk,
        "bytes_per_token": round(per_token, 2),
        "bytes_per_token_over_8H": round(per_token / (8 * facts.hidden_size), 5),
        "state_bytes_per_token": state_bytes_per_token(facts.hidden_size, settings.dtype),
        "backend": backend.name,
        "final_state": backend.final_state,
        "aux_layer_ids": list(settings.aux_layer_ids),
        "dtype": settings.dtype,
        "hidden_size": facts.hidden_size,
        "num_layers": facts.num_layers,
        "target": identity,
        "tokens_per_s": round(report.tokens_per_s, 1),
        **engine,  # which engine build made these states: one per run, however many shards (P11)
        **_peak_memory(),
    }
    ShardRecord.made(spec, shard.key, shard_dir, metadata, outcomes).write(shard_dir)
    return metadata, outcomes


def main() -> None:
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        job = ExtractionJob.from_dict(dict(pipes.extras or {}))

        def report(result: ShardResult) -> None:
            pipes.report_custom_message(result.message())
            if result.stopped:
                pipes.log.error(f"{STAGE}: {result.shard}: stopped: {result.stopped}")
            else:
                failed = [o.name for o in result.outcomes if not o.passed]
                (pipes.log.error if failed else pipes.log.info)(
                    f"{STAGE}: {result.shard}: reported ({'gates failed: ' + ', '.join(failed) if failed else 'every gate passed'})"
                )

        run(job, log=pipes.log.info, run_id=pipes.run_id, on_shard=report)


if __name__ == "__main__":
    main()
