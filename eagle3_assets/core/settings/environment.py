"""Every environment variable the platform reads, declared once: its name, type, default and meaning.

The code reads a variable only through its declaration (``DATA_DIR.get()``),
so the default is written here and nowhere else, and a malformed value is
refused naming the variable. ``scripts/config_reference.py`` writes the
environment table of docs/configuration.md from :data:`VARIABLES`.

A default of ``None`` means unset: the reader decides what that means (a
resource field then keeps its own default, a secret is not bound). Where the
value used when unset is not one literal (it depends on the mode, or on
another variable), ``unset`` says what it is, for the page. Dagster-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE, _FALSE = {"1", "true", "yes"}, {"0", "false", "no"}


def _text(raw: str) -> str:
    return raw


def _int(raw: str) -> int:
    return int(raw)


def _float(raw: str) -> float:
    return float(raw)


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in _TRUE | _FALSE:
        raise ValueError("use 1 or 0")
    return value in _TRUE


def _json_object(raw: str) -> dict:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def _names(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _ints(raw: str) -> list[int]:
    return [int(part) for part in _names(raw)]


_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "str": (_text, "text"),
    "int": (_int, "an integer"),
    "float": (_float, "a number"),
    "bool": (_bool, "1 or 0"),
    "list": (_names, "comma-separated values"),
    "int list": (_ints, "comma-separated integers"),
    "json": (_json_object, "a JSON object"),
}


@dataclass(frozen=True)
class Variable:
    name: str
    type: str  # a key of _PARSERS
    default: Any  # the value when unset; None: unset, the reader decides
    description: str
    unset: str = ""  # for the page: what holds when unset, where it is not ``default`` itself
    gives: tuple[str, ...] = ()  # the resource fields (``key.field``) whose default it gives
    secret: bool = False  # bound as a Dagster EnvVar, never read into config

    def __post_init__(self) -> None:
        if self.type not in _PARSERS:
            raise ValueError(f"{self.name}: type {self.type!r}, one of {sorted(_PARSERS)}")

    def raw(self) -> str | None:
        """The variable's text, or None when it is unset or empty."""
        return os.environ.get(self.name) or None

    def is_set(self) -> bool:
        return self.raw() is not None

    def get(self) -> Any:
        """The variable's value as its type, or its default when unset; a malformed value is refused naming the variable."""
        raw = self.raw()
        if raw is None:
            if isinstance(self.default, dict):
                return dict(self.default)
            return list(self.default) if isinstance(self.default, (list, tuple)) else self.default
        parse, expected = _PARSERS[self.type]
        try:
            return parse(raw)
        except ValueError:
            raise ValueError(f"environment variable {self.name}={raw!r}: expected {expected}") from None

    @property
    def shown_default(self) -> str:
        if self.unset:
            return self.unset
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "`1`" if self.default else "`0`"
        if isinstance(self.default, (list, tuple)):
            return f"`{','.join(map(str, self.default))}`"
        if isinstance(self.default, dict):
            return f"`{json.dumps(self.default)}`"
        return f"`{self.default}`"


# -- storage and shards
DATA_DIR = Variable("EAGLE3_DATA_DIR", "str", "data", "root of every asset's files: `<data>/<asset name>/`", unset="`./data`")
LOCK_DIR = Variable(
    "EAGLE3_LOCK_DIR", "str", None,
    "where shard leases and stage locks live, on every machine that writes shards (the GPU host's is "
    "`gpu_host.lock_dir`); must be on a local disk: `flock` over NFS is unreliable",
    unset="`<data>/.locks`", gives=("gpu_host.lock_dir",),
)  # fmt: skip
LEASE_STALE_AFTER_S = Variable(
    "EAGLE3_LEASE_STALE_AFTER_S", "float", 900.0, "a shard lease held from another host is taken over after this many seconds without heartbeat"
)
LEASE_TAKEOVER = Variable("EAGLE3_LEASE_TAKEOVER", "list", [], "hosts (comma separated, or `*`) whose leases may be taken over at once", unset="unset")

# -- prompts
PROMPTS = Variable("EAGLE3_PROMPTS", "str", None, "the prompt dataset", unset="the embedded default's prompt set", gives=("prompt_dataset.source",))
SHARD_SIZE = Variable("EAGLE3_SHARD_SIZE", "int", None, "rows per sample shard", unset="128 (the embedded default's own)", gives=("prompt_dataset.shard_size",))
MAX_SAMPLES = Variable(
    "EAGLE3_MAX_SAMPLES", "int", None,
    "register only the shards that the first N prompts fill (rounded up to whole shards); raise it to grow the run by more shards",
    unset="every row of the dataset", gives=("prompt_dataset.max_samples",),
)  # fmt: skip

