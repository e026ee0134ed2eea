"""``evaluate_draft``: acceptance length of the trained draft and of a baseline, through vLLM (Dagster Pipes).

Runs on the GPU host, where the target can be served. Extras:

- ``target_dir``, ``draft_dir``: the target and the exported draft;
- ``target_trust_remote_code``, ``max_model_len`` (0: the target's context): how vLLM serves the target;
- ``baseline``: ``"untrained"`` (a random draft of the same shape, built here)
  or the directory of the draft training started from;
- ``eval_prompts``: a held-out prompt set (JSONL/Parquet);
- ``num_speculative_tokens``, ``max_tokens``, ``concurrency``, ``floor``;
- ``report_path``: where the JSON report goes (written atomically).

Reports the materialisation and the ``acceptance_above_floor`` check.
"""

from __future__ import annotations

STAGE = "evaluate_draft"
CPU_NOTE = (
    "speedup is a GPU figure: on a CPU a tiny draft costs about as much as the tiny target, "
    "so output tokens/s with the draft can be below the target alone; acceptance length is the portable figure"
)


def judge(trained: float, baseline: float, floor: float) -> tuple[bool, str, str]:
    """(passed, severity, message) of ``acceptance_above_floor``: ERROR below the floor, WARN if no better than baseline."""
    if trained < floor:
        return False, "ERROR", f"mean acceptance length {trained:.2f} is below the floor {floor:.2f}"
    if trained <= baseline:
        return False, "WARN", f"the trained draft ({trained:.2f}) does not beat the baseline ({baseline:.2f})"
    return True, "ERROR", f"mean acceptance length {trained:.2f} >= floor {floor:.2f}, baseline {baseline:.2f}"


def main() -> None:
    from pathlib import Path

    from dagster_pipes import open_dagster_pipes

    from eagle3_assets.core.evaluation import evaluate, load_conversations, render_positions, untrained_twin
    from eagle3_assets.core.storage import stable_hash, write_json_atomic
    from eagle3_assets.core.target import vllm_serving

    with open_dagster_pipes() as pipes:
        extras = dict(pipes.extras or {})
        report_path = Path(extras["report_path"])
        work = report_path.parent
        draft_dir = Path(extras["draft_dir"])
        if extras.get("baseline", "untrained") == "untrained":
            baseline_dir = untrained_twin(draft_dir, work / "baseline_draft")
            baseline_label = "untrained draft of the same shape"
        else:
            baseline_dir = Path(extras["baseline"])
            baseline_label = f"starting checkpoint {baseline_dir}"
        ids, conversations = load_conversations(extras["eval_prompts"])
        pipes.log.info(f"{STAGE}: {len(conversations)} held-out prompts, {extras['num_speculative_tokens']} speculative tokens")
        results = evaluate(
            Path(extras["target_dir"]),
            {"trained": draft_dir, "baseline": baseline_dir},
            conversations,
            num_speculative_tokens=int(extras["num_speculative_tokens"]),
            max_tokens=int(extras["max_tokens"]),
            concurrency=int(extras["concurrency"]),
            server_log_dir=work,
            log=pipes.log.info,
            serving=vllm_serving(extras["target_dir"], bool(extras.get("target_trust_remote_code")), int(extras.get("max_model_len") or 0)),
        )
        trained, baseline, reference = results["trained"], results["baseline"], results["reference"]
        speedup = trained.output_tokens_per_s / reference.output_tokens_per_s if reference.output_tokens_per_s else 0.0
        report = {
            "num_speculative_tokens": int(extras["num_speculative_tokens"]),
            "prompts": len(conversations),
            "prompt_ids": ids,
            "eval_prompts": extras["eval_prompts"],
            "baseline": baseline_label,
            "results": {label: r.to_dict() for label, r in results.items()},
            "speedup_vs_target_alone": speedup,
            "note": CPU_NOTE,
        }
        write_json_atomic(report_path, report)
        passed, severity, message = judge(trained.mean_acceptance_length, baseline.mean_acceptance_length, float(extras["floor"]))
        pipes.log.info(f"{STAGE}: {message}")
        figures = {
            "mean_acceptance_length": round(trained.mean_acceptance_length, 4),
            "baseline_mean_acceptance_length": round(baseline.mean_acceptance_length, 4),
            "floor": float(extras["floor"]),
        }
        pipes.report_asset_materialization(
            metadata={
                **figures,
                "acceptance_rate_per_position": {
                    "raw_value": render_positions(
                        {"trained": trained.acceptance_rate_per_position or [], "baseline": baseline.acceptance_rate_per_position or []}
                    ),
                    "type": "md",
                },
                "output_tokens_per_s": round(trained.output_tokens_per_s, 1),
                "target_alone_output_tokens_per_s": round(reference.output_tokens_per_s, 1),
                "speedup": round(speedup, 3),
                "speedup_note": CPU_NOTE,
                "report": {"raw_value": str(report_path), "type": "path"},
            },
            data_version=stable_hash({"report": report["results"], "draft": str(draft_dir)}),
        )
        pipes.report_asset_check(
            check_name="acceptance_above_floor",
            passed=passed,
            severity=severity,
            metadata={**figures, "message": message},
        )


if __name__ == "__main__":
    main()
