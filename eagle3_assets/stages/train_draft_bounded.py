"""``train_draft_bounded``: bounded-disk training on the GPU host, then export and gates (Dagster Pipes).

The draft learns from hidden states as they are extracted, with at most a
window of shards on disk (:mod:`eagle3_assets.core.bounded_training`). Extras:

- ``bounded``: the :class:`~eagle3_assets.core.bounded_training.BoundedRun`
  fields (training settings, the shards with their traces and data versions,
  the window and its directory, the storage dtype, the gates' settings);
- ``extraction``: the backend's settings as the ``extract_hidden_states`` stage
  takes them (``target``, ``backend``, ``max_batch_tokens``, ``max_batch_size``,
  ``cpu_threads``, ``vllm``, ``checks.aux_reference``);
- ``export_dir``, ``export_dtype`` and ``gates``: as ``train_draft``.

Run without Dagster (tests, benchmarks): ``python -m
eagle3_assets.stages.train_draft_bounded --config run.json`` with ``{"bounded":
..., "extraction": ...}``; it trains only (no export) and prints one event per
line. A run killed at any point resumes from its last step checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

STAGE = "train_draft_bounded"


def open_backend(extraction: dict[str, Any], run) -> tuple[Any, Any]:
    """The extraction backend for the whole run and, where it is transformers, its reference forward for the aux gate."""
    import polars as pl
    import torch

    from eagle3_assets.core.extraction import TransformersBackend
    from eagle3_assets.stages.extract_hidden_states import make_backend

    if int(extraction.get("cpu_threads") or 0) > 0:
        torch.set_num_threads(int(extraction["cpu_threads"]))
    # make_backend sizes vLLM's context from the longest trace: the longest of every streamed shard.
    longest = max(int(pl.read_parquet(s.traces, columns=["num_tokens"])["num_tokens"].max() or 1) for s in run.shards)
    backend = make_backend(extraction, [SimpleNamespace(num_tokens=longest)])
    reference = (extraction.get("checks") or {}).get("aux_reference", "auto")
    if reference == "auto":
        reference = "transformers" if backend.name == "transformers" else "none"
    if reference == "transformers" and not isinstance(backend, TransformersBackend):
        raise ValueError(f"{STAGE}: aux_reference 'transformers' needs the transformers backend here (one target in memory)")
    return backend, (lambda ids: backend.reference_forward(ids)[1]) if reference == "transformers" else None


def train(raw: dict[str, Any], on_event) -> dict:
    from eagle3_assets.core.bounded_training import BoundedRun, train_bounded

    run = BoundedRun.from_dict(raw["bounded"])
    run.validate()
    backend, reference = open_backend(dict(raw["extraction"]), run)
    try:
        return train_bounded(run, backend, reference_states=reference, on_event=on_event)
    finally:
        backend.close()


def describe(event: dict) -> str | None:
    from eagle3_assets.stages.train_draft import describe as describe_training

    kind = event.get("event")
    if kind == "start":
        return (
            f"{STAGE}: {event['samples']} samples, {event['tokens']} tokens an epoch in {event['shards']} shard(s) streamed "
            f"through a window of {event['window_shards']}, {event['total_steps']} steps on {event['device']}"
        )
    if kind == "resumed":
        return f"{STAGE}: resuming from {event['checkpoint']} (step {event['step']}, after batch {event['after_batch']})"
    if kind == "extracted":
        return (
            f"{STAGE}: epoch {event['epoch']} shard {event['shard']}: {event['tokens']} tokens extracted "
            f"({event['bytes']} B, {event['extract_s']}s), gates passed"
        )
    if kind == "streamed":
        return f"{STAGE}: epoch {event['epoch']} shard {event['shard']}: trained on and deleted (peak window {event['peak_window_bytes']} B)"
    if kind == "removed":
        return f"{STAGE}: removed {event['path']} (not in the window of the resumed run)"
    if kind == "checkpoint":
        return f"{STAGE}: checkpoint of step {event['step']} at {event['path']}"
    return describe_training(event)


def main() -> None:
    if "--config" in sys.argv:
        from eagle3_assets.core.bounded_training import print_event

        raw = json.loads(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
        train(raw, print_event)
        return

    from dagster_pipes import open_dagster_pipes

    from eagle3_assets.core.deployment import write_serving_notes
    from eagle3_assets.core.training import export_trained_draft
    from eagle3_assets.stages.train_draft import run_gates

    with open_dagster_pipes() as pipes:
        extras = dict(pipes.extras or {})

        def on_event(event: dict) -> None:
            line = describe(event)
            if line:
                pipes.log.info(line)
            for warning in event.get("warnings") or []:
                pipes.log.warning(f"{STAGE}: {warning}")

        result = train(extras, on_event)
        target_path = extras["bounded"]["train"]["target_path"]
        export_dir = export_trained_draft(result["checkpoint"], target_path, Path(extras["export_dir"]), extras.get("export_dtype"))
        pipes.log.info(f"{STAGE}: exported {export_dir}")
        serving = write_serving_notes(
            export_dir, target=target_path, num_speculative_tokens=int((extras.get("gates") or {}).get("num_speculative_tokens", 3))
        )
        gates = run_gates(export_dir, target_path, extras["gates"], pipes.log.info) if extras.get("gates") else {}
        pipes.report_asset_materialization(
            metadata={
                **gates,
                "training_fingerprint": result["fingerprint"],
                "draft_weights_hash": serving["draft_weights_hash"],
                "served_model_alias": serving["served_model_alias"],
                "resumed_from": result["resumed_from"] or "",
                "init": {"raw_value": result["init"], "type": "json"},
                "tokens_per_s": round(float(result["tokens_per_s"]), 1),
                "train_tokens_per_s": round(float(result["train_tokens_per_s"]), 1),
                "nproc_per_node": 1,
                "schedule": {"raw_value": result.get("schedule"), "type": "json"},
                "world_size": 1,
                "checkpoint": {"raw_value": result["checkpoint"], "type": "path"},
                "hidden_states_mode": "bounded",
                "window_shards": int(result["window_shards"]),
                "peak_window_bytes": int(result["peak_window_bytes"]),
                "streamed_shards": {"raw_value": result["streamed"], "type": "json"},
            },
            data_version=result["fingerprint"],
        )


if __name__ == "__main__":
    main()
