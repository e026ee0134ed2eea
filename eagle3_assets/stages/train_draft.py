"""``train_draft``: train the EAGLE-3 draft on the GPU host and export it in vLLM's form (Dagster Pipes).

One stage for both hidden-state modes; its Pipes extras are an
:class:`eagle3_assets.core.training.job.TrainingJob`:

- ``train``: the :class:`eagle3_assets.core.training.config.TrainConfig`
  (hidden-state shard directories, vocabulary map, target, training directory,
  hyperparameters, ``init_from`` for fine-tuning);
- ``bounded``: in bounded-disk mode, the shards whose states are extracted
  again each epoch through a window (:mod:`eagle3_assets.core.training.streamed`),
  with the target and the ``hidden_states`` extraction recipe; absent, the
  loop reads the stored shards of ``train.hidden_state_dirs``;
- ``nproc_per_node``: processes (GPUs) to train with; above 1 the training
  runs under ``torchrun`` (DDP; gloo on CPU) while this process keeps the one
  Pipes connection and relays rank 0's progress and every rank's final share;
- ``export_dir``: where the vLLM-native directory goes; ``export_dtype``
  (default: the target's dtype);
- ``gates``: what the export's gates compare with, run here because
  ``loads_in_vllm`` serves the target with the draft, which only the GPU host
  can: the results go back in the materialisation's metadata
  (``config_problems``, ``loads_in_vllm``).

A run killed at any point resumes from its last complete checkpoint the next
time the same configuration is materialised. Without Dagster (tests,
benchmarks): ``python -m eagle3_assets.stages.train_draft --config job.json``
trains only (no export) and prints one event per line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from eagle3_assets.core.training.job import ExportGates, TrainingJob

STAGE = "train_draft"


def describe(event: dict) -> str | None:
    """One log line per training event (None for events not worth a line)."""
    kind = event.get("event")
    if kind == "start":
        init = event["init"]
        source = "from scratch" if init["source"] == "scratch" else f"fine-tuning {init['source']}"
        remap = f", lm_head rows kept {init['lm_head_rows_kept']} / new {init['lm_head_rows_new']}" if init["source"] != "scratch" else ""
        if init.get("norms_added"):
            remap += f", norms added at identity: {', '.join(init['norms_added'])}"
        streamed = (
            f" in {event['shards']} shard(s) streamed through a window of {event['window_shards']}" if "window_shards" in event else ""
        )
        return (
            f"{STAGE}: {event['samples']} samples, {event['tokens']} tokens{streamed}, {event['total_steps']} steps "
            f"on {event['world_size']} x {event['device']}, {source}{remap}"
        )
    if kind == "schedule":
        return f"{STAGE}: schedule: {event['description']}"
    if kind == "memory":
        return f"{STAGE}: memory: {event['description']}"
    if kind == "resumed":
        return f"{STAGE}: resuming from {event['checkpoint']} (epoch {event['epoch']}, step {event['step']}, after batch {event['after_batch']})"
    if kind == "step":
        accuracy = " ".join(f"{a:.2f}" for a in event["accuracy"])
        where = f" shard {event['shard']}" if "shard" in event else ""
        return (
            f"{STAGE}: epoch {event['epoch']}{where} step {event['step']}/{event['total_steps']} loss {event['loss']:.4f} "
            f"lr {event['lr']:.2e} accuracy by position [{accuracy}] ({event['elapsed_s']:.0f}s)"
        )
    if kind == "extracted":
        return (
            f"{STAGE}: epoch {event['epoch']} shard {event['shard']}: {event['tokens']} tokens extracted "
            f"({event['bytes']} B, {event['extract_s']}s), gates passed"
        )
    if kind == "streamed":
        return f"{STAGE}: epoch {event['epoch']} shard {event['shard']}: trained on and deleted (peak window {event['peak_window_bytes']} B)"
    if kind == "removed":
        return f"{STAGE}: removed {event['path']} (not in the window of the resumed run)"
    if kind == "rank_done":
        return f"{STAGE}: rank {event['rank']}/{event['world_size']} done: {event['micro_batches']} micro-batches, {event['tokens']} tokens"
    if kind == "checkpoint":
        return f"{STAGE}: checkpoint of epoch {event['epoch']} step {event['step']} at {event['path']}"
    if kind == "done":
        return f"{STAGE}: done, {event['tokens_per_s']:.0f} tokens/s"
    return None


def train(job: TrainingJob, on_event) -> dict:
    """Train on the job's batch source: the stored shards (``nproc_per_node`` processes), or a streamed window."""
    from eagle3_assets.core.cluster.placement import on_ray_cluster
    from eagle3_assets.core.training.launch import run_training
    from eagle3_assets.core.training.ray_launch import run_training_on_cluster

    if job.bounded is None:
        if job.nnodes == 1:
            return run_training(job.train, nproc=job.nproc_per_node, on_event=on_event)
        if not on_ray_cluster():
            raise ValueError(f"{STAGE}: nnodes {job.nnodes}: training across nodes needs a GPU host on a Ray cluster (gpu_host.mode 'ray')")
        return run_training_on_cluster(job.train, nproc=job.nproc_per_node, nnodes=job.nnodes, on_event=on_event)
    return _train_streamed(job, on_event)


