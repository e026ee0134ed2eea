"""``draft_evaluation``: the draft's mean acceptance length, measured through vLLM speculative decoding.

On held-out prompts (never in a training shard), the GPU host serves the target
alone, with the trained draft, and with a baseline draft unless ``baseline: none``
(stage ``evaluate_draft``; each is one start of the target), reading vLLM's spec-decode counters around each pass.
By default the prompts are the user's own: the rows ``prompts`` held out of
training (``prompt_dataset.holdout_share``), written to
``<data>/draft_evaluation/eval_prompts.jsonl`` so the report says exactly which.
The target is served as it is configured (remote code, its dtype, a context it
has). The drafts are served at the largest of ``k_values`` (default 1 to 5);
the acceptance curve over k and the recommended ``num_speculative_tokens``
(:mod:`eagle3_assets.core.evaluation.speculation_depth` says how each is obtained) go
into the metadata, and the exported draft's ``SERVING.md`` is rewritten to use
that k. Beside the standard set, the same trained and baseline servers score the
built-in held-out sets (``prompt_sets``: long context, template perturbation,
built by the stage from the standard set only) and the user's own
(``user_prompt_sets``, checked against the training shards here), each per prompt
(:mod:`eagle3_assets.core.evaluation.prompt_sets`); the gate stays on the standard set.
The standard set's spread over prompts (how far its mean can be trusted) comes with the default
report, from each response's own spec-decode counts in the same concurrent pass
(:mod:`eagle3_assets.core.evaluation.spread`).
Writes ``<data>/draft_evaluation/report.json``. The gate
``acceptance_above_floor`` (declared in :mod:`eagle3_assets.core.evaluation.gates`)
is ERROR below the floor and WARN when the trained draft does not beat the baseline: by default the draft training started from
(a fine-tuned draft against its starting checkpoint), an untrained one of the
same shape for a draft trained from scratch.
"""

import json
from pathlib import Path

import polars as pl
from dagster import AssetExecutionContext, AssetKey, Config, MaterializeResult, asset
from pydantic import Field

from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.evaluation.acceptance import load_conversations
from eagle3_assets.core.evaluation.prompt_sets import BUILTIN_SETS, STANDARD
from eagle3_assets.core.prompts.heldout import held_out_prompts, question_text
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements, with_serving_need
from eagle3_assets.core.storage.shard_files import read_shard_parquet
from eagle3_assets.core.storage.shard_paths import DRAFT_CONFIG_FILE, RESULT_FILE, DatasetPaths, training_shards
from eagle3_assets.core.evaluation.speculation_depth import validated_k_values
from eagle3_assets.core.settings.job_schema import values_of
from eagle3_assets.core.evaluation.gates import ACCEPTANCE_GATES
from eagle3_assets.core.evaluation.job import EvaluationJob, EvaluationRecipe
from eagle3_assets.core.serving.deployment import DRAFT_SAMPLE_METHODS
from eagle3_assets.core.storage.files import asset_dir, write_bytes_atomic
from resources.gpu_host import GPU_POOL, GPUHost, register_stage
from resources.target_model import TargetModel

STAGE = "evaluate_draft"
# Computed by the stage and reported over Pipes, with the severity the gate declares for the way it failed.
CHECKS = AssetChecks(ACCEPTANCE_GATES)
EVALUATION_REQUIREMENTS = register_stage(
    STAGE, StageRequirements(modules=["vllm", "torch", "openai", "dagster_pipes"], output_dirs=["draft_evaluation"], serves_target=True)
)


class DraftEvaluationConfig(EvaluationRecipe, Config):
    """Which held-out prompts (here), and how the drafts are served and judged (:class:`~eagle3_assets.core.evaluation.job.EvaluationRecipe`)."""

    eval_prompts: str = Field(
        default="",
        description="held-out prompt set (JSONL/Parquet path), or empty: the target's own held-out set where it comes "
        "with one, else the rows the prompts asset held out of training (prompt_dataset.holdout_share)",
    )
    max_eval_prompts: int = Field(default=64, gt=0, description="at most this many held-out prompts are served")


def resolve_eval_prompts(source: str, target_model: TargetModel, limit: int) -> str:
    """The path of the evaluation prompt set, writing the held-out rows to a file when ``source`` is empty
    and the target comes with no held-out set of its own."""
    if source:
        return source
    builtin = target_model.builtin_eval_prompts()
    if builtin:
        return builtin
    rows = held_out_prompts(asset_dir("prompts"), limit)
    if rows.is_empty():
        raise ValueError(
            "draft_evaluation has no held-out prompts: no materialised prompts shard holds any "
            "(prompt_dataset.holdout_share is 0, or no prompts shard is materialised); raise holdout_share and "
            "materialise prompts again, or set draft_evaluation eval_prompts to a held-out JSONL/Parquet file"
        )
    path = DatasetPaths().eval_prompts
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, "".join(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in rows.iter_rows(named=True)).encode())
    return str(path)