# -- generation
VLLM_URLS = Variable(
    "EAGLE3_VLLM_URLS", "list", ["http://127.0.0.1:8000"],
    "generation servers, comma separated; credentials in a URL stay in the environment", gives=("vllm_server.base_urls",),
)  # fmt: skip
SERVED_MODEL = Variable(
    "EAGLE3_SERVED_MODEL", "str", None, "the served model name (vLLM's `--served-model-name`)",
    unset="the one model the server lists", gives=("vllm_server.served_model_name",),
)  # fmt: skip
VLLM_API_KEY = Variable(
    "VLLM_API_KEY", "str", None, "the generation servers' API key, bound as a Dagster `EnvVar` (never shown or logged)",
    gives=("vllm_server.api_key",), secret=True,
)  # fmt: skip
GENERATION_POOL_LIMIT = Variable(
    "EAGLE3_GENERATION_POOL_LIMIT", "int", 1, "limit given to the `vllm_generation` pool when it has none (`make dev`)"
)
ADOPT_RESPONSES = Variable(
    "EAGLE3_ADOPT_RESPONSES", "str", None,
    "an existing file of responses (JSONL of chat completions, or a `raw_responses` Parquet of another instance) whose rows "
    "`raw_responses` adopts for each shard's prompts before it generates the rest; the default of its run config `adopt_from`",
    unset="unset: nothing adopted",
)  # fmt: skip
SHARDS_PER_RUN = Variable(
    "EAGLE3_SHARDS_PER_RUN", "int", 32,
    "shards of `raw_responses` a backfill puts in one run: one pre-flight and one in-flight budget of "
    "`vllm_server.concurrency` requests across all of them (each shard still written, checked and recorded on its own); "
    "read when the code location loads",
)  # fmt: skip

# -- the target
TARGET_MODEL = Variable("EAGLE3_TARGET_MODEL", "str", None, "the target's HF model directory", unset="the embedded default's target", gives=("target_model.path",))
TRUST_REMOTE_CODE = Variable(
    "EAGLE3_TRUST_REMOTE_CODE", "bool", False, "`1` lets the target's own code run", gives=("target_model.trust_remote_code",)
)
GPU_HOST_TARGET_MODEL = Variable(
    "EAGLE3_GPU_HOST_TARGET_MODEL", "str", None,
    "the target's directory on the GPU host, where it is not `EAGLE3_TARGET_MODEL` (which then needs only tokenizer, template, config and weights index)",
    unset="`EAGLE3_TARGET_MODEL`", gives=("target_model.gpu_host_path",),
)  # fmt: skip
AUX_LAYER_IDS = Variable(
    "EAGLE3_AUX_LAYER_IDS", "int list", None, "three layer ids in vLLM's convention, e.g. `2,30,58`",
    unset="`(2, L//2, L-3)`", gives=("target_model.aux_layer_ids",),
)  # fmt: skip

# -- how vLLM serves the target (core/serving/profile.py): every vLLM the platform starts
TENSOR_PARALLEL_SIZE = Variable(
    "EAGLE3_TENSOR_PARALLEL_SIZE", "int", 1, "GPUs each pipeline stage of the target is split over (`8` for Kimi-K2.5 INT4 on 8 GPUs)",
    gives=("target_model.tensor_parallel_size",),
)  # fmt: skip
PIPELINE_PARALLEL_SIZE = Variable("EAGLE3_PIPELINE_PARALLEL_SIZE", "int", 1, "pipeline stages of the target", gives=("target_model.pipeline_parallel_size",))
DATA_PARALLEL_SIZE = Variable("EAGLE3_DATA_PARALLEL_SIZE", "int", 1, "engine replicas of the target", gives=("target_model.data_parallel_size",))
QUANTIZATION = Variable(
    "EAGLE3_QUANTIZATION", "str", None, "vLLM's `--quantization`", unset="what the checkpoint declares", gives=("target_model.quantization",)
)
SERVING_DTYPE = Variable("EAGLE3_SERVING_DTYPE", "str", "auto", "vLLM's `--dtype` for the target", gives=("target_model.dtype",))
KV_CACHE_DTYPE = Variable("EAGLE3_KV_CACHE_DTYPE", "str", "auto", "vLLM's `--kv-cache-dtype`", gives=("target_model.kv_cache_dtype",))
GPU_MEMORY_UTILIZATION = Variable(
    "EAGLE3_GPU_MEMORY_UTILIZATION", "float", 0.9, "share of each GPU's memory vLLM takes", gives=("target_model.gpu_memory_utilization",)
)
MAX_MODEL_LEN = Variable(
    "EAGLE3_MAX_MODEL_LEN", "int", 0, "vLLM's `--max-model-len`; `0`: what each use needs within the target's context",
    gives=("target_model.max_model_len",),
)  # fmt: skip
CUDA_GRAPHS = Variable(
    "EAGLE3_CUDA_GRAPHS", "bool", None, "`0`: vLLM runs eager (`--enforce-eager`) on a GPU too", unset="on with a GPU, off on a CPU host",
    gives=("target_model.cuda_graphs",),
)  # fmt: skip
VLLM_STARTUP_TIMEOUT_S = Variable(
    "EAGLE3_VLLM_STARTUP_TIMEOUT_S", "float", 3600.0, "seconds a vLLM server the platform starts may take to become healthy",
    gives=("target_model.startup_timeout_s",),
)  # fmt: skip
REASONING_PARSER = Variable(
    "EAGLE3_REASONING_PARSER", "str", None, "vLLM's `--reasoning-parser` of the target's family (`kimi_k2`, ...)",
    gives=("target_model.reasoning_parser",),
)  # fmt: skip
VLLM_EXTRA_ARGS = Variable(
    "EAGLE3_VLLM_EXTRA_ARGS", "json", {}, "further vLLM engine arguments by EngineArgs name, e.g. `{\"enable_expert_parallel\": true}`",
    gives=("target_model.extra_engine_args",),
)  # fmt: skip
VLLM_ENV = Variable(
    "EAGLE3_VLLM_ENV", "json", {}, "environment of every vLLM the platform starts, e.g. `{\"VLLM_USE_DEEP_GEMM\": \"1\"}`",
    gives=("target_model.env",),
)  # fmt: skip

