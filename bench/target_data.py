"""The per-shard graph and the draft vocabulary on any local target: the data ``training_defaults.py`` trains on.

What a user does to get training data from their own target, as a script:
serve the target with vLLM (reasoning parser of its family), materialise the
per-shard assets (prompts, raw_responses, validated_traces, hidden_states)
shard by shard with their gates, stop the server, then build
``vocab_mapping``. Outputs go under ``--data`` (``$EAGLE3_DATA_DIR``), runs into
the Dagster instance under ``$DAGSTER_HOME``. A rerun after a failure picks up
where the last one stopped (the assets resume by sample id).

    DAGSTER_HOME=/path/dagster .venv/bin/python bench/target_data.py --data /path/qwen3 \\
        --target .cache/qwen3_target --prompts data/demo/prompts.jsonl --reasoning-parser qwen3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="data directory the assets write into")
    parser.add_argument("--target", required=True, help="target model directory")
    parser.add_argument("--prompts", required=True, help="prompt set (jsonl), e.g. the demo's prompts.jsonl")
    parser.add_argument("--reasoning-parser", required=True, help="vLLM reasoning parser of the target's family (deepseek_r1, qwen3, kimi_k2...)")
    parser.add_argument("--served-model-name", default="target")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--draft-vocab-size", type=int, default=256)
    args = parser.parse_args()
    if not os.environ.get("DAGSTER_HOME"):
        sys.exit("set DAGSTER_HOME to the Dagster instance directory these runs should go into")
    os.environ["EAGLE3_DATA_DIR"] = str(Path(args.data).resolve())  # before the assets read it

    from dagster import DagsterInstance, RunConfig, materialize

    from eagle3_assets.core.serving.profile import ServingProfile
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer
    from eagle3_assets.demo.plugin import SAMPLING
    from eagle3_assets.graph import PER_SHARD_ASSETS, deployment_resources
    from eagle3_assets.glue.local_runs import fail_dead_runs
    from eagle3_assets.glue.partitions import register_shards
    from eagle3_assets.defs.vocab_mapping import VocabMappingConfig, vocab_mapping
    from resources.gpu_host import ensure_gpu_pool_limit
    from resources.prompt_dataset import PromptDataset
    from resources.target_model import TargetModel
    from resources.vllm_server import VLLMServerResource, ensure_generation_pool_limit

    target = Path(args.target).resolve()
    instance = DagsterInstance.get()
    fail_dead_runs(instance, log=print)
    ensure_generation_pool_limit(instance)
    ensure_gpu_pool_limit(instance)
    log_path = Path(args.data) / "vllm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    resources = deployment_resources(
        TargetModel(path=str(target), trust_remote_code=args.trust_remote_code),
        PromptDataset(source=str(Path(args.prompts).resolve()), shard_size=args.shard_size, holdout_share=0.0),
    )
    keys = resources["prompt_dataset"].shard_keys()
    register_shards(instance, keys)
    profile = ServingProfile(trust_remote_code=args.trust_remote_code, reasoning_parser=args.reasoning_parser)
    with VLLMServer(target, args.served_model_name, log_path=log_path, profile=profile) as server:
        resources["vllm_server"] = VLLMServerResource(base_urls=[server.base_url], served_model_name=args.served_model_name, **SAMPLING)
        for key in keys:
            result = materialize(PER_SHARD_ASSETS, partition_key=key, resources=resources, instance=instance, raise_on_error=False)
            print(f"target data: {key}: {'ok' if result.success else 'FAILED'} (run {result.run_id})", flush=True)
            for evaluation in result.get_asset_check_evaluations():
                if not evaluation.passed:
                    print(f"target data: {key}: gate {evaluation.check_name} failed: {dict(evaluation.metadata)}", flush=True)
            if not result.success:
                return 1
    run_config = RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=args.draft_vocab_size)})
    result = materialize([vocab_mapping], resources=resources, instance=instance, run_config=run_config, raise_on_error=False, selection=[vocab_mapping])
    print(f"target data: vocab_mapping: {'ok' if result.success else 'FAILED'} (run {result.run_id})", flush=True)
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main())
