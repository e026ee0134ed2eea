"""``refine_draft``: one on-policy refinement round of the served draft, on the GPU host (Dagster Pipes).

Its Pipes extras are a :class:`eagle3_assets.core.refinement.job.RefinementJob`.
The round, each phase's output under the round's directory
(:class:`~eagle3_assets.core.refinement.round.RoundPaths`):

1. **serve**: vLLM serves the target with the current draft in the target's
   serving profile, at ``num_speculative_tokens``, with each response's
   per-step counts (``--per-request-spec-decode-metrics detailed``), greedy: the
   held-in prompts (``served.parquet``: raw_responses' row with the server's
   token ids and per-step counts), then, on the same server, the held-out set
   (the starting draft's acceptance, ``served.json``): one start of the target;
2. **keep**: the completions through validated_traces' rules
   (:func:`~eagle3_assets.core.validation.shard_validation.validate_shard`):
   speculative decoding is lossless, so they are the target's own traces;
3. **extract**: their states with the existing extraction, one shard
   (``states/``), resuming from its durable parts;
4. **replay**: the current draft replayed on those states, its counts checked
   against the server's (refused below 95 %, the share named), the anchors
   written beside the states;
5. **train**: from the current draft (:func:`~eagle3_assets.core.refinement.training.round_training_config`),
   resuming from the run's checkpoints, exported in vLLM's form (``model/``);
6. **gate**: the refined draft served on the held-out set (``gate.json``), at
   the same k, max_tokens and concurrency as the starting draft's pass: the
   evaluation stage's own servers and passes (:mod:`~eagle3_assets.core.evaluation.acceptance`).

A phase whose record names the same inputs (a fingerprint) is not done again:
a rerun after a failure resumes where the first stopped.
The verdict (``refined_not_worse``) and which draft the round keeps are the
asset's, from the figures reported here.
"""

from __future__ import annotations

import time
from pathlib import Path

from eagle3_assets.core.refinement.job import RefinementJob

STAGE = "refine_draft"
# What the report keeps of the starting and the refined draft's held-out passes.
PASS_FIGURES = ("mean_acceptance_length", "acceptance_rate_per_position", "prompts", "failed", "by_output_position")


def _fingerprint(*parts) -> str:
    from eagle3_assets.core.storage.files import stable_hash

    return stable_hash(list(parts))


def serve(job: RefinementJob, paths, log) -> dict:
    """Phase 1: the held-in prompts and the held-out set served with the current draft (one start of the target)."""
    import polars as pl

    from eagle3_assets.core.evaluation.acceptance import evaluation_servers, load_conversations, run_pass
    from eagle3_assets.core.evaluation.spread import per_request_metrics_supported
    from eagle3_assets.core.refinement.round import phase_done, record_phase, serve_rows
    from eagle3_assets.core.serving.deployment import draft_weights_hash
    from eagle3_assets.core.storage.files import write_parquet_atomic

    prompts = pl.read_parquet(job.prompts, columns=["id", "messages"])
    _, held_out = load_conversations(job.eval_prompts)
    # By content, not by file: the asset writes the prompt files again on a rerun.
    fingerprint = _fingerprint(
        draft_weights_hash(job.start_draft), prompts.to_dicts(), held_out, job.max_tokens, job.eval_max_tokens,
        job.num_speculative_tokens, job.concurrency, job.target.serving.model_dump(),
    )  # fmt: skip
    done = phase_done(paths.served_record, fingerprint)
    if done and paths.served.is_file():
        log(f"{STAGE}: serve: resumed ({paths.served} was written for these inputs)")
        return {**done, "resumed": True}
    if not per_request_metrics_supported():
        raise RuntimeError(f"{STAGE}: this host's vLLM has no --per-request-spec-decode-metrics: the round cannot see where the draft was rejected")
    ((_, server),) = evaluation_servers(
        Path(job.target.path), {"current": Path(job.start_draft)}, job.num_speculative_tokens, profile=job.target.serving,
        include_reference=False, server_log_dir=paths.root, per_request_metrics=True,
    )  # fmt: skip
    started = time.monotonic()
    with server:
        log(f"{STAGE}: serve: {prompts.height} held-in prompts with {job.start_draft} at k = {job.num_speculative_tokens}, {job.concurrency} in flight")
        served = serve_rows(server.base_url, server.served_model_name, prompts, job.max_tokens, job.concurrency)
        serve_s = time.monotonic() - started
        log(f"{STAGE}: serve: the starting draft on {len(held_out)} held-out prompts")
        before = run_pass("starting", server.base_url, server.served_model_name, held_out, job.eval_max_tokens, job.concurrency)
    write_parquet_atomic(paths.served, served)
    return record_phase(paths.served_record, fingerprint, before=before.to_dict(), serve_s=round(serve_s, 1), resumed=False)


