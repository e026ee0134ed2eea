"""The demo's whole graph, as a function: ``make demo`` runs it, and so does the end-to-end test.

Per shard, the per-sample assets against a running vLLM server; then, over all
shards, the draft vocabulary, training with export and the vLLM load gate, and
the evaluation through vLLM speculative decoding. Every run goes into the given
instance, so the UI shows them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dagster import DagsterInstance, RunConfig, materialize

from eagle3_assets.definitions import PER_SHARD_ASSETS, WHOLE_DATASET_ASSETS, demo_resources
from eagle3_assets.draft_checkpoint import DEMO_TRAINING_CONFIG
from eagle3_assets.draft_evaluation import DraftEvaluationConfig
from eagle3_assets.partitions import register_shards
from eagle3_assets.vocab_mapping import DEMO_VOCAB_MAPPING_CONFIG


# The demo's prompts come with their own held-out set (demo/prompt_set.py), disjoint from its training prompts.
DEMO_EVALUATION_CONFIG = DraftEvaluationConfig(eval_prompts="demo")


@dataclass
class DemoOutcome:
    ok: bool
    run_ids: dict[str, str] = field(default_factory=dict)
    failed: str | None = None


def run_per_shard(instance: DagsterInstance, base_url: str, served_model_name: str, log: Callable[[str], None] = print) -> DemoOutcome:
    """Every shard of the demo dataset through the per-sample assets, one run per shard."""
    resources = demo_resources(base_url, served_model_name)
    keys = resources["prompt_dataset"].shard_keys()
    register_shards(instance, keys)
    outcome = DemoOutcome(ok=True)
    for key in keys:
        result = materialize(PER_SHARD_ASSETS, partition_key=key, resources=resources, instance=instance, raise_on_error=False)
        outcome.run_ids[key] = result.run_id
        log(f"demo: {key}: {'ok' if result.success else 'FAILED'} (run {result.run_id})")
        if not result.success:
            return DemoOutcome(ok=False, run_ids=outcome.run_ids, failed=key)
    return outcome


def run_whole_dataset(instance: DagsterInstance, log: Callable[[str], None] = print) -> DemoOutcome:
    """Vocabulary, training + export + load gate, and evaluation, over every shard.

    These start vLLM servers of their own (the target with a draft), so the
    generation server should be stopped first on a small machine.
    """
    resources = demo_resources("http://127.0.0.1:0", "unused")  # no generation here
    run_config = RunConfig(
        ops={"vocab_mapping": DEMO_VOCAB_MAPPING_CONFIG, "draft_checkpoint": DEMO_TRAINING_CONFIG, "draft_evaluation": DEMO_EVALUATION_CONFIG}
    )
    result = materialize(WHOLE_DATASET_ASSETS, resources=resources, instance=instance, run_config=run_config, raise_on_error=False)
    log(f"demo: whole-dataset assets: {'ok' if result.success else 'FAILED'} (run {result.run_id})")
    return DemoOutcome(ok=result.success, run_ids={"whole_dataset": result.run_id}, failed=None if result.success else "whole_dataset")
