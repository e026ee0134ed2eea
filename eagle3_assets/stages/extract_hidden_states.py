"""``extract_hidden_states``: one shard's hidden states, on the GPU host, speaking Dagster Pipes.

Run by the GPU host resource (``python -m eagle3_assets.stages extract_hidden_states``
after its pre-flight). Extras (paths relative to ``$EAGLE3_DATA_DIR`` on the
host, or absolute):

- ``shard``, ``traces`` (the ``validated_traces`` parquet), ``output`` (the shard's directory);
- ``target``: ``path``, ``trust_remote_code``, ``aux_layer_ids`` (vLLM's convention), ``config_hash``
  (what the orchestrator saw; the stage records the identity of the model it loads itself);
- ``backend`` (``transformers`` or ``vllm``), ``dtype`` (storage), ``part_bytes``,
  ``max_batch_tokens``, ``max_batch_size``, ``cpu_threads``, ``recompute`` (discard
  the shard's files first; otherwise durable parts of the same extraction are kept);
- ``vllm``: ``dtype``, ``max_model_len`` (0: the longest trace + 1),
  ``tensor_parallel_size``, ``gpu_memory_utilization``, ``enforce_eager``;
- ``checks``: ``logits_samples``, ``logits_positions``, ``min_argmax_agreement``,
  ``aux_samples``, ``aux_reference`` (``transformers``, ``none`` or ``auto``: a
  transformers forward with the transformers backend, none with vLLM, whose
  targets are too large for it), ``seed``;
- ``data_version``: reported with the materialisation.

Writes the shard (resuming from its durable parts), then computes the gates
where the files are and reports the materialisation's metadata and the check
results back. Each check's ``summary`` metadata is its one-line verdict.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from pathlib import Path
from typing import Any

STAGE = "extract_hidden_states"
PROGRESS_EVERY_S = 5.0


def _resolve(path: str) -> Path:
    from eagle3_assets.core.storage import data_dir

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


def make_backend(extras: dict[str, Any], traces):
    backend = extras.get("backend", "transformers")
    target = extras["target"]
    if backend == "transformers":
        from eagle3_assets.core.extraction import TransformersBackend

        return TransformersBackend(
            target["path"],
            target["aux_layer_ids"],
            max_batch_tokens=int(extras.get("max_batch_tokens", 16384)),
            max_batch_size=int(extras.get("max_batch_size", 64)),
            trust_remote_code=bool(target.get("trust_remote_code")),
        )
    if backend == "vllm":
        from eagle3_assets.core.target import vllm_engine_overrides
        from eagle3_assets.core.vllm_extraction import VLLMBackend

        options = dict(extras.get("vllm") or {})
        longest = max(t.num_tokens for t in traces)
        max_model_len = int(options.get("max_model_len") or 0) or -(-(longest + 1) // 16) * 16
        return VLLMBackend(
            target["path"],
            target["aux_layer_ids"],
            dtype=options.get("dtype", "auto"),
            max_model_len=max_model_len,
            max_batch_tokens=int(extras.get("max_batch_tokens", 65536)),
            tensor_parallel_size=int(options.get("tensor_parallel_size", 1)),
            gpu_memory_utilization=float(options.get("gpu_memory_utilization", 0.9)),
            enforce_eager=options.get("enforce_eager"),
            trust_remote_code=bool(target.get("trust_remote_code")),
            engine_kwargs=vllm_engine_overrides(target["path"]),
        )
    raise ValueError(f"backend {backend!r}: one of transformers, vllm")


def run(extras: dict[str, Any], log=print) -> tuple[dict[str, Any], list]:
    """Extract the shard and compute its gates; (materialisation metadata, check outcomes)."""
    import torch

    from eagle3_assets.core.extraction import TargetFacts, read_traces
    from eagle3_assets.core.hidden_state_checks import GATES, CheckOutcome, check_target_matches_traces
    from eagle3_assets.core.shard_lease import ShardLease
    from eagle3_assets.core.target import identity_in_parquet, target_identity

    if not torch.cuda.is_available() and os.environ.get("EAGLE3_ALLOW_CPU", "1") != "1":
        raise RuntimeError(f"{STAGE}: no CUDA device on this host and EAGLE3_ALLOW_CPU is not 1: refusing to run on CPU")
    if int(extras.get("cpu_threads") or 0) > 0:
        torch.set_num_threads(int(extras["cpu_threads"]))
    target = extras["target"]
    facts = TargetFacts.from_path(target["path"])
    traces_path, shard_dir = _resolve(extras["traces"]), _resolve(extras["output"])
    traces = read_traces(traces_path, facts.vocab_size)
    # The states of another model than the one that rendered the traces pass every other gate; a 1T
    # target takes hours per shard: compare before anything is loaded, and extract nothing on a mismatch.
    identity = target_identity(target["path"])
    target_check = check_target_matches_traces(identity, identity_in_parquet(traces_path))
    if not target_check.passed:
        log(f"{STAGE}: {target_check.description}; nothing extracted")
        not_run = [CheckOutcome(name, False, "not computed: the target does not match the traces (see target_matches_traces)") for name in GATES[1:]]
        return {"target": {"raw_value": identity.as_dict(), "type": "json"}}, [target_check, *not_run]
    # One writer per shard, taken here on the host (so a remote host works too), beside the shard's directory.
    # A killed run's lease names a dead pid: it is taken over and its `.partial` files are removed, each logged.
    with ShardLease(shard_dir.parent, shard_dir.name, asset="hidden_states", run_id=extras.get("run_id"), log=log):
        return _extract_and_check(extras, log, facts, traces, shard_dir, target_check)


def _extract_and_check(extras: dict[str, Any], log, facts, traces, shard_dir: Path, target_check) -> tuple[dict[str, Any], list]:
    import torch

    from eagle3_assets.core.extraction import ExtractionSettings, TransformersBackend, extract_shard
    from eagle3_assets.core.state_layout import state_bytes_per_token
    from eagle3_assets.core.hidden_state_checks import (
        TargetHead,
        check_aux_states_match_layer_ids,
        check_final_state_reproduces_logits,
        check_states_finite,
        check_states_match_traces,
    )

    target = extras["target"]
    identity = target_check.metadata["extracting_target"]
    if extras.get("recompute") and shard_dir.is_dir():
        log(f"{STAGE}: recompute requested: discarding {shard_dir}")
        shutil.rmtree(shard_dir)
    settings = ExtractionSettings(
        target_path=str(target["path"]),
        target_config_hash=identity["config_hash"],
        aux_layer_ids=tuple(target["aux_layer_ids"]),
        dtype=extras.get("dtype", "bfloat16"),
        part_bytes=int(extras.get("part_bytes") or 2 * 1024**3),
    )
    started = time.monotonic()
    backend = make_backend(extras, traces)
    load_s = time.monotonic() - started
    log(f"{STAGE}: {backend.name} backend ready in {load_s:.0f}s ({'cuda' if torch.cuda.is_available() else 'cpu'})")
    checks = dict(extras.get("checks") or {})
    seed = int(checks.get("seed", 0))
    opened = [backend]
    try:
        report = extract_shard(traces, shard_dir, settings, backend, on_event=Progress(log))
        log(
            f"{STAGE}: {report.parts_written} part(s) written, {report.parts_reused} kept, "
            f"{report.tokens_computed} tokens computed in {report.wall_s:.1f}s"
        )
        aux_reference = checks.get("aux_reference", "auto")
        if aux_reference == "auto":
            aux_reference = "transformers" if backend.name == "transformers" else "none"
        if aux_reference == "transformers":
            if isinstance(backend, TransformersBackend):
                reference = backend
            else:
                reference = TransformersBackend(target["path"], target["aux_layer_ids"], trust_remote_code=bool(target.get("trust_remote_code")))
                opened.append(reference)
            reference_states = lambda ids: reference.reference_forward(ids)[1]  # noqa: E731
        else:
            reference_states = None
        # On the CPU: the GPUs are full of the target (or of vLLM's reservation), and a few thousand positions are cheap.
        head = TargetHead.from_checkpoint(target["path"])
        outcomes = [
            target_check,
            check_states_finite(shard_dir),
            check_states_match_traces(shard_dir, traces),
            check_final_state_reproduces_logits(
                shard_dir,
                head,
                backend.reference_argmax,
                samples=int(checks.get("logits_samples", 8)),
                max_positions=int(checks.get("logits_positions", 4096)),
                min_agreement=float(checks.get("min_argmax_agreement", 0.999)),
                seed=seed,
            ),
            check_aux_states_match_layer_ids(
                shard_dir,
                target["aux_layer_ids"],
                facts,
                reference_states,
                samples=int(checks.get("aux_samples", 4)),
                seed=seed,
            ),
        ]
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


def _check_metadata(outcome) -> dict[str, Any]:
    metadata: dict[str, Any] = {"summary": outcome.description}
    for key, value in outcome.metadata.items():
        metadata[key] = {"raw_value": value, "type": "json"} if isinstance(value, (list, dict)) else value
    return metadata


def main() -> None:
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        extras = {"run_id": pipes.run_id, **dict(pipes.extras or {})}
        metadata, outcomes = run(extras, log=pipes.log.info)
        pipes.report_asset_materialization(metadata=metadata, data_version=extras.get("data_version"))
        for outcome in outcomes:
            log = pipes.log.info if outcome.passed else pipes.log.error
            log(f"{STAGE}: {outcome.name}: {'passed' if outcome.passed else 'FAILED'}: {outcome.description}")
            pipes.report_asset_check(check_name=outcome.name, passed=outcome.passed, severity="ERROR", metadata=_check_metadata(outcome))


if __name__ == "__main__":
    main()