def keep(job: RefinementJob, paths, log):
    """Phase 2: the served completions through validated_traces' rules (cheap: redone on every run)."""
    from eagle3_assets.core.target.tokenizer import load_tokenizer
    from eagle3_assets.core.validation.chat_rendering import ChatRenderer
    from eagle3_assets.core.validation.shard_validation import ValidationRules, validate_shard

    renderer = ChatRenderer(load_tokenizer(job.target.path, job.target.trust_remote_code), job.think_open, job.think_close, job.end_of_turn)
    rules = ValidationRules(max_seq_len=job.context_length, allow_truncated=job.allow_truncated)
    summary = validate_shard(paths.served, Path(job.prompts), renderer, rules, paths.traces, paths.rejected)
    log(f"{STAGE}: keep: {summary.kept} of {summary.raw_rows} completions kept, rejected {summary.rejected_by_reason or 'none'}")
    if not summary.kept:
        raise ValueError(
            f"{STAGE}: no served completion passed validation ({summary.rejected_by_reason}; e.g. {summary.rejected_examples[:3]}): "
            "nothing to train on (truncated ones are kept only with allow_truncated)"
        )
    return summary


def extract(job: RefinementJob, paths, layer_ids: list[int], log):
    """Phase 3: the kept completions' states, one shard (the extraction resumes from its own durable parts)."""
    from eagle3_assets.core.extraction.backends import make_backend
    from eagle3_assets.core.extraction.job import ExtractionRecipe
    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.traces import read_traces
    from eagle3_assets.core.target.identity import config_hash

    traces = read_traces(paths.traces)
    recipe = ExtractionRecipe(backend=job.extraction_backend, dtype=job.extraction_dtype)
    settings = ExtractionSettings(
        target_path=job.target.path, target_config_hash=config_hash(job.target.path), aux_layer_ids=tuple(layer_ids), dtype=job.extraction_dtype
    )
    backend = make_backend(recipe, job.target, traces)
    try:
        report = extract_shard(traces, paths.states, settings, backend)
    finally:
        backend.close()
    log(f"{STAGE}: extract: {report.parts_written} part(s) written, {report.parts_reused} kept, {report.tokens_computed} tokens computed")
    return report


def replay(job: RefinementJob, paths, served_rows: dict, log) -> dict:
    """Phase 4: the current draft replayed on the stored states, checked against the server's counts, the anchors written."""
    from eagle3_assets.core.extraction.shard_reading import iter_samples
    from eagle3_assets.core.refinement.anchors import anchor_counts, anchor_mask, write_anchors
    from eagle3_assets.core.refinement.replay import agreement, check_agreement, draft_from_export, replay_request
    from eagle3_assets.core.refinement.round import request_steps
    from eagle3_assets.core.storage.files import write_json_atomic
    from eagle3_assets.core.target.head import load_head_weights

    draft = draft_from_export(job.start_draft, load_head_weights(job.target.path)["embed"])
    k = job.num_speculative_tokens
    replayed, masks, skipped = [], {}, {"no_steps": 0, "not_the_served_ids": 0}
    for sample in iter_samples(paths.states):
        row = served_rows[sample.id]
        steps = request_steps(row)
        if steps is None or not steps.adds_up():
            skipped["no_steps"] += 1
            continue
        prompt = len(row["prompt_token_ids"])
        if sample.input_ids.tolist() != [*row["prompt_token_ids"], *row["output_token_ids"]]:
            skipped["not_the_served_ids"] += 1  # validation keeps only the server's ids; a guard, not a path
            continue
        steps_replayed = replay_request(draft, sample.aux, sample.input_ids, prompt, steps, k)
        replayed.append(steps_replayed)
        masks[sample.id] = anchor_mask(steps_replayed, prompt, int(sample.input_ids.shape[0]), k)
    result = agreement(replayed)
    counts = {"accepted": 0, "rejected": 0, "chains": 0}
    for mask in masks.values():
        counts = {key: counts[key] + value for key, value in anchor_counts(mask).items()}
    record = {**result.to_dict(), "skipped": skipped, "anchors": counts}
    write_json_atomic(paths.replay, record)
    log(f"{STAGE}: replay: {result.agreeing} of {result.decided} decided steps agree with the server ({record['agreement']})")
    check_agreement(result)  # refuses the round below the threshold, naming the share
    write_anchors(paths.states, masks)
    return record


