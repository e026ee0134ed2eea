"""The one ``Definitions`` object: assets, checks, resources, sensors and jobs."""

from __future__ import annotations

from dagster import Definitions, in_process_executor

from eagle3_assets import settings
from eagle3_assets.deployed_draft import deployed_draft
from eagle3_assets.draft_checkpoint import draft_checkpoint
from eagle3_assets.draft_evaluation import draft_evaluation
from eagle3_assets.gpu_host_ready import gpu_host_ready_job
from eagle3_assets.hidden_states import hidden_states
from eagle3_assets.prompts import prompts
from eagle3_assets.raw_responses import raw_responses
from eagle3_assets.validated_traces import validated_traces
from eagle3_assets.vocab_mapping import vocab_mapping
from resources.alerts import alert_channel_from_env
from resources.gpu_host import gpu_host_from_env
from resources.production_servers import ProductionServers
from resources.prompt_dataset import PromptDataset
from resources.target_model import TargetModel
from resources.vllm_server import VLLMServerResource
from sensors import ALL_SENSORS

# Materialised together, one shard at a time (the demo, backfills).
PER_SHARD_ASSETS = [prompts, raw_responses, validated_traces, hidden_states]

# Unpartitioned, over every shard: materialised after all shards (the demo).
WHOLE_DATASET_ASSETS = [vocab_mapping, draft_checkpoint, draft_evaluation]


# How the demo's tiny target is sampled: its server's context is 4,096 tokens, so the production
# max_tokens (8192) would fail the pre-flight, and 64 requests in flight keep a CPU server busy.
DEMO_SAMPLING = {"max_tokens": settings.DEMO_MAX_TOKENS, "temperature": settings.DEMO_TEMPERATURE, "concurrency": 64}


def default_resources() -> dict:
    target = TargetModel.from_env()  # EAGLE3_TARGET_MODEL, EAGLE3_TRUST_REMOTE_CODE, EAGLE3_AUX_LAYER_IDS
    demo_prompts = settings.PROMPTS_SOURCE == "demo"
    return {
        # The demo's prompts come with their own held-out set: nothing of theirs is held out.
        "prompt_dataset": PromptDataset(source=settings.PROMPTS_SOURCE, shard_size=settings.SHARD_SIZE, **({"holdout_share": 0.0} if demo_prompts else {})),
        # EAGLE3_VLLM_URLS (comma separated), EAGLE3_SERVED_MODEL, VLLM_API_KEY (an EnvVar, only when set);
        # with the demo's target (`make dev` beside `make serve-demo`), the demo's sampling.
        "vllm_server": VLLMServerResource.from_env(**(DEMO_SAMPLING if target.path == "demo" else {})),
        "target_model": target,
        "alert_channel": alert_channel_from_env(),
        "gpu_host": gpu_host_from_env(),
        # EAGLE3_PRODUCTION_URLS (comma separated), EAGLE3_PRODUCTION_API_KEY (an EnvVar, only when set).
        "production_servers": ProductionServers.from_env(),
    }


# Steps run in the run's own process: each asset depends on the one before it, so a shard run
# has nothing to run in parallel, and a process per step loaded the code location again (seconds
# per step, most of a shard run's fixed cost). Pools hold either way. The GPU
# stages are their own processes anyway (the gpu_host resource).
defs = Definitions(
    # deployed_draft is observed (sensor deployed_draft_watch), never materialised here.
    assets=[*PER_SHARD_ASSETS, *WHOLE_DATASET_ASSETS, deployed_draft],
    resources=default_resources(),
    sensors=ALL_SENSORS,
    jobs=[gpu_host_ready_job],
    executor=in_process_executor,
)
