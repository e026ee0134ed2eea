"""The GPU stages' jobs: what ``extract_hidden_states``, ``train_draft`` and ``evaluate_draft`` are told.

Pydantic models (:mod:`eagle3_assets.core.settings.job_schema`). A stage's user-facing
settings are one model (``ExtractionRecipe``, ``EvaluationRecipe``; ``draft_checkpoint``'s are
``TrainingRecipe``, ``TrainingStageRecipe``, ``HiddenStatesSource`` and ``BoundedWindow``): the
asset's Dagster ``Config`` class *is* that model with Dagster's base mixed in
(``class HiddenStatesConfig(ExtractionRecipe, Config)``), and the job is that
model plus the fields the asset fills in with :func:`given` (paths, the target,
the shard). The asset sends ``job.model_dump()`` as the Pipes extras (JSON),
and the stage reads it back with ``Job.from_dict(extras)`` (strict
``model_validate``): an unknown, missing or mistyped key is refused there,
naming the key. Every setting has its one default, description and limits here.
Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.settings.job_schema import JobSchema, given, setting
from eagle3_assets.core.evaluation.speculation_depth import DEFAULT_DRAFT_COST_RATIO, DEFAULT_K_VALUES
from eagle3_assets.core.extraction.state_layout import BACKENDS, DEFAULT_PART_BYTES, FP8_DTYPE, STORAGE_DTYPE_BYTES
from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.core.training.config import TrainConfig

EVAL_MAX_TOKENS = 128  # completion tokens per held-out prompt: enough decode steps to measure acceptance


class StageTarget(JobSchema):
    """The target as the orchestrator configured it (``TargetModel.stage_extras``)."""

    path: str = given("the target's HF directory on the GPU host")
    trust_remote_code: bool = given("load the target's own modelling and tokenizer code")
    aux_layer_ids: list[int] = given("the layers whose states the draft reads (vLLM's convention)")
    config_hash: str = given("what the orchestrator saw; the stage records the identity of the model it loads itself")
    serving: ServingProfile = given("how vLLM serves the target (target_model's serving profile)")


class ExtractionRecipe(JobSchema):
    """How states are extracted and gated: ``hidden_states``' settings, shared by offline and bounded-disk mode."""

    backend: str = setting("transformers", f"one of {BACKENDS}; 'vllm' for targets too large for transformers")
    dtype: str = setting(
        "bfloat16",
        f"storage precision of the states, one of {sorted(STORAGE_DTYPE_BYTES)}; '{FP8_DTYPE}' stores 8-bit codes "
        "with a float32 scale per token and state: half the bytes of bfloat16, dequantised to float32 for training",
    )
    part_size_bytes: int = setting(DEFAULT_PART_BYTES, "a shard's states are split into files of at most this size", gt=0)
    max_batch_tokens: int = setting(16384, "padded tokens per forward batch (transformers) or tokens per request chunk (vLLM)", gt=0)
    max_batch_size: int = setting(64, "samples per forward batch (transformers)", gt=0)
    cpu_threads: int = setting(0, "torch threads on a CPU host; 0: torch's default", ge=0)
    logits_check_samples: int = setting(8, "samples drawn for final_state_reproduces_logits", gt=0)
    logits_check_positions: int = setting(4096, "at most this many positions compared over those samples", gt=0)
    min_argmax_agreement: float = setting(0.999, "final_state_reproduces_logits passes at or above this share", ge=0, le=1)
    aux_check_samples: int = setting(4, "samples drawn for aux_states_match_layer_ids", gt=0)
    aux_check_reference: str = setting(
        "auto", "'transformers' (a transformers forward), 'none' (sidecar only) or 'auto' (transformers unless backend is vllm)"
    )


class ShardRerun(JobSchema):
    """What a rerun of an already extracted shard does (offline mode only: bounded mode extracts anew every epoch)."""

    recompute: bool = setting(
        False, "discard the shard's stored files and extract it again (a rerun otherwise keeps durable parts and re-checks them)"
    )


class ExtractionShard(JobSchema):
    """One shard of an extraction run: where its traces are, where its states go, what its materialisation records."""

    shard: str = given("the shard's partition key")
    traces: str = given("the shard's validated_traces Parquet")
    output: str = given("the shard's hidden-state directory")
    data_version: str = given("reported with the shard's materialisation; a stored shard of this version is reused")
    check_seed: int = given("seed of the gates' sampling (from the shard's key: shard_check_seed)")


class ExtractionJob(ShardRerun, ExtractionRecipe):
    """The hidden states of a run's shards (``extract_hidden_states``), all from one engine built once.

    Paths relative to ``$EAGLE3_DATA_DIR`` on the host, or absolute.
    """

    shards: list[ExtractionShard] = given("the run's shards, extracted in this order, each written and reported on its own")
    target: StageTarget = given("the target to extract from")


# The ``kind`` of the custom Pipes message by which extract_hidden_states reports each finished shard of its run
# (Pipes' report_asset_materialization takes no partition, and one call per asset).
EXTRACTION_SHARD_MESSAGE = "hidden_states_shard"