def train(job: RefinementJob, paths, draft_config, log) -> dict:
    """Phase 5: fine-tune the current draft on the round's states and a share of the supervised ones; export it."""
    from eagle3_assets.core.draft.forms import form_of
    from eagle3_assets.core.draft.model import norm_flags_of
    from eagle3_assets.core.refinement.training import round_training_config
    from eagle3_assets.core.serving.deployment import write_serving_notes
    from eagle3_assets.core.training.checkpoints import export_trained_draft
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.launch import run_training
    from eagle3_assets.stages.train_draft import describe

    # The starting draft's form and norms, so fine-tuning adds none (a norm added at weight 1 changes what it computes).
    recipe = TrainConfig(
        hidden_state_dirs=[], vocab_mapping=job.vocab_mapping, target_path=job.target.path, training_dir=str(paths.training),
        epochs=job.epochs, learning_rate=job.learning_rate, warmup_ratio=job.warmup_ratio, ttt_steps=job.ttt_steps,
        batch_tokens=job.batch_tokens, max_seq_len=job.max_seq_len, seed=job.seed, draft_form=form_of(draft_config),
        **norm_flags_of(draft_config),
    )  # fmt: skip
    config = round_training_config(recipe, job.start_draft, [paths.states], job.supervised_dirs, job.supervised_share, job.loss)

    def on_event(event: dict) -> None:
        line = describe(event)
        if line:
            log(line.replace("train_draft:", f"{STAGE}: train:"))

    result = run_training(config, on_event=on_event)
    export_trained_draft(result["checkpoint"], job.target.path, paths.model)
    write_serving_notes(paths.model, target=job.target.path, num_speculative_tokens=job.num_speculative_tokens, profile=job.target.serving)
    return result


def gate(job: RefinementJob, paths, log) -> dict:
    """Phase 6: the refined draft on the held-out set, served as the starting draft was (one start of the target)."""
    from eagle3_assets.core.evaluation.acceptance import evaluation_servers, load_conversations, run_pass
    from eagle3_assets.core.refinement.round import phase_done, record_phase
    from eagle3_assets.core.serving.deployment import draft_weights_hash

    _, held_out = load_conversations(job.eval_prompts)
    fingerprint = _fingerprint(
        draft_weights_hash(paths.model), held_out, job.eval_max_tokens, job.num_speculative_tokens, job.concurrency, job.target.serving.model_dump()
    )
    done = phase_done(paths.gate_record, fingerprint)
    if done:
        log(f"{STAGE}: gate: resumed ({paths.gate_record} was measured on this refined draft)")
        return done
    ((_, server),) = evaluation_servers(
        Path(job.target.path), {"refined": paths.model}, job.num_speculative_tokens, profile=job.target.serving,
        include_reference=False, server_log_dir=paths.root, per_request_metrics=True,
    )  # fmt: skip
    with server:
        log(f"{STAGE}: gate: the refined draft on {len(held_out)} held-out prompts")
        after = run_pass("refined", server.base_url, server.served_model_name, held_out, job.eval_max_tokens, job.concurrency)
    return record_phase(paths.gate_record, fingerprint, after=after.to_dict())


def run_round(job: RefinementJob, log) -> dict:
    """Every phase in order, holding the round's lease; the figures the materialisation reports."""
    from eagle3_assets.core.refinement.round import ASSET as ROUNDS
    from eagle3_assets.core.refinement.round import RoundPaths
    from eagle3_assets.core.storage.shard_lease import ShardLease

    paths = RoundPaths(Path(job.round_dir))
    # One writer per round: a killed run's lease names a dead pid, so the rerun takes it over and removes that run's
    # partial files (logged), and the GPU host's pre-flight reads them as a dead writer's, not as a reason to refuse.
    with ShardLease(paths.root.parent, paths.root.name, asset=ROUNDS, log=log):
        return _run_round(job, paths, log)


