"""What ``train_draft`` is told: the training stage's job, its settings and bounded-disk mode's.

Pydantic models (:mod:`eagle3_assets.core.settings.job_schema`). ``draft_checkpoint``'s
user-facing settings are ``TrainingRecipe`` (:mod:`eagle3_assets.core.training.config`),
``TrainingStageRecipe``, ``HiddenStatesSource`` and ``BoundedWindow``: its Dagster
``Config`` class is those models with Dagster's base mixed in, and the job
(``TrainingJob``) is them plus the fields the asset fills in with :func:`given`.
The asset sends ``job.model_dump()`` as the Pipes extras (JSON) through the GPU
host, which carries it without reading it, and the stage reads it back with
``TrainingJob.from_dict(extras)`` (strict ``model_validate``): an unknown,
missing or mistyped key is refused there, naming the key. Bounded-disk mode
extracts as it trains, so its part of the job carries an extraction recipe and
target (:mod:`eagle3_assets.core.extraction.job`). Dagster-free.
"""

from __future__ import annotations

from eagle3_assets.core.extraction.job import ExtractionRecipe, StageTarget
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.settings.job_schema import JobSchema, given, setting
from eagle3_assets.core.training.config import TrainConfig


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


def mode_problems(mode: str, window_shards: int, checkpoint_every_steps: int = 1, nproc: int = 1, nnodes: int = 1) -> list[str]:
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
    if mode == "bounded" and nnodes != 1:
        problems.append(f"nnodes {nnodes}: bounded mode trains in one process (use offline mode to train across nodes)")
    return problems


class TrainingStageRecipe(JobSchema):
    """``train_draft``'s own settings (``draft_checkpoint``'s launchpad shows them): processes, export precision, the vLLM check."""

    nproc_per_node: int = setting(1, "training processes (GPUs) per node; above 1 runs under torchrun with DDP")
    nnodes: int = setting(
        1,
        "nodes to train across, on a GPU host that is a Ray cluster: DDP over nnodes x nproc_per_node ranks, torchrun on "
        "each node with the first one's address as the rendezvous (the same loop, checkpoints and resume as one host)",
        ge=1,
    )
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