def _train_streamed(job: TrainingJob, on_event) -> dict:
    from dataclasses import asdict
    from types import SimpleNamespace

    import polars as pl
    import torch

    from eagle3_assets.core.training.job import mode_problems
    from eagle3_assets.core.training.loop import train as train_loop
    from eagle3_assets.core.training.streamed import StreamedWindow
    from eagle3_assets.core.extraction.backends import make_backend
    from eagle3_assets.stages.extract_hidden_states import aux_reference

    run = job.bounded
    assert run is not None
    problems = mode_problems("bounded", run.window_shards, run.checkpoint_every_steps, job.nproc_per_node, job.nnodes)
    if problems:
        raise ValueError(f"{STAGE}: " + "; ".join(problems))
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
        result = train_loop(job.train, StreamedWindow(run, backend, reference), on_event)
        return asdict(result) | {"history": None}
    finally:
        for each in opened:
            each.close()


def run_gates(export_dir: Path, target_path: str, gates: ExportGates, num_speculative_tokens: int, log) -> dict:
    """``config_complete``'s problems, then (only when there are none) ``loads_in_vllm``: vLLM on this host."""
    from eagle3_assets.core.draft.export import config_problems
    from eagle3_assets.core.draft.load_check import check_loads_in_vllm

    problems = config_problems(export_dir, gates.aux_layer_ids, target_vocab_size=gates.target_vocab_size)
    report = None
    if not problems:
        log(f"{STAGE}: loads_in_vllm: starting vLLM with the target and this draft")
        report = check_loads_in_vllm(
            Path(target_path),
            export_dir,
            num_speculative_tokens=num_speculative_tokens,
            log_path=Path(gates.log_path) if gates.log_path else None,
            profile=gates.serving,
        )
        log(f"{STAGE}: loads_in_vllm: {report.detail}")
    loads = (
        {"tried": True, "passed": report.passed, "detail": report.detail, "metadata": report.metadata}
        if report
        else {"tried": False, "passed": False, "detail": "not tried: config_complete failed", "metadata": {}}
    )
    return {"config_problems": {"raw_value": problems, "type": "json"}, "loads_in_vllm": {"raw_value": loads, "type": "json"}}


def export_and_gate(job: TrainingJob, result: dict, log) -> dict:
    """Export the trained draft, write its serving notes, run its gates; the materialisation's metadata."""
    from eagle3_assets.core.serving.deployment import write_serving_notes
    from eagle3_assets.core.training.checkpoints import export_trained_draft

    config = job.train
    export_dir = export_trained_draft(result["checkpoint"], config.target_path, Path(job.export_dir), job.export_dtype)
    log(f"{STAGE}: exported {export_dir}")
    # The serving notes name the weights' hash (the alias production servers answer to) and a
    # first num_speculative_tokens; draft_evaluation rewrites them with the k it recommends.
    k = job.vllm_check_num_speculative_tokens
    serving = write_serving_notes(
        export_dir, target=config.target_path, num_speculative_tokens=k, profile=job.gates.serving if job.gates else None
    )
    gates = run_gates(export_dir, config.target_path, job.gates, k, log) if job.gates else {}
    return {
        **gates,
        "training_fingerprint": result["fingerprint"],
        "draft_weights_hash": serving["draft_weights_hash"],
        "served_model_alias": serving["served_model_alias"],
        "resumed_from": result["resumed_from"] or "",
        "init": {"raw_value": result["init"], "type": "json"},
        "tokens_per_s": round(float(result["tokens_per_s"]), 1),
        "train_tokens_per_s": round(float(result["train_tokens_per_s"]), 1),
        **{key: _metadata_value(value) for key, value in (result.get("source") or {}).items()},
        "memory_plan": {"raw_value": result.get("memory"), "type": "json"},
        "nproc_per_node": job.nproc_per_node,
        "nnodes": job.nnodes,
        "schedule": {"raw_value": result.get("schedule"), "type": "json"},
        "world_size": int(result.get("world_size", 1)),
        "checkpoint": {"raw_value": result["checkpoint"], "type": "path"},
    }


def with_chosen_form(job: TrainingJob, log) -> tuple[TrainingJob, dict]:
    """The job with its draft form decided on this host (``auto`` resolved, an unservable form refused before training),
    and the choice as metadata: the form, why, and the vLLM facts it was decided from."""

    from eagle3_assets.core.training.initial_weights import choose_training_form

    choice = choose_training_form(job.train)
    log(f"{STAGE}: draft form {choice.form!r} ({choice.requested!r} requested): {choice.reason}")
    metadata = choice.as_metadata()
    return job.model_copy(update={"train": job.train.model_copy(update={"draft_form": choice.form})}), {
        **{k: v for k, v in metadata.items() if k != "vllm_facts"},
        "vllm_facts": {"raw_value": metadata["vllm_facts"], "type": "json"},
    }


def _metadata_value(value):
    """Lists and records go to Dagster as JSON metadata, numbers and words as they are."""
    return {"raw_value": value, "type": "json"} if isinstance(value, (list, dict)) else value


def main() -> None:
    if "--config" in sys.argv:
        from eagle3_assets.core.training.launch import print_event

        job, _ = with_chosen_form(TrainingJob.from_json(Path(sys.argv[sys.argv.index("--config") + 1]).read_text()), print)
        train(job, print_event)
        return

    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        job = TrainingJob.from_dict(dict(pipes.extras or {}))

        def on_event(event: dict) -> None:
            line = describe(event)
            if line:
                pipes.log.info(line)
            for warning in event.get("warnings") or []:  # before training: the data cannot make a useful draft
                pipes.log.warning(f"{STAGE}: {warning}")

        job, form = with_chosen_form(job, pipes.log.info)
        result = train(job, on_event)
        metadata = export_and_gate(job, result, pipes.log.info)
        pipes.report_asset_materialization(metadata={**metadata, **form}, data_version=result["fingerprint"])


if __name__ == "__main__":
    main()