def _run_round(job: RefinementJob, paths, log) -> dict:
    import polars as pl

    from eagle3_assets.core.draft.export import draft_config_from_hf, read_draft_dir
    from eagle3_assets.core.refinement.round import rejections, request_steps
    from eagle3_assets.core.serving.deployment import draft_weights_hash
    from eagle3_assets.core.storage.files import write_json_atomic

    paths.root.mkdir(parents=True, exist_ok=True)
    draft_config, layer_ids = draft_config_from_hf(read_draft_dir(Path(job.start_draft))[0], job.start_draft)
    started = time.monotonic()
    served_record = serve(job, paths, log)
    served = {row["id"]: row for row in pl.read_parquet(paths.served).iter_rows(named=True)}
    summary = keep(job, paths, log)
    extract(job, paths, layer_ids or job.target.aux_layer_ids, log)
    replay_record = replay(job, paths, served, log)
    result = train(job, paths, draft_config, log)
    after = gate(job, paths, log)["after"]
    before = served_record["before"]
    where = rejections([request_steps(row) for row in served.values()], job.num_speculative_tokens)
    report = {
        "round": job.round,
        "start_draft": job.start_draft,
        "start_draft_weights_hash": draft_weights_hash(job.start_draft),
        "refined_draft": str(paths.model),
        "refined_draft_weights_hash": draft_weights_hash(paths.model),
        "served_prompts": len(served),
        "failed_requests": sum(1 for row in served.values() if row["error"] is not None),
        "kept_traces": summary.kept,
        "rejected_by_reason": summary.rejected_by_reason,
        "replay": replay_record,
        "rejections": where,
        "training": {key: result.get(key) for key in ("fingerprint", "init", "resumed_from", "schedule", "source", "tokens_per_s")},
        "acceptance_before": before["mean_acceptance_length"],
        "acceptance_after": after["mean_acceptance_length"],
        "before": {key: before.get(key) for key in PASS_FIGURES},
        "after": {key: after.get(key) for key in PASS_FIGURES},
        "serve_resumed": bool(served_record.get("resumed")),
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json_atomic(paths.report, report)
    return report


def main() -> None:
    from dagster_pipes import open_dagster_pipes

    from eagle3_assets.core.evaluation.output_position import render_position_table
    from eagle3_assets.core.refinement.round import render_rejections

    with open_dagster_pipes() as pipes:
        job = RefinementJob.from_dict(dict(pipes.extras or {}))
        report = run_round(job, pipes.log.info)
        replayed = report["replay"]
        json_value = lambda value: {"raw_value": value, "type": "json"}  # noqa: E731
        pipes.report_asset_materialization(
            metadata={
                "round": report["round"],
                "acceptance_before": report["acceptance_before"],
                "acceptance_after": report["acceptance_after"],
                "replay_agreement": replayed["agreement"],
                "replay_steps": replayed["decided_steps"],
                "rejections": report["rejections"]["rejections"],
                "verify_steps": report["rejections"]["steps"],
                "served_prompts": report["served_prompts"],
                "failed_requests": report["failed_requests"],
                "kept_traces": report["kept_traces"],
                "rejected_by_reason": json_value(report["rejected_by_reason"]),
                "rejections_where": {"raw_value": render_rejections(report["rejections"]), "type": "md"},
                "rejections_by_position": json_value(report["rejections"]["by_position"]),
                "rejections_by_output_position": json_value(report["rejections"]["by_output_position"]),
                "anchors": json_value(replayed["anchors"]),
                "acceptance_by_output_position": {
                    "raw_value": render_position_table({"starting": report["before"]["by_output_position"], "refined": report["after"]["by_output_position"]}),
                    "type": "md",
                },
                "acceptance_per_position": json_value(
                    {"before": report["before"]["acceptance_rate_per_position"], "after": report["after"]["acceptance_rate_per_position"]}
                ),
                "start_draft_weights_hash": report["start_draft_weights_hash"],
                "refined_draft_weights_hash": report["refined_draft_weights_hash"],
                "refined_draft": {"raw_value": report["refined_draft"], "type": "path"},
                "training": json_value(report["training"]),
                "serve_resumed": report["serve_resumed"],
                "round_wall_s": report["wall_s"],
            },
            data_version=report["refined_draft_weights_hash"],
        )


if __name__ == "__main__":
    main()
