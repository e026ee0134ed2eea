"""The platform's graph: its assets, the resources they need, and the ``Definitions`` built from them.

``definitions.py`` builds the code location from these with the deployment's
resources; anything else that runs the graph (a script, a notebook, the
embedded default) builds its own resources and materialises the same assets.
"""

from __future__ import annotations

from dagster import Definitions, in_process_executor

from eagle3_assets.core.prompts.sharding import PER_SHARD_ASSETS as PER_SHARD_ASSET_NAMES
from eagle3_assets.defs.capacity_plan import capacity_plan, plan_capacity_job
from eagle3_assets.defs.deployed_draft import deployed_draft
from eagle3_assets.defs.draft_checkpoint import draft_checkpoint
from eagle3_assets.defs.draft_evaluation import draft_evaluation
from eagle3_assets.defs.gpu_host_ready import gpu_host_ready_job
from eagle3_assets.defs.hidden_states import hidden_states
from eagle3_assets.defs.prompts import prompts
from eagle3_assets.defs.raw_responses import raw_responses
from eagle3_assets.defs.refinement_round import refinement_round
from eagle3_assets.defs.retire_shards import retire_shards_job
from eagle3_assets.defs.validated_traces import validated_traces
from eagle3_assets.defs.vocab_mapping import vocab_mapping
from resources.alerts import alert_channel_from_env
from resources.gpu_host import gpu_host_from_env
from resources.production_servers import ProductionServers
from resources.prompt_dataset import PromptDataset
from resources.target_model import TargetModel
from resources.vllm_server import VLLMServerResource
from sensors import ALL_SENSORS

# The assets a run materialises, upstream first.
ASSETS = [prompts, raw_responses, validated_traces, hidden_states, vocab_mapping, draft_checkpoint, draft_evaluation]

# Materialised together, one shard at a time (backfills name them: core.prompts.sharding.PER_SHARD_ASSETS).
PER_SHARD_ASSETS = [a for a in ASSETS if a.key.to_user_string() in PER_SHARD_ASSET_NAMES]

# Unpartitioned, over every shard: materialised after all shards.
WHOLE_DATASET_ASSETS = [a for a in ASSETS if a not in PER_SHARD_ASSETS]


def deployment_resources(target_model: TargetModel, prompt_dataset: PromptDataset, **sampling) -> dict:
    """Every resource the graph needs: the given target and prompts, the rest from the environment.

    - ``vllm_server``: EAGLE3_VLLM_URLS (comma separated), EAGLE3_SERVED_MODEL, VLLM_API_KEY (an EnvVar,
      only when set), with ``sampling`` (max_tokens, temperature, concurrency...) as its defaults;
    - ``production_servers``: EAGLE3_PRODUCTION_URLS (comma separated), EAGLE3_PRODUCTION_API_KEY (an EnvVar, only when set).
    """
    return {
        "prompt_dataset": prompt_dataset,
        "vllm_server": VLLMServerResource.from_env(**sampling),
        "target_model": target_model,
        "alert_channel": alert_channel_from_env(),
        "gpu_host": gpu_host_from_env(),
        "production_servers": ProductionServers.from_env(),
    }


def build_definitions(resources: dict) -> Definitions:
    """The code location: every asset, check, sensor and job, over ``resources``.

    Steps run in the run's own process: each asset depends on the one before
    it, so a shard run has nothing to run in parallel, and a process per step
    loads the code location again (most of a shard run's fixed cost on a small
    machine). Pools hold either way. The GPU stages are their own processes
    anyway (the gpu_host resource).
    """
    return Definitions(
        # deployed_draft is observed (sensor deployed_draft_watch), never materialised here; capacity_plan
        # reads the run's state (job plan_capacity), it is no step of the run; refinement_round is materialised
        # by hand, once per round, after draft_checkpoint (no whole-dataset run starts one).
        assets=[*ASSETS, capacity_plan, deployed_draft, refinement_round],
        resources=resources,
        sensors=ALL_SENSORS,
        jobs=[gpu_host_ready_job, plan_capacity_job, retire_shards_job],
        executor=in_process_executor,
    )
