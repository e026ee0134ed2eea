"""What ``extract_hidden_states`` is told: the extraction stage's job and its settings.

Pydantic models (:mod:`eagle3_assets.core.settings.job_schema`). The user-facing
settings are one model, ``ExtractionRecipe``: the ``hidden_states`` asset's
Dagster ``Config`` class *is* that model with Dagster's base mixed in
(``class HiddenStatesConfig(ShardRerun, ExtractionRecipe, Config)``), and the job
(``ExtractionJob``) is that model plus the fields the asset fills in with
:func:`given` (paths, the target, the shards). The asset sends
``job.model_dump()`` as the Pipes extras (JSON) through the GPU host, which
carries it without reading it, and the stage reads it back with
``ExtractionJob.from_dict(extras)`` (strict ``model_validate``): an unknown,
missing or mistyped key is refused there, naming the key. Every setting has its
one default, description and limits here. Dagster-free.

The training and evaluation stages' jobs are :mod:`eagle3_assets.core.training.job`
and :mod:`eagle3_assets.core.evaluation.job`.
"""

from __future__ import annotations

from eagle3_assets.core.extraction.gates import HIDDEN_STATE_GATES
from eagle3_assets.core.extraction.state_layout import DEFAULT_PART_BYTES, FP8_DTYPE, STORAGE_DTYPE_BYTES
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.settings.job_schema import JobSchema, given, setting
from eagle3_assets.core.storage.files import stable_hash


class StageTarget(JobSchema):
    """The target as the orchestrator configured it (``TargetModel.stage_extras``)."""

    path: str = given("the target's HF directory on the GPU host")
    trust_remote_code: bool = given("load the target's own modelling and tokenizer code")
    aux_layer_ids: list[int] = given("the layers whose states the draft reads (vLLM's convention)")
    config_hash: str = given("what the orchestrator saw; the stage records the identity of the model it loads itself")
    serving: ServingProfile = given("how vLLM serves the target (target_model's serving profile)")


class ExtractionRecipe(JobSchema):
    """How states are extracted and gated: ``hidden_states``' settings, shared by offline and bounded-disk mode."""

    backend: str = setting(
        "transformers", "the engine that captures the states, a name core/extraction/backends.py registers; 'vllm' for targets too large for transformers"
    )
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
    min_argmax_agreement: float = setting(
        HIDDEN_STATE_GATES["final_state_reproduces_logits"].threshold,
        "final_state_reproduces_logits passes at or above this share",
        ge=0,
        le=1,
    )
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
