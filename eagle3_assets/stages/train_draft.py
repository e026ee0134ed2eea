"""``train_draft``: train the EAGLE-3 draft on the GPU host and export it in vLLM's form (Dagster Pipes).

Its Pipes extras are an :class:`eagle3_assets.core.stage_jobs.TrainingJob`:

- ``train``: the :class:`eagle3_assets.core.training.config.TrainConfig`
  (hidden-state shard directories, vocabulary map, target, training directory,
  hyperparameters, ``init_from`` for fine-tuning);
- ``nproc_per_node``: processes (GPUs) to train with; above 1 the training
  runs under ``torchrun`` (DDP; gloo on CPU) while this process keeps the one
  Pipes connection and relays rank 0's progress and every rank's final share;
- ``export_dir``: where the vLLM-native directory goes; ``export_dtype``
  (default: the target's dtype);
- ``gates``: what the export's gates compare with, run here because
  ``loads_in_vllm`` serves the target with the draft, which only the GPU host
  can: the results go back in the materialisation's metadata
  (``config_problems``, ``loads_in_vllm``).

A run killed at any point is resumed from its last complete epoch checkpoint
the next time the same configuration is materialised.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.core.stage_jobs import ExportGates, TrainingJob

STAGE = "train_draft"


def describe(event: dict) -> str | None:
    """One log line per training event (None for events not worth a line)."""
    kind = event.get("event")
    if kind == "start":
        init = event["init"]
        source = "from scratch" if init["source"] == "scratch" else f"fine-tuning {init['source']}"
        remap = f", lm_head rows kept {init['lm_head_rows_kept']} / new {init['lm_head_rows_new']}" if init["source"] != "scratch" else ""
        return (
            f"{STAGE}: {event['samples']} samples, {event['tokens']} tokens, {event['total_steps']} steps "
            f"on {event['world_size']} x {event['device']}, {source}{remap}"
        )
    if kind == "schedule":
        return f"{STAGE}: schedule: {event['description']}"
    if kind == "resumed":
        return f"{STAGE}: resuming from {event['checkpoint']} (epoch {event['epoch']}, step {event['step']})"
    if kind == "step":
        accuracy = " ".join(f"{a:.2f}" for a in event["accuracy"])
        return (
            f"{STAGE}: epoch {event['epoch']} step {event['step']}/{event['total_steps']} loss {event['loss']:.4f} "
            f"lr {event['lr']:.2e} accuracy by position [{accuracy}] ({event['elapsed_s']:.0f}s)"
        )
    if kind == "rank_done":
        return f"{STAGE}: rank {event['rank']}/{event['world_size']} done: {event['micro_batches']} micro-batches, {event['tokens']} tokens"
    if kind == "checkpoint":
        return f"{STAGE}: checkpoint of epoch {event['epoch']} at {event['path']}"
    if kind == "done":
        return f"{STAGE}: done, {event['tokens_per_s']:.0f} tokens/s"
    return None


def run_gates(export_dir: Path, target_path: str, gates: ExportGates, num_speculative_tokens: int, log) -> dict:
    """``config_complete``'s problems, then (only when there are none) ``loads_in_vllm``: vLLM on this host."""
    from eagle3_assets.core.export import LOAD_CHECK_CONTEXT, check_loads_in_vllm, config_problems
    from eagle3_assets.core.target_serving import vllm_serving

    problems = config_problems(export_dir, gates.aux_layer_ids, target_vocab_size=gates.target_vocab_size)
    report = None
    if not problems:
        log(f"{STAGE}: loads_in_vllm: starting vLLM with the target and this draft")
        report = check_loads_in_vllm(
            Path(target_path),
            export_dir,
            num_speculative_tokens=num_speculative_tokens,
            log_path=Path(gates.log_path) if gates.log_path else None,
            serving=vllm_serving(target_path, gates.trust_remote_code, cap=LOAD_CHECK_CONTEXT),
        )
        log(f"{STAGE}: loads_in_vllm: {report.detail}")
    loads = (
        {"tried": True, "passed": report.passed, "detail": report.detail, "metadata": report.metadata}
        if report
        else {"tried": False, "passed": False, "detail": "not tried: config_complete failed", "metadata": {}}
    )
    return {"config_problems": {"raw_value": problems, "type": "json"}, "loads_in_vllm": {"raw_value": loads, "type": "json"}}


def export_and_gate(job: TrainingJob, result: dict, log) -> dict:
    """Export the trained draft, write its serving notes, run its gates; the materialisation's metadata.

    Shared with ``train_draft_bounded``, which trains otherwise and exports alike.
    """
    from eagle3_assets.core.deployment import write_serving_notes
    from eagle3_assets.core.training.checkpoints import export_trained_draft

    config = job.train
    export_dir = export_trained_draft(result["checkpoint"], config.target_path, Path(job.export_dir), job.export_dtype)
    log(f"{STAGE}: exported {export_dir}")
    # The serving notes name the weights' hash (the alias production servers answer to) and a
    # first num_speculative_tokens; draft_evaluation rewrites them with the k it recommends.
    k = job.vllm_check_num_speculative_tokens
    serving = write_serving_notes(export_dir, target=config.target_path, num_speculative_tokens=k)
    gates = run_gates(export_dir, config.target_path, job.gates, k, log) if job.gates else {}
    return {
        **gates,
        "training_fingerprint": result["fingerprint"],
        "draft_weights_hash": serving["draft_weights_hash"],
        "served_model_alias": serving["served_model_alias"],
        "resumed_from": result["resumed_from"] or "",
        "init": {"raw_value": result["init"], "type": "json"},
        "tokens_per_s": round(float(result["tokens_per_s"]), 1),
        "nproc_per_node": job.nproc_per_node,
        "schedule": {"raw_value": result.get("schedule"), "type": "json"},
        "world_size": int(result.get("world_size", 1)),
        "checkpoint": {"raw_value": result["checkpoint"], "type": "path"},
    }


def with_chosen_form(job: TrainingJob, log) -> tuple[TrainingJob, dict]:
    """The job with its draft form decided on this host (``auto`` resolved, an unservable form refused before training),
    and the choice as metadata: the form, why, and the vLLM facts it was decided from."""
    from dataclasses import replace

    from eagle3_assets.core.draft_forms import choose_training_form

    choice = choose_training_form(job.train)
    log(f"{STAGE}: draft form {choice.form!r} ({choice.requested!r} requested): {choice.reason}")
    metadata = choice.as_metadata()
    return replace(job, train=replace(job.train, draft_form=choice.form)), {
        **{k: v for k, v in metadata.items() if k != "vllm_facts"},
        "vllm_facts": {"raw_value": metadata["vllm_facts"], "type": "json"},
    }


def main() -> None:
    from dagster_pipes import open_dagster_pipes

    from eagle3_assets.core.training.launch import run_training

    with open_dagster_pipes() as pipes:
        job = TrainingJob.from_dict(dict(pipes.extras or {}))

        def on_event(event: dict) -> None:
            line = describe(event)
            if line:
                pipes.log.info(line)
            for warning in event.get("warnings") or []:  # before training: the data cannot make a useful draft
                pipes.log.warning(f"{STAGE}: {warning}")

        job, form = with_chosen_form(job, pipes.log.info)
        result = run_training(job.train, nproc=job.nproc_per_node, on_event=on_event)
        metadata = export_and_gate(job, result, pipes.log.info)
        pipes.report_asset_materialization(metadata={**metadata, **form}, data_version=result["fingerprint"])


if __name__ == "__main__":
    main()