# -- the GPU host
GPU_HOST = Variable(
    "EAGLE3_GPU_HOST", "str", "local", "`local`, `ssh://[user@]host[:port]`, or `ray` (a Ray cluster at `EAGLE3_RAY_ADDRESS`)",
    gives=("gpu_host.mode", "gpu_host.ssh_host", "gpu_host.ssh_port", "gpu_host.ssh_user"),
)  # fmt: skip
GPU_HOST_PYTHON = Variable("EAGLE3_GPU_HOST_PYTHON", "str", None, "the host's Python", unset="this Python (local), `python3` (ssh)", gives=("gpu_host.python",))
GPU_HOST_WORKDIR = Variable("EAGLE3_GPU_HOST_WORKDIR", "str", None, "working directory of stage processes", unset="`.`", gives=("gpu_host.working_dir",))
GPU_HOST_DATA_DIR = Variable(
    "EAGLE3_GPU_HOST_DATA_DIR", "str", None, "the data directory on the host, required for ssh",
    unset="`$EAGLE3_DATA_DIR` (local only)", gives=("gpu_host.data_dir",),
)  # fmt: skip
GPU_HOST_ALLOW_CPU = Variable(
    "EAGLE3_GPU_HOST_ALLOW_CPU", "bool", None, "`0`: only stages that declare `cpu_allowed` run without a GPU", unset="`1`", gives=("gpu_host.allow_cpu",)
)
SSH_IDENTITY_FILE = Variable("EAGLE3_SSH_IDENTITY_FILE", "str", None, "private key on the orchestrator", unset="ssh's default", gives=("gpu_host.ssh_identity_file",))
SSH_KNOWN_HOSTS = Variable("EAGLE3_SSH_KNOWN_HOSTS", "str", None, "host key policy", unset="`strict`", gives=("gpu_host.ssh_known_hosts",))
SSH_KNOWN_HOSTS_FILE = Variable("EAGLE3_SSH_KNOWN_HOSTS_FILE", "str", None, "known_hosts file", unset="ssh's default", gives=("gpu_host.ssh_known_hosts_file",))
HF_TOKEN = Variable(
    "HF_TOKEN", "str", None, "Hugging Face token for a gated target on the hub, handed to every stage (`EnvVar`, never logged)",
    gives=("gpu_host.hf_token",), secret=True,
)  # fmt: skip
SERVING_UNIT = Variable(
    "EAGLE3_SERVING_UNIT", "str", None, "the systemd unit of the generation server on the GPU host (e.g. `vllm-kimi.service`): "
    "the GPU pre-flight names it as what to stop when its processes hold the memory a stage needs",
    gives=("gpu_host.serving_unit",),
)  # fmt: skip
RAY_ADDRESS = Variable(
    "EAGLE3_RAY_ADDRESS", "str", None, "with `EAGLE3_GPU_HOST=ray`: the Ray cluster's dashboard address, where stage jobs are submitted",
    unset="`$RAY_ADDRESS`, else `http://127.0.0.1:8265`", gives=("gpu_host.ray_address",),
)  # fmt: skip
RAY_ENGINES = Variable(
    "EAGLE3_RAY_ENGINES", "int", None, "on a Ray cluster: the engines (one per node) an extraction run spreads its shards over",
    unset="`0`: every node that has the GPUs the stage needs", gives=("gpu_host.ray_engines",),
)  # fmt: skip
RAY_RUNTIME_ENV = Variable(
    "EAGLE3_RAY_RUNTIME_ENV", "str", None, "on a Ray cluster: a JSON Ray `runtime_env` for every stage job (`env_vars`, "
    "`py_executable`, ...); nothing secret: Ray's dashboard shows it", unset="none", gives=("gpu_host.ray_runtime_env",),
)  # fmt: skip
RAY_PLACEMENT = Variable(
    "EAGLE3_RAY_PLACEMENT", "json", None, "set by the GPU host for each stage job on a Ray cluster (the nodes its pre-flight "
    "found fit, the GPUs each engine takes); not set by hand",
)  # fmt: skip
GPU_POOL = Variable("EAGLE3_GPU_POOL", "str", "gpu_host", "the Dagster pool of the GPU stages (one per GPU host)")
GPU_POOL_LIMIT = Variable("EAGLE3_GPU_POOL_LIMIT", "int", 1, "limit given to the GPU pool when it has none")
EXTRACTION_SHARDS_PER_RUN = Variable(
    "EAGLE3_EXTRACTION_SHARDS_PER_RUN", "int", 20,
    "`hidden_states`: shards per run of a backfill (each run loads the target once and extracts its shards in turn); "
    "read when the definitions load",
)  # fmt: skip
ALLOW_CPU = Variable("EAGLE3_ALLOW_CPU", "bool", True, "set by the GPU host for each stage process from `allow_cpu`; not set by hand")
ACCEPT_UNKNOWN_CAPACITY = Variable(
    "EAGLE3_ACCEPT_UNKNOWN_CAPACITY", "bool", False,
    "`1`: a volume whose free bytes cannot be read (an ssh GPU host whose Python does not answer) passes the capacity plan's "
    "`run_fits` and `hidden_states`' refusal, the risk stated, instead of refusing the run; the default of their run config "
    "`accept_unknown_capacity`; read when the code location loads",
)  # fmt: skip

