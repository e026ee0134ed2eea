"""What ``evaluate_draft`` is told: the evaluation stage's job and its settings.

Pydantic models (:mod:`eagle3_assets.core.settings.job_schema`). The user-facing
settings are one model, ``EvaluationRecipe``: the ``draft_evaluation`` asset's
Dagster ``Config`` class is that model with Dagster's base mixed in, and the job
(``EvaluationJob``) is that model plus the fields the asset fills in with
:func:`given` (paths, the target's serving profile). The asset sends
``job.model_dump()`` as the Pipes extras (JSON) through the GPU host, which
carries it without reading it, and the stage reads it back with
``EvaluationJob.from_dict(extras)`` (strict ``model_validate``): an unknown,
missing or mistyped key is refused there, naming the key. Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.evaluation.gates import ACCEPTANCE_GATES
from eagle3_assets.core.evaluation.speculation_depth import DEFAULT_DRAFT_COST_RATIO, DEFAULT_K_VALUES
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.settings.job_schema import JobSchema, given, setting

EVAL_MAX_TOKENS = 128  # completion tokens per held-out prompt: enough decode steps to measure acceptance


class EvaluationRecipe(JobSchema):
    """How the drafts are served and judged: ``draft_evaluation``'s settings (its Dagster config is this class)."""

    k_values: list[int] = setting(
        list(DEFAULT_K_VALUES),
        "num_speculative_tokens to evaluate: the acceptance curve over them and the recommended k; the drafts are served at the largest",
    )
    measure_each_k: bool | None = setting(
        None,
        "serve the draft once per k and choose k by measured output tokens/s; default: on a GPU host yes, "
        "on a CPU no (one server at the largest k, smaller k derived from per-position rates, k chosen by the cost model)",
    )
    draft_cost_ratio: float = setting(
        DEFAULT_DRAFT_COST_RATIO,
        "the cost model's cost of one draft forward relative to one target step on the deployment's GPUs "
        "(used when throughput is not measured per k)",
        gt=0,
    )
    max_tokens: int = setting(EVAL_MAX_TOKENS, "completion tokens per prompt")
    # Greedy acceptance is argmax agreement; sampled, vLLM accepts a drafted token with the target's probability of it
    # (the draft proposing its argmax) or with min(1, p/q) (sampling its own q): a draft trained for one can differ at
    # another (the LK losses train the last), so measure as you serve (docs/evaluation.md).
    temperature: float = setting(
        0.0, "sampling temperature of every evaluation request: 0 greedy; above it each prompt is sampled with its position as seed", ge=0
    )
    draft_sample_method: str = setting(
        "greedy",
        "how the served draft proposes (vLLM's speculative_config): 'greedy' its argmax, accepted with the target's "
        "probability of it; 'probabilistic' a sample of its distribution, accepted with min(1, p/q); the serving notes use it too",
    )
    concurrency: int = setting(8, "requests in flight")
    floor: float = setting(
        ACCEPTANCE_GATES["acceptance_above_floor"].threshold, "acceptance_above_floor fails (ERROR) below this mean acceptance length"
    )
    baseline: str = setting(
        "starting",
        "'starting' (the draft draft_checkpoint fine-tuned from, as its run recorded; from scratch: 'untrained'), "
        "'untrained' (random draft of the same shape), a draft directory, or 'none': no baseline "
        "(each baseline is one more start of the target, an hour for a 1T target; the report then says it was turned off)",
    )
    # Opt-in: each set is one more pass per draft server, concurrent where vLLM counts per request and one prompt at a
    # time where not (which tripled the tiny target's evaluation time on a shared 2-core machine: docs/evaluation.md).
    prompt_sets: list[str] = setting(
        [],
        "built-in held-out sets scored beside the standard one, each built from the standard set's prompts only: "
        "'long_context' (long system prompts filling most of the context), 'template_perturbation' (other system "
        "prompts and turn layouts); []: none (opt-in: each set is one more pass of requests to the same servers)",
    )
    user_prompt_sets: dict[str, str] = setting(
        {}, "sets of your own scored beside the standard one: name -> prompts file (JSONL/Parquet with messages), held out of training"
    )
    long_context_fill: float = setting(0.8, "share of max_model_len less max_tokens a long_context prompt fills", gt=0, le=1)


class EvaluationJob(EvaluationRecipe):
    """Acceptance length of the trained draft and of a baseline, through vLLM (``evaluate_draft``)."""

    target_dir: str = given("the target's HF directory")
    serving: ServingProfile = given("how vLLM serves the target, remote code included (target_model's serving profile)")
    draft_dir: str = given("the exported draft")
    eval_prompts: str = given("the held-out prompt set (JSONL/Parquet) served")
    report_path: str = given("where the JSON report goes (written atomically)")
