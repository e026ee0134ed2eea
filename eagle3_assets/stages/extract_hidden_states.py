"""``extract_hidden_states``: one shard's hidden states, on the GPU host, speaking Dagster Pipes.

Run by the GPU host resource (``python -m eagle3_assets.stages extract_hidden_states``
after its pre-flight). Its Pipes extras are an
:class:`eagle3_assets.core.gpu_host.stage_jobs.ExtractionJob` (paths relative to
``$EAGLE3_DATA_DIR`` on the host, or absolute), refused with the key's name
when a key is unknown, missing or of the wrong type.

Writes the shard (resuming from its durable parts), then computes the gates
where the files are and reports the materialisation's metadata and the check
results back. Each check's ``summary`` metadata is its one-line verdict.
"""

from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path
from typing import Any

from eagle3_assets.core.settings.environment import ALLOW_CPU
from eagle3_assets.core.gpu_host.stage_jobs import ExtractionJob, ExtractionRecipe, StageTarget

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


def make_backend(job: ExtractionRecipe, target: StageTarget, traces):
    """The recipe's extraction backend for ``target``; vLLM's context sized from the longest of ``traces``."""
    if job.backend == "transformers":
        from eagle3_assets.core.extraction.shard_extraction import TransformersBackend

        return TransformersBackend(
            target.path,
            target.aux_layer_ids,
            job,
            trust_remote_code=target.trust_remote_code,
        )
    if job.backend == "vllm":
        from eagle3_assets.core.extraction.vllm_backend import VLLMBackend

        longest = max(t.num_tokens for t in traces)
        # The context this use needs (the target's serving profile may set its own max_model_len).
        return VLLMBackend(target.path, target.aux_layer_ids, job, max_model_len=-(-(longest + 1) // 16) * 16, serving=target.serving)
    raise ValueError(f"backend {job.backend!r}: one of transformers, vllm")


def aux_reference(job: ExtractionRecipe, target: StageTarget, backend) -> tuple[Any, list]:
    """The aux gate's reference forward (or None) per ``aux_check_reference``, and any backend opened for it (to close)."""
    from eagle3_assets.core.extraction.shard_extraction import TransformersBackend

    reference = job.aux_check_reference
    if reference == "auto":
        reference = "transformers" if backend.name == "transformers" else "none"
    if reference != "transformers":
        return None, []
    if isinstance(backend, TransformersBackend):
        return (lambda ids: backend.reference_forward(ids)[1]), []
    other = TransformersBackend(target.path, target.aux_layer_ids, trust_remote_code=target.trust_remote_code)
    return (lambda ids: other.reference_forward(ids)[1]), [other]


def run(job: ExtractionJob, log=print, run_id: str | None = None) -> tuple[dict[str, Any], list]:
    """Extract the shard and compute its gates; (materialisation metadata, check outcomes)."""
    import torch

    from eagle3_assets.core.extraction.shard_extraction import TargetFacts, read_traces
    from eagle3_assets.core.reporting.checks import CheckOutcome
    from eagle3_assets.core.extraction.hidden_state_checks import GATES, check_target_matches_traces
    from eagle3_assets.core.storage.shard_lease import ShardLease
    from eagle3_assets.core.target.identity import identity_in_parquet, target_identity

    if not torch.cuda.is_available() and not ALLOW_CPU.get():
        raise RuntimeError(f"{STAGE}: no CUDA device on this host and EAGLE3_ALLOW_CPU is not 1: refusing to run on CPU")
    if job.cpu_threads > 0:
        torch.set_num_threads(job.cpu_threads)
    facts = TargetFacts.from_path(job.target.path)
    traces_path, shard_dir = _resolve(job.traces), _resolve(job.output)
    traces = read_traces(traces_path, facts.vocab_size)
    # The states of another model than the one that rendered the traces pass every other gate; a 1T
    # target takes hours per shard: compare before anything is loaded, and extract nothing on a mismatch.
    identity = target_identity(job.target.path)
    target_check = check_target_matches_traces(identity, identity_in_parquet(traces_path))
    if not target_check.passed:
        log(f"{STAGE}: {target_check.description}; nothing extracted")
        not_run = [CheckOutcome(name, False, "not computed: the target does not match the traces (see target_matches_traces)") for name in GATES[1:]]
        return {"target": {"raw_value": identity.as_dict(), "type": "json"}}, [target_check, *not_run]
    # One writer per shard, taken here on the host (so a remote host works too), beside the shard's directory.
    # A killed run's lease names a dead pid: it is taken over and its `.partial` files are removed, each logged.
    with ShardLease(shard_dir.parent, shard_dir.name, asset="hidden_states", run_id=run_id, log=log):
        return _extract_and_check(job, log, facts, traces, shard_dir, target_check)


def _extract_and_check(job: ExtractionJob, log, facts, traces, shard_dir: Path, target_check) -> tuple[dict[str, Any], list]:
    import torch

    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.hidden_state_checks import gate_extracted_shard, keep_logits_references
    from eagle3_assets.core.extraction.state_layout import state_bytes_per_token
    from eagle3_assets.core.target.head import TargetHead

    target = job.target
    identity = target_check.metadata["extracting_target"]
    if job.recompute and shard_dir.is_dir():
        log(f"{STAGE}: recompute requested: discarding {shard_dir}")
        shutil.rmtree(shard_dir)
    settings = ExtractionSettings(
        target_path=target.path,
        target_config_hash=identity["config_hash"],
        aux_layer_ids=tuple(target.aux_layer_ids),
        dtype=job.dtype,
        part_bytes=job.part_size_bytes,
    )
    started = time.monotonic()
    backend = make_backend(job, target, traces)
    load_s = time.monotonic() - started
    log(f"{STAGE}: {backend.name} backend ready in {load_s:.0f}s ({'cuda' if torch.cuda.is_available() else 'cpu'})")
    opened = [backend]
    try:
        # The logits gate compares with the engine's own choice in the pass that captures the states.
        keep_logits_references(backend, traces, job.logits_check_samples, job.check_seed)
        report = extract_shard(traces, shard_dir, settings, backend, on_event=Progress(log))
        log(
            f"{STAGE}: {report.parts_written} part(s) written, {report.parts_reused} kept, "
            f"{report.tokens_computed} tokens computed in {report.wall_s:.1f}s"
        )
        reference_states, extra = aux_reference(job, target, backend)
        opened += extra
        # On the CPU: the GPUs are full of the target (or of vLLM's reservation), and a few thousand positions are cheap.
        head = TargetHead.from_checkpoint(target.path)
        gates = gate_extracted_shard(
            shard_dir, traces, head, backend.reference_argmax, target.aux_layer_ids, facts, reference_states, job, job.check_seed
        )
        outcomes = [target_check, *gates]
    finally:
        for each in opened:
            each.close()

    per_token = report.bytes_on_disk / report.tokens
    metadata = {
        "path": {"raw_value": str(shard_dir), "type": "path"},
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
        "aux_layer_ids": {"raw_value": list(settings.aux_layer_ids), "type": "json"},
        "dtype": settings.dtype,
        "hidden_size": facts.hidden_size,
        "num_layers": facts.num_layers,
        "target": {"raw_value": identity, "type": "json"},
        "tokens_per_s": round(report.tokens_per_s, 1),
        "model_load_s": round(load_s, 1),
        **_peak_memory(),
    }
    return metadata, outcomes


def main() -> None:
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        job = ExtractionJob.from_dict(dict(pipes.extras or {}))
        metadata, outcomes = run(job, log=pipes.log.info, run_id=pipes.run_id)
        pipes.report_asset_materialization(metadata=metadata, data_version=job.data_version)
        for outcome in outcomes:
            log = pipes.log.info if outcome.passed else pipes.log.error
            log(f"{STAGE}: {outcome.name}: {'passed' if outcome.passed else 'FAILED'}: {outcome.description}")
            pipes.report_asset_check(check_name=outcome.name, passed=outcome.passed, severity="ERROR", metadata=outcome.pipes_metadata())


if __name__ == "__main__":
    main()