# -- alerts and production
ALERT_WEBHOOK_URL = Variable(
    "EAGLE3_ALERT_WEBHOOK_URL", "str", None, "Slack-compatible incoming webhook for alerts (a secret, `EnvVar`)",
    gives=("alert_channel.webhook_url",), secret=True,
)  # fmt: skip
SLACK_BOT_TOKEN = Variable(
    "EAGLE3_SLACK_BOT_TOKEN", "str", None, "Slack bot token, alerts through `dagster-slack` (a secret, `EnvVar`)",
    gives=("alert_channel.slack_token",), secret=True,
)  # fmt: skip
SLACK_CHANNEL = Variable("EAGLE3_SLACK_CHANNEL", "str", "#eagle3-alerts", "the channel used with the Slack token", gives=("alert_channel.slack_channel",))
UI_BASE_URL = Variable(
    "EAGLE3_UI_BASE_URL", "str", "http://127.0.0.1:3000", "base of the run links in alerts (the proxy's address in production)",
    gives=("alert_channel.ui_base_url",),
)  # fmt: skip
PRODUCTION_URLS = Variable(
    "EAGLE3_PRODUCTION_URLS", "list", [], "production servers the `deployed_draft_watch` sensor reads, comma separated",
    unset="unset", gives=("production_servers.base_urls",),
)  # fmt: skip
PRODUCTION_API_KEY = Variable(
    "EAGLE3_PRODUCTION_API_KEY", "str", None, "their API key (`EnvVar`)", gives=("production_servers.api_key",), secret=True
)
PRODUCTION_SCRAPE_S = Variable("EAGLE3_PRODUCTION_SCRAPE_S", "int", 300, "seconds between two scrapes of the production servers")
AUTO_GENERATE = Variable("EAGLE3_AUTO_GENERATE", "bool", False, "`1`: `new_prompt_shards` also requests a `prompts` + `raw_responses` run per new shard", unset="unset")
DAGSTER_URL = Variable("EAGLE3_DAGSTER_URL", "str", "http://127.0.0.1:3000", "the webserver `python -m eagle3_assets.backfill` talks to")

# The platform's; the embedded default declares its own beside it, with the same Variable.
VARIABLES: tuple[Variable, ...] = tuple(v for v in globals().values() if isinstance(v, Variable))
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}
if len(BY_NAME) != len(VARIABLES):
    raise RuntimeError("an environment variable is declared twice")
