"""The target model: where its weights and tokenizer are, and the facts stages need from it.

A target is one coherent thing: its path, whether its code may run
(``trust_remote_code``) and its EAGLE-3 layer ids. The defaults come from the
environment, like the servers' (:mod:`resources.vllm_server`):

- ``EAGLE3_TARGET_MODEL``: the HF model directory;
- ``EAGLE3_TRUST_REMOTE_CODE``: ``1`` to let the target's own code load (Kimi's tokenizer is remote code);
- ``EAGLE3_AUX_LAYER_IDS``: three comma-separated ids in vLLM's convention;
- the serving profile's ``EAGLE3_TENSOR_PARALLEL_SIZE``, ``EAGLE3_QUANTIZATION``, ... (docs/configuration.md).

They are the *schema's* defaults, read when the code location loads: Dagster's
run config for a resource replaces every field given in Python, so a launchpad
override of one field (``aux_layer_ids``, say) would otherwise send the run to
the class defaults, that is to another model, with every gate green.
"""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

from eagle3_assets.core.target import description as core_target
from eagle3_assets.core.target.identity import TargetIdentity, config_hash, target_identity
from eagle3_assets.core.target.preflight import TargetSettings, completion_budget, preflight_problems
from eagle3_assets.core.target.tokenizer import load_tokenizer
from eagle3_assets.core.serving.profile import GPUNeed, ServingProfile, gpu_need
from eagle3_assets.core.target.serving import SERVING_CONTEXT_CAP
from eagle3_assets.core.settings.environment import AUX_LAYER_IDS, GPU_HOST_TARGET_MODEL, TARGET_MODEL, TRUST_REMOTE_CODE
from eagle3_assets.core.settings.job_schema import values_of

PATH_ENV = TARGET_MODEL.name


def path_from_env() -> str | None:
    return TARGET_MODEL.get()


def trust_remote_code_from_env() -> bool:
    return TRUST_REMOTE_CODE.get()


def layer_ids_from_env() -> list[int] | None:
    return AUX_LAYER_IDS.get()


