"""``train_draft_bounded``: bounded-disk training on the GPU host, then export and gates (Dagster Pipes).

The draft learns from hidden states as they are extracted, with at most a
window of shards on disk (:mod:`eagle3_assets.core.bounded_training`). Its
Pipes extras are a :class:`eagle3_assets.core.stage_jobs.BoundedTrainingJob`:

- ``bounded``: the :class:`~eagle3_assets.core.stage_jobs.BoundedRun`
  (training settings, the shards with their traces and data versions, the
  window and its directory, the target, the extraction recipe with its gates'
  settings, as ``extract_hidden_states`` takes them);
- ``export``: the export and its gates, as ``train_draft``'s job.

Run without Dagster (tests, benchmarks): ``python -m
eagle3_assets.stages.train_draft_bounded --config run.json`` with the same job
and no ``export``; it trains only and prints one event per line. A run killed
at any point resumes from its last step checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from eagle3_assets.core.stage_jobs import BoundedTrainingJob

STAGE = "train_draft_bounded"


def train(job: BoundedTrainingJob, on_event) -> dict:
    import polars as pl
    import torch

    from eagle3_assets.core.bounded_training import train_bounded
    from eagle3_assets.stages.extract_hidden_states import aux_reference, make_backend

    run = job.bounded
    run.validate()
    if run.extraction.cpu_threads > 0:
        torch.set_num_threads(run.extraction.cpu_threads)
    # make_backend sizes vLLM's context from the longest trace: the longest of every streamed shard.
    longest = max(int(pl.read_parquet(s.traces, columns=["num_tokens"])["num_tokens"].max() or 1) for s in run.shards)
    backend = make_backend(run.extraction, run.target, [SimpleNamespace(num_tokens=longest)])
    opened = [backend]
    try:
        reference, extra = aux_reference(run.extraction, run.target, backend)
        opened += extra
        return train_bounded(run, backend, reference_states=reference, on_event=on_event)
    finally:
        for each in opened:
            each.close()


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

        train(BoundedTrainingJob.from_json(Path(sys.argv[sys.argv.index("--config") + 1]).read_text()), print_event)
        return

    from dagster_pipes import open_dagster_pipes

    from eagle3_assets.stages.train_draft import export_and_gate, with_chosen_form

    with open_dagster_pipes() as pipes:
        job = BoundedTrainingJob.from_dict(dict(pipes.extras or {}))
        if job.export is None:
            raise ValueError(f"{STAGE}: the job names no export (export_dir, gates): nothing to report to Dagster")

        def on_event(event: dict) -> None:
            line = describe(event)
            if line:
                pipes.log.info(line)
            for warning in event.get("warnings") or []:
                pipes.log.warning(f"{STAGE}: {warning}")

        export, form = with_chosen_form(job.export, pipes.log.info)
        job = replace(job, export=export, bounded=replace(job.bounded, train=replace(job.bounded.train, draft_form=export.train.draft_form)))
        result = train(job, on_event)
        metadata = export_and_gate(job.export, result, pipes.log.info)
        pipes.report_asset_materialization(
            metadata={
                **metadata,
                **form,
                "train_tokens_per_s": round(float(result["train_tokens_per_s"]), 1),
                "hidden_states_mode": "bounded",
                "window_shards": int(result["window_shards"]),
                "peak_window_bytes": int(result["peak_window_bytes"]),
                "streamed_shards": {"raw_value": result["streamed"], "type": "json"},
            },
            data_version=result["fingerprint"],
        )


if __name__ == "__main__":
    main()