def resolve_baseline(setting: str, training_result: Path) -> str:
    """``'starting'``: the directory the exported draft was fine-tuned from (its run's ``result.json`` says), else
    ``'untrained'``. So a fine-tuned draft (one given EAGLE 3.1's norms, say) is judged against the draft it started as."""
    if setting != "starting":
        return setting
    source = json.loads(training_result.read_text()).get("init", {}).get("source", "scratch") if training_result.is_file() else "scratch"
    return "untrained" if source == "scratch" else source


def training_overlap(eval_ids: list[str], eval_conversations: list[list[dict]], prompts_dir: Path) -> list[str]:
    """Held-out prompts that also occur (by id or by text) in a training shard."""
    shards = training_shards(prompts_dir)
    if not shards:
        return []
    seen = pl.concat([read_shard_parquet(p, asset="prompts", columns=["id", "messages"]) for p in shards])
    seen_ids = set(seen["id"].to_list())
    seen_texts = {question_text(m) for m in seen["messages"].to_list() if m}
    return [i for i, conv in zip(eval_ids, eval_conversations) if i in seen_ids or question_text(conv) in seen_texts]


def check_prompt_sets(builtin: list[str], user_sets: dict[str, str], prompts_dir: Path) -> None:
    """Refuse an unknown built-in set, a user set named like another, and a user set that is not held out of training.

    The built-in sets are built by the stage from the standard set alone (:mod:`~eagle3_assets.core.evaluation.prompt_sets`).
    """
    unknown = [n for n in builtin if n not in BUILTIN_SETS]
    if unknown:
        raise ValueError(f"draft_evaluation prompt_sets {unknown}: the built-in sets are {list(BUILTIN_SETS)}; a file goes in user_prompt_sets")
    for name, source in user_sets.items():
        if name in (STANDARD, *BUILTIN_SETS):
            raise ValueError(f"draft_evaluation user_prompt_sets: {name!r} is a built-in set's name; name your set otherwise")
        set_ids, set_conversations = load_conversations(source)
        overlap = training_overlap(set_ids, set_conversations, prompts_dir)
        if overlap:
            raise ValueError(
                f"draft_evaluation user_prompt_sets {name!r} ({source}) is not held out: {len(overlap)} prompts also occur "
                f"in training shards, e.g. {overlap[:5]}"
            )


@asset(
    group_name="evaluation",
    code_version="3",
    kinds={"vllm"},
    pool=GPU_POOL,
    deps=[AssetKey("draft_checkpoint")],
    check_specs=CHECKS.specs(),
)
def draft_evaluation(
    context: AssetExecutionContext, config: DraftEvaluationConfig, target_model: TargetModel, gpu_host: GPUHost
) -> MaterializeResult:
    """Mean acceptance length and per-position acceptance of the trained draft and of a baseline, through vLLM."""
    if config.draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_evaluation draft_sample_method {config.draft_sample_method!r}: one of {', '.join(DRAFT_SAMPLE_METHODS)}")
    eval_prompts = resolve_eval_prompts(config.eval_prompts, target_model, config.max_eval_prompts)
    ids, conversations = load_conversations(eval_prompts)
    context.log.info(f"evaluating on {len(ids)} held-out prompts from {eval_prompts}")
    overlap = training_overlap(ids, conversations, asset_dir("prompts"))
    if overlap:
        raise ValueError(f"evaluation prompts {eval_prompts} are not held out: {len(overlap)} also occur in training shards, e.g. {overlap[:5]}")
    check_prompt_sets(config.prompt_sets, config.user_prompt_sets, asset_dir("prompts"))
    draft_dir = DatasetPaths().draft_model
    if not (draft_dir / DRAFT_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no exported draft at {draft_dir}: materialise draft_checkpoint first")
    baseline = resolve_baseline(config.baseline, DatasetPaths().training_dir / RESULT_FILE)
    context.log.info(f"baseline draft: {baseline}")
    job = EvaluationJob(
        target_dir=target_model.host_path(),
        serving=target_model.serving_profile(),
        draft_dir=str(draft_dir),
        eval_prompts=eval_prompts,
        report_path=str(DatasetPaths().evaluation_report),
        **{**values_of(config, EvaluationRecipe), "k_values": validated_k_values(config.k_values), "baseline": baseline},
    )
    # The stage serves the target as its profile says: its GPUs and their free memory are checked before anything starts.
    requirements = with_serving_need(EVALUATION_REQUIREMENTS, target_model.gpu_need())
    invocation = gpu_host.run_stage(context, STAGE, job.model_dump(), requirements=requirements)
    return invocation.get_materialize_result()