class TargetModel(ServingProfile, ConfigurableResource):
    """The target as stages load it (a local HF model directory), and how every vLLM the platform starts serves it.

    The serving settings are :class:`~eagle3_assets.core.serving.profile.ServingProfile` itself (tensor parallel size,
    quantization, CUDA graphs, start-up limit, ...: their one default, from the ``EAGLE3_*`` serving variables,
    description and limits); this class adds where the target is and what the draft reads of it.
    """

    # Required unless the environment names the deployment's target.
    path: str = Field(
        default=path_from_env() or ...,
        description=f"HF model directory, on this machine and (unless gpu_host_path is set) on the GPU host (default: ${PATH_ENV})",
    )
    aux_layer_ids: list[int] | None = Field(
        default=layer_ids_from_env(),
        description=f"three EAGLE-3 auxiliary layer ids in vLLM's convention; default (2, L//2, L-3) when distinct (default: ${AUX_LAYER_IDS.name})",
    )
    gpu_host_path: str = Field(
        default=GPU_HOST_TARGET_MODEL.get() or "",
        description="the same model's directory on the GPU host, where it differs from path: the orchestrator then needs only "
        "the tokenizer, chat template, config and the weights' index (model.safetensors.index.json) at path; "
        f"empty: path (default: ${GPU_HOST_TARGET_MODEL.name})",
    )
    think_open: str | None = Field(default=None, description="start-of-thinking marker; default: found in the tokenizer/template")
    think_close: str | None = Field(default=None, description="end-of-thinking marker; default: found in the tokenizer/template")
    end_of_turn: str | None = Field(
        default=None, description="token that ends the assistant's turn; default: what the template writes after an answer, else eos"
    )
    _resolved: Path | None = PrivateAttr(default=None)

    @classmethod
    def from_env(cls, **overrides) -> TargetModel:
        """The deployment's target: ``EAGLE3_TARGET_MODEL``, ``EAGLE3_TRUST_REMOTE_CODE``, ``EAGLE3_AUX_LAYER_IDS``, read now."""
        fields = {
            "path": path_from_env(), "trust_remote_code": trust_remote_code_from_env(), "aux_layer_ids": layer_ids_from_env(),
            "gpu_host_path": GPU_HOST_TARGET_MODEL.get(),
        }  # fmt: skip
        return cls(**{**{k: v for k, v in fields.items() if v is not None}, **overrides})

    def resolved_path(self) -> Path:
        if self._resolved is None:
            self._resolved = self.model_dir()
        return self._resolved

    def model_dir(self) -> Path:
        """Where ``path`` points; a subclass may build or fetch the model here (called once per resource)."""
        return Path(self.path).expanduser()

    def host_path(self) -> str:
        """Where the GPU stages load the model: ``gpu_host_path``, else the same directory as here."""
        return self.gpu_host_path or str(self.resolved_path())

    def builtin_eval_prompts(self) -> str | None:
        """A held-out prompt set that comes with the target (a JSONL/Parquet path), or None: a user's target has none."""
        return None

    def config(self) -> dict:
        return core_target.read_config(self.resolved_path())

    def text_config(self) -> dict:
        return core_target.text_config(self.config())

    def config_hash(self) -> str:
        return config_hash(self.resolved_path())

    def identity(self) -> TargetIdentity:
        return target_identity(self.resolved_path())

    def num_layers(self) -> int:
        return int(self.text_config()["num_hidden_layers"])

    def hidden_size(self) -> int:
        return int(self.text_config()["hidden_size"])

    def context_length(self) -> int | None:
        return core_target.context_length(self.config())

    def description(self) -> core_target.TargetDescription:
        """The target as configured, its layer ids checked (TargetError naming the setting when they do not fit)."""
        return core_target.TargetDescription.read(self.resolved_path(), self.aux_layer_ids)

    def layer_ids(self) -> list[int]:
        return list(self.description().aux_layer_ids)

    def load_tokenizer(self):
        return load_tokenizer(self.resolved_path(), self.trust_remote_code)

    def settings(self) -> TargetSettings:
        return TargetSettings(
            path=str(self.resolved_path()),
            trust_remote_code=self.trust_remote_code,
            aux_layer_ids=tuple(self.aux_layer_ids) if self.aux_layer_ids else None,
            think_open=self.think_open,
            think_close=self.think_close,
            end_of_turn=self.end_of_turn,
        )

    def renderer(self):
        """The target's chat template, think markers and end of turn, with its tokenizer."""
        from eagle3_assets.core.validation.chat_rendering import ChatRenderer

        return ChatRenderer(self.load_tokenizer(), self.think_open, self.think_close, self.end_of_turn)

    def completion_budget(self, conversations: list[list[dict]]) -> int:
        """``max_tokens`` when none is set: what the context leaves beside the longest of these prompts, as the target's
        chat template renders them (:func:`eagle3_assets.core.target.preflight.completion_budget`)."""
        lengths = []
        if conversations:
            try:
                tokenizer = self.load_tokenizer()
                lengths = [len(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for m in conversations]
            except Exception:  # noqa: BLE001 - the target pre-flight names a tokenizer or template that fails; room for a short prompt here
                lengths = []
        return completion_budget(self.context_length(), lengths)

    def preflight_problems(self, *, max_tokens: int, eval_max_tokens: int) -> list[str]:
        return preflight_problems(self.settings(), max_tokens=max_tokens, eval_max_tokens=eval_max_tokens)

    def serving_profile(self) -> ServingProfile:
        """How vLLM serves this target: the serving settings of this resource, as the GPU stages receive them."""
        return ServingProfile(**values_of(self, ServingProfile))

    def gpu_need(self, context: int | None = None) -> GPUNeed:
        """What one start of this target as profiled needs of each GPU (``context``: the longest sequence the use serves;
        default: the target's context up to 16,384): the GPU pre-flight's requirement for the stages that start it."""
        length = context or min(self.context_length() or SERVING_CONTEXT_CAP, SERVING_CONTEXT_CAP)
        return gpu_need(self.serving_profile(), self.resolved_path(), length)

    def stage_extras(self) -> dict:
        """What a GPU stage needs to load this target exactly as configured."""
        return {
            "path": self.host_path(),
            "trust_remote_code": self.trust_remote_code,
            "aux_layer_ids": self.layer_ids(),
            "config_hash": self.config_hash(),
            "serving": self.serving_profile().model_dump(),
        }
