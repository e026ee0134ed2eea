"""Typed stage jobs: each setting's default and description are written once, and a bad job is refused naming the key.

The Dagster ``Config`` classes and the vLLM server resource are the Dagster-free
pydantic settings models (each stage's ``core/<domain>/job.py``, ``TrainConfig``,
``GenerationSettings``) or take their fields from them; these tests hold them
to it, and send a bad job to a real stage through the GPU host resource (local
mode).
"""

from pathlib import Path

import pytest
from dagster import AssetExecutionContext, DagsterEventType, DagsterInstance, asset, materialize

from eagle3_assets.core.generation.config import GenerationSettings, Sampling
from eagle3_assets.core.settings.job_schema import setting_names
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements
from eagle3_assets.core.evaluation.job import EvaluationJob, EvaluationRecipe
from eagle3_assets.core.extraction.job import ExtractionJob, ExtractionRecipe, ExtractionShard, ShardRerun, StageTarget
from eagle3_assets.core.training.job import (
    BoundedRun,
    BoundedWindow,
    ExportGates,
    HiddenStatesSource,
    StreamedShard,
    TrainingJob,
    TrainingStageRecipe,
)
from eagle3_assets.core.training.config import TrainConfig, TrainingRecipe
from eagle3_assets.defs.draft_checkpoint import DraftTrainingConfig
from eagle3_assets.defs.draft_evaluation import DraftEvaluationConfig
from eagle3_assets.defs.hidden_states import HiddenStatesConfig
from eagle3_assets.core.refinement.job import RefinementJob, RefinementRecipe
from eagle3_assets.defs.refinement_round import RefinementRoundConfig
from resources.gpu_host import GPUHost
from resources.vllm_server import VLLMServerResource

REPO = Path(__file__).resolve().parents[1]

# (Dagster class, the models its fields come from, its own fields, the models' settings it does not show)
SOURCES = [
    # accept_unknown_capacity: the orchestrator's refusal of a run it cannot judge (capacity_facts), not sent to the stage
    (HiddenStatesConfig, [ExtractionJob], {"accept_unknown_capacity"}, set()),
    (
        DraftTrainingConfig,
        [TrainConfig, TrainingJob, HiddenStatesSource, BoundedRun],
        # streamed_extraction: a HiddenStatesConfig (its fields are ExtractionJob's); shards: chosen on the orchestrator
        {"streamed_extraction", "shards"},
        # Recipe constants and run mechanics a launchpad user has no reason to change; the CLI and tests can.
        # supervised_dirs, supervised_share: a refinement round's mix (core/refinement/training.py), not draft_checkpoint's.
        {
            "betas", "head_from_target", "bf16_autocast", "draft_num_attention_heads", "draft_num_key_value_heads",
            "draft_head_dim", "log_every", "keep_checkpoints", "torch_threads", "gates", "bounded",
            "supervised_dirs", "supervised_share",
        },
    ),  # fmt: skip
    (DraftEvaluationConfig, [EvaluationJob], {"eval_prompts", "max_eval_prompts"}, set()),
    (RefinementRoundConfig, [RefinementJob], set(), set()),
    (
        VLLMServerResource,
        # The resource's own bases; GenerationConfig takes max_tokens resolved (unset here: what the target's context leaves).
        [GenerationSettings, Sampling],
        {"base_urls", "served_model_name", "canary_prompt", "canary_max_tokens", "progress_interval_s"},
        {"sampling"},  # shown field by field (Sampling)
    ),
]


def settings(cls) -> dict:
    """The model's fields that have a default: what a user may set (the rest the asset fills in)."""
    return {name: cls.model_fields[name] for name in setting_names(cls)}