def shard_check_seed(key: str) -> int:
    """The gates' sampling seed of a shard: its key's, so that a rerun samples the same positions."""
    return int(stable_hash(key, 8), 16)


class ExportGates(JobSchema):
    """What the export's gates compare the draft with, run on the GPU host because ``loads_in_vllm`` serves the target."""

    aux_layer_ids: list[int] = given("the layer ids the hidden states were extracted at")
    target_vocab_size: int = given("the target's vocabulary size")
    log_path: str | None = given("where the vLLM server's log of loads_in_vllm goes")
    serving: ServingProfile = given("how vLLM serves the target, remote code included (target_model's serving profile)")


HIDDEN_STATES_MODES = ("offline", "bounded")


class BoundedModeError(ValueError):
    """The bounded-disk settings cannot run; the message names the setting and what is wrong."""


class HiddenStatesSource(JobSchema):
    """Where ``draft_checkpoint`` takes its hidden states from (its launchpad's choice of stage)."""

    hidden_states_mode: str = setting(
        "offline",
        "'offline': train on the materialised hidden_states shards (train_draft); 'bounded': extract each shard's states "
        "as training consumes them, every epoch, keeping at most window_shards shards on disk (train_draft's streamed source; "
        "never materialised as hidden_states)",
    )


class StreamedShard(JobSchema):
    """One shard whose states bounded-disk training extracts, every epoch."""

    key: str = given("the shard's partition key")
    traces: str = given("the shard's validated_traces Parquet")
    data_version: str = given("what hidden_states would record for this shard's states (traces' version, target, layers, backend, dtype)")


class BoundedWindow(JobSchema):
    """Bounded-disk mode's settings (``draft_checkpoint``'s launchpad shows them): the window and the checkpoint interval."""

    # No limits here: mode_problems refuses bad values with what they mean, on the orchestrator and in the stage.
    window_shards: int = setting(2, "bounded mode: shards of hidden states on disk at most (2: the next is extracted while one is trained on)")
    checkpoint_every_steps: int = setting(50, "bounded mode: optimizer steps between checkpoints (and at each shard's end)")


class BoundedRun(BoundedWindow):
    """Bounded-disk training's batch source (:mod:`eagle3_assets.core.training.streamed`): the states streamed through a window of shards."""

    shards: list[StreamedShard] = given("the shards to stream, each epoch")
    window_dir: str = given("where the transient states live (the training asset's directory, never hidden_states/)")
    target: StageTarget = given("the target to extract from")
    extraction: ExtractionRecipe = given("how each streamed shard is extracted and gated (hidden_states' settings)")

    def validate(self) -> None:
        problems = mode_problems("bounded", self.window_shards, self.checkpoint_every_steps)
        keys = [s.key for s in self.shards]
        if not keys:
            problems.append("no shards to stream")
        if len(set(keys)) != len(keys):
            problems.append(f"shards named twice: {sorted({k for k in keys if keys.count(k) > 1})}")
        if problems:
            raise BoundedModeError("bounded-disk training: " + "; ".join(problems))


def mode_problems(mode: str, window_shards: int, checkpoint_every_steps: int = 1, nproc: int = 1) -> list[str]:
    """What is wrong with the launchpad's hidden-state mode settings (empty when nothing is)."""
    problems = []
    if mode not in HIDDEN_STATES_MODES:
        problems.append(f"hidden_states_mode {mode!r}: one of {HIDDEN_STATES_MODES}")
    if not isinstance(window_shards, int) or window_shards < 1:
        problems.append(f"window_shards {window_shards!r}: at least 1 shard of hidden states must fit on disk")
    if mode == "bounded" and (not isinstance(checkpoint_every_steps, int) or checkpoint_every_steps < 1):
        problems.append(f"checkpoint_every_steps {checkpoint_every_steps!r}: must be at least 1")
    if mode == "bounded" and nproc != 1:
        problems.append(f"nproc_per_node {nproc}: bounded mode trains in one process (use offline mode for DDP)")
    return problems


class TrainingStageRecipe(JobSchema):
    """``train_draft``'s own settings (``draft_checkpoint``'s launchpad shows them): processes, export precision, the vLLM check."""

    nproc_per_node: int = setting(1, "training processes (GPUs); above 1 runs under torchrun with DDP")
    export_dtype: str | None = setting(None, "float32, bfloat16 or float16; default: the target's dtype")
    vllm_check_num_speculative_tokens: int = setting(
        3, "num_speculative_tokens of the loads_in_vllm check, and the first one the serving notes name"
    )


class TrainingJob(TrainingStageRecipe):
    """Train the draft, export it in vLLM's form and run its gates (``train_draft``, both hidden-state modes)."""

    train: TrainConfig = given("the training run: inputs and recipe")
    export_dir: str = given("where the vLLM-native draft directory goes")
    bounded: BoundedRun | None = setting(
        None, "bounded-disk mode: the shards whose states are extracted as training consumes them; none: the stored hidden_state_dirs"
    )
    gates: ExportGates | None = setting(None, "the export's gates; none: not run")


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
    floor: float = setting(2.0, "acceptance_above_floor fails (ERROR) below this mean acceptance length")
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
