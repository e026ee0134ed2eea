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

from eagle3_assets.demo.plugin import SAMPLING, TRAINING_CONFIG, VOCAB_MAPPING_CONFIG, DemoPromptDataset
from eagle3_assets.demo.targets import DemoTarget, selected_demo_target
from eagle3_assets.graph import PER_SHARD_ASSETS, WHOLE_DATASET_ASSETS, deployment_resources
from eagle3_assets.partitions import register_shards
from resources.vllm_server import VLLMServerResource


def demo_resources(base_url: str, served_model_name: str, demo: DemoTarget | None = None) -> dict:
    """The resources of the embedded default for one of its targets, pointed at a demo vLLM server."""
    demo = demo or selected_demo_target()
    return {
        # the demo's own target and prompts, whatever EAGLE3_TARGET_MODEL and EAGLE3_PROMPTS say
        **deployment_resources(demo.target_model(), DemoPromptDataset(holdout_share=demo.holdout_share)),
        "vllm_server": VLLMServerResource(base_urls=[base_url], served_model_name=served_model_name, **SAMPLING),
    }


@dataclass
class DemoOutcome:
    ok: bool
    run_ids: dict[str, str] = field(default_factory=dict)
    failed: str | None = None


def run_per_shard(
    instance: DagsterInstance,
    base_url: str,
    served_model_name: str,
    log: Callable[[str], None] = print,
    demo: DemoTarget | None = None,
    shards: int | None = None,
) -> DemoOutcome:
    """The demo dataset's shards (every one, or the first ``shards``) through the per-sample assets, one run per shard."""
    resources = demo_resources(base_url, served_model_name, demo)
    keys = resources["prompt_dataset"].shard_keys()[:shards]
    register_shards(instance, keys)
    outcome = DemoOutcome(ok=True)
    for key in keys:
        result = materialize(PER_SHARD_ASSETS, partition_key=key, resources=resources, instance=instance, raise_on_error=False)
        outcome.run_ids[key] = result.run_id
        log(f"demo: {key}: {'ok' if result.success else 'FAILED'} (run {result.run_id})")
        _log_failed_gates(result, log)
        if not result.success:
            return DemoOutcome(ok=False, run_ids=outcome.run_ids, failed=key)
    return outcome


def run_whole_dataset(
    instance: DagsterInstance, log: Callable[[str], None] = print, demo: DemoTarget | None = None, evaluation: dict | None = None
) -> DemoOutcome:
    """Vocabulary, training + export + load gate, and evaluation, over every shard.

    These start vLLM servers of their own (the target with a draft), so the
    generation server should be stopped first on a small machine.
    """
    demo = demo or selected_demo_target()
    resources = demo_resources("http://127.0.0.1:0", "unused", demo)  # no generation here
    ops = {"vocab_mapping": VOCAB_MAPPING_CONFIG, "draft_checkpoint": TRAINING_CONFIG}
    if evaluation:  # draft_evaluation's settings where a caller gives its own (a test adds a prompt set of its own)
        ops["draft_evaluation"] = evaluation
    run_config = RunConfig(ops=ops)
    result = materialize(WHOLE_DATASET_ASSETS, resources=resources, instance=instance, run_config=run_config, raise_on_error=False)
    log(f"demo: whole-dataset assets: {'ok' if result.success else 'FAILED'} (run {result.run_id})")
    _log_failed_gates(result, log)
    return DemoOutcome(ok=result.success, run_ids={"whole_dataset": result.run_id}, failed=None if result.success else "whole_dataset")


def _log_failed_gates(result, log: Callable[[str], None]) -> None:
    """Each failed gate with its own words: what to look at, without opening the UI."""
    for evaluation in result.get_asset_check_evaluations():
        if not evaluation.passed:
            log(f"demo:   {evaluation.asset_key.to_user_string()} {evaluation.check_name} failed: {evaluation.description}")