@pytest.mark.parametrize("config_class, sources, own, hidden", SOURCES, ids=[s[0].__name__ for s in SOURCES])
def test_config_fields_are_the_settings_with_their_defaults_and_descriptions(config_class, sources, own, hidden):
    fields = config_class.model_fields
    for name, field in fields.items():
        assert field.description, f"{config_class.__name__}.{name} has no description"
    by_source = [(source, settings(source)) for source in sources]
    for name in set(fields) - own:
        homes = [(source, found[name]) for source, found in by_source if name in found]
        assert len(homes) == 1, f"{config_class.__name__}.{name} is a setting of {[s.__name__ for s, _ in homes]}, expected exactly one"
        source, setting = homes[0]
        default = fields[name].get_default(call_default_factory=True)
        assert default == setting.get_default(call_default_factory=True), f"{config_class.__name__}.{name}: default differs from {source.__name__}'s"
        assert fields[name].description == setting.description, f"{config_class.__name__}.{name}: description differs"
        assert fields[name].metadata == setting.metadata, f"{config_class.__name__}.{name}: limits differ"
    shown = set(fields)
    for source, found in by_source:
        unshown = set(found) - shown - hidden
        assert not unshown, f"{source.__name__} settings {sorted(unshown)} are not in {config_class.__name__}"
    assert not hidden & shown


@pytest.mark.parametrize(
    "config_class, models",
    [
        (HiddenStatesConfig, [ExtractionRecipe, ShardRerun]),
        (DraftTrainingConfig, [TrainingRecipe, TrainingStageRecipe, HiddenStatesSource, BoundedWindow]),
        (DraftEvaluationConfig, [EvaluationRecipe]),
        (RefinementRoundConfig, [RefinementRecipe]),
        (VLLMServerResource, [GenerationSettings, Sampling]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_the_dagster_config_is_the_settings_model_itself(config_class, models):
    """No field re-listed: the Config class (or resource) is the settings model with Dagster's base mixed in."""
    for model in models:
        assert issubclass(config_class, model)
        for name in model.model_fields:
            assert name not in config_class.__dict__.get("__annotations__", {}), f"{config_class.__name__} lists {name} again"


def test_the_launchpad_shows_the_schema_defaults_and_descriptions():
    """What Dagster makes of the mixed-in model: the field, its default and description as written in the model."""
    from dagster._config.pythonic_config import infer_schema_from_config_class

    fields = infer_schema_from_config_class(HiddenStatesConfig).config_type.fields
    recipe = ExtractionRecipe.model_fields["max_batch_tokens"]
    assert fields["max_batch_tokens"].default_value == recipe.default == 16384
    assert fields["max_batch_tokens"].description == recipe.description
    assert fields["recompute"].default_value is False and fields["cpu_threads"].default_value == 0
    with pytest.raises(ValueError, match="max_batch_tokens"):
        HiddenStatesConfig(max_batch_tokens=0)  # the model's limit holds in the launchpad's config too


def test_a_config_with_no_overrides_makes_the_stage_job_with_the_one_defaults():
    job = ExtractionJob(
        shards=[ExtractionShard(shard="shard-00000", traces="t.parquet", output="out", data_version="v", check_seed=1)],
        target=StageTarget(path="/t", trust_remote_code=False, aux_layer_ids=[1, 2, 3], config_hash="h", serving=ServingProfile()),
    )  # fmt: skip
    assert ExtractionJob(**{**job.model_dump(), **HiddenStatesConfig().stage_settings()}) == job
    assert job.max_batch_tokens == HiddenStatesConfig().max_batch_tokens == 16384  # one default, whichever backend


def test_a_job_survives_json_to_the_stage_and_back():
    train = TrainConfig(hidden_state_dirs=["a", "b"], vocab_mapping="v", target_path="t", training_dir="d", epochs=3)
    job = TrainingJob(
        train=train, export_dir="e", gates=ExportGates(aux_layer_ids=[2, 3, 4], target_vocab_size=640, log_path=None, serving=ServingProfile(tensor_parallel_size=8))
    )
    back = TrainingJob.from_json(job.model_dump_json())
    assert back == job and back.train.betas == (0.9, 0.95) and isinstance(back.gates, ExportGates)
    evaluation = EvaluationJob(
        target_dir="t", draft_dir="d", eval_prompts="p.jsonl", report_path="r.json",
        serving=ServingProfile(tensor_parallel_size=8, trust_remote_code=True, extra_engine_args={"enable_expert_parallel": True}),
    )  # fmt: skip
    assert EvaluationJob.from_json(evaluation.model_dump_json()) == evaluation
    bounded = TrainingJob(
        train=train, export_dir="e",
        bounded=BoundedRun(
            shards=[StreamedShard(key="s", traces="s.parquet", data_version="v")], window_dir="w",
            target=StageTarget(path="/t", trust_remote_code=False, aux_layer_ids=[2, 3, 4], config_hash="h", serving=ServingProfile()),
            extraction=ExtractionRecipe(dtype="float8_e4m3fn"),
        ),
    )  # fmt: skip
    back = TrainingJob.from_json(bounded.model_dump_json())
    assert back == bounded and isinstance(back.bounded.shards[0], StreamedShard) and back.bounded.window_shards == 2


def extraction_extras(**changes) -> dict:
    raw = {
        "shards": [
            {"shard": "shard-00000", "traces": "validated_traces/shard-00000.parquet", "output": "hidden_states/shard-00000", "data_version": "v", "check_seed": 7},
        ],
        "target": {"path": "/t", "trust_remote_code": False, "aux_layer_ids": [2, 3, 4], "config_hash": "h", "serving": ServingProfile().model_dump()},
    }  # fmt: skip
    return {**raw, **changes}


@pytest.mark.parametrize(
    "extras, message",
    [
        (extraction_extras(max_batch_token=65536), "ExtractionJob: unknown setting(s) ['max_batch_token']"),
        (extraction_extras(max_batch_tokens="16384"), "setting ExtractionJob.max_batch_tokens is '16384': Input should be a valid integer"),
        (extraction_extras(recompute="yes"), "setting ExtractionJob.recompute is 'yes': Input should be a valid boolean"),
        (
            extraction_extras(target={**extraction_extras()["target"], "serving": {**ServingProfile().model_dump(), "gpu_memory_utilization": 1.5}}),
            "setting ExtractionJob.target.serving.gpu_memory_utilization is 1.5: Input should be less than or equal to 1",
        ),
        ({k: v for k, v in extraction_extras().items() if k != "shards"}, "ExtractionJob: missing setting(s) ['shards']"),
        (
            extraction_extras(target={**extraction_extras()["target"], "aux_layer_ids": [2, "x"]}),
            "setting ExtractionJob.target.aux_layer_ids[1] is 'x': Input should be a valid integer",
        ),
    ],
    ids=["unknown", "mistyped", "not-a-bool", "out-of-range", "missing", "nested"],
)
def test_a_bad_extraction_job_is_refused_naming_the_key(extras, message):
    with pytest.raises(ValueError) as refused:
        ExtractionJob.from_dict(extras)
    assert message in str(refused.value)


def test_a_bad_training_setting_is_refused_inside_the_job():
    raw = TrainingJob(train=TrainConfig(hidden_state_dirs=["a"], vocab_mapping="v", target_path="t", training_dir="d"), export_dir="e").model_dump()
    raw["train"]["epoch"] = 3
    with pytest.raises(ValueError, match=r"TrainingJob.train: unknown setting\(s\) \['epoch'\]"):
        TrainingJob.from_dict(raw)


def test_the_real_stage_refuses_a_bad_job_with_the_key_in_the_run_error():
    """A job with a misspelt key sent to the real ``extract_hidden_states`` stage (local GPU host): the step fails
    before anything is loaded, and the error the run shows names the key."""

    @asset(name="bad_job")
    def bad_job(context: AssetExecutionContext, gpu_host: GPUHost):
        requirements = StageRequirements(modules=[], cpu_allowed=True, output_dirs=["hidden_states"])
        return gpu_host.run_stage(context, "extract_hidden_states", extraction_extras(max_batch_token=65536), requirements=requirements)

    host = GPUHost(mode="local", working_dir=str(REPO))
    result = materialize([bad_job], resources={"gpu_host": host}, instance=DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    message = failure.step_failure_data.error.cause.message
    assert "stage extract_hidden_states on local failed" in message
    assert "ExtractionJob: unknown setting(s) ['max_batch_token']" in message, message[-2000:]
