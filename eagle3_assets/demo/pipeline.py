"""The demo's whole graph, as a function: ``make demo`` runs it, and so does the end-to-end test.

The per-sample assets over the shards against a running vLLM server, as a backfill runs them; then, over all
shards, the draft vocabulary, training with export and the vLLM load gate, and
the evaluation through vLLM speculative decoding. Every run goes into the given
instance, so the UI shows them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dagster import DagsterInstance, ExecuteInProcessResult, RunConfig, materialize

from eagle3_assets.demo.plugin import SAMPLING, TRAINING_CONFIG, VOCAB_MAPPING_CONFIG, DemoPromptDataset
from eagle3_assets.demo.targets import DemoTarget, selected_demo_target
from eagle3_assets.graph import PER_SHARD_ASSETS, WHOLE_DATASET_ASSETS, deployment_resources
from eagle3_assets.glue.partitions import register_shards, shard_range_tags
from resources.vllm_server import VLLMServerResource

# The console of `make demo` (and of whoever runs these functions): the stages' progress lines and findings, INFO and
# above. Dagster's own step events (~600 lines a demo) are DEBUG: they still go to the instance's event log, which the
# UI shows in full, but no longer scroll the figures off the terminal.
CONSOLE_LOGGERS = {"console": {"config": {"log_level": "INFO"}}}


def demo_resources(base_url: str, served_model_name: str, demo: DemoTarget | None = None) -> dict:
    """The resources of the embedded default for one of its targets, pointed at a demo vLLM server."""
    demo = demo or selected_demo_target()
    own_prompts = {"source": str(demo.prompts_path())} if demo.prompts_path else {}
    return {
        # the demo's own target and prompts, whatever EAGLE3_TARGET_MODEL and EAGLE3_PROMPTS say
        **deployment_resources(demo.target_model(), DemoPromptDataset(holdout_share=demo.holdout_share, **own_prompts)),
        "vllm_server": VLLMServerResource(base_urls=[base_url], served_model_name=served_model_name, **(demo.sampling or SAMPLING)),
    }


@dataclass
class DemoOutcome:
    ok: bool
    run_ids: dict[str, str] = field(default_factory=dict)
    failed: str | None = None


def shard_runs(asset, keys: Sequence[str]) -> list[list[str]]:
    """The runs a backfill of ``keys`` makes for ``asset``: ranges of at most its backfill policy's shards per run
    (one range for ``single_run``), else one run per shard."""
    policy = asset.backfill_policy
    if policy is None:
        return [[key] for key in keys]
    per_run = policy.max_partitions_per_run or len(keys)
    return [list(keys[i : i + per_run]) for i in range(0, len(keys), per_run)]


def materialize_shards(instance: DagsterInstance, resources: dict, keys: Sequence[str], log: Callable[[str], None] = print) -> list[ShardRun]:
    """``keys`` through the per-shard assets as a backfill runs them: asset after asset, each in the runs of its
    backfill policy. A ranged run keeps the server busy across shard boundaries (``raw_responses``) and loads the
    target once for all its shards (``hidden_states``); one run per shard would start the extraction once per shard.
    Stops at the first failed run, whose shards the next asset would not have."""
    runs = []
    for asset in PER_SHARD_ASSETS:
        for shards in shard_runs(asset, keys):
            options = {"partition_key": shards[0]} if len(shards) == 1 else {"tags": shard_range_tags(shards[0], shards[-1])}
            result = materialize(
                PER_SHARD_ASSETS, selection=[asset.key], resources=resources, instance=instance, raise_on_error=False,
                run_config=RunConfig(loggers=CONSOLE_LOGGERS), **options,
            )  # fmt: skip
            run = ShardRun(asset.key.to_user_string(), shards, result)
            runs.append(run)
            log(f"demo: {run.label}: {'ok' if result.success else 'FAILED'} (run {result.run_id})")
            _log_failed_gates(result, log)
            if not result.success:
                return runs
    return runs


@dataclass
class ShardRun:
    """One run of :func:`materialize_shards`: an asset over one shard or a range of them."""

    asset: str
    shards: list[str]
    result: ExecuteInProcessResult

    @property
    def label(self) -> str:
        shards = self.shards[0] if len(self.shards) == 1 else f"{self.shards[0]}..{self.shards[-1]}"
        return f"{self.asset} {shards}"


def run_per_shard(
    instance: DagsterInstance,
    base_url: str,
    served_model_name: str,
    log: Callable[[str], None] = print,
    demo: DemoTarget | None = None,
    shards: int | None = None,
) -> DemoOutcome:
    """The demo dataset's shards (every one, or the first ``shards``) through the per-sample assets (:func:`materialize_shards`)."""
    resources = demo_resources(base_url, served_model_name, demo)
    keys = resources["prompt_dataset"].shard_keys()[:shards]
    register_shards(instance, keys)
    runs = materialize_shards(instance, resources, keys, log)
    failed = next((run.label for run in runs if not run.result.success), None)
    return DemoOutcome(ok=failed is None, run_ids={run.label: run.result.run_id for run in runs}, failed=failed)


def run_whole_dataset(
    instance: DagsterInstance, log: Callable[[str], None] = print, demo: DemoTarget | None = None, evaluation: dict | None = None
) -> DemoOutcome:
    """Vocabulary, training + export + load gate, and evaluation, over every shard.

    These start vLLM servers of their own (the target with a draft), so the
    generation server should be stopped first on a small machine.
    """
    demo = demo or selected_demo_target()
    resources = demo_resources("http://127.0.0.1:0", "unused", demo)  # no generation here
    ops = {"vocab_mapping": VOCAB_MAPPING_CONFIG, "draft_checkpoint": demo.training or TRAINING_CONFIG}
    # draft_evaluation's settings: the target's own, and where a caller gives its own (a test adds a prompt set)
    settings = {**(demo.evaluation or {}), **(evaluation or {}).get("config", {})}
    if settings:
        ops["draft_evaluation"] = {"config": settings}
    run_config = RunConfig(ops=ops, loggers=CONSOLE_LOGGERS)
    result = materialize(WHOLE_DATASET_ASSETS, resources=resources, instance=instance, run_config=run_config, raise_on_error=False)
    log(f"demo: whole-dataset assets: {'ok' if result.success else 'FAILED'} (run {result.run_id})")
    _log_failed_gates(result, log)
    return DemoOutcome(ok=result.success, run_ids={"whole_dataset": result.run_id}, failed=None if result.success else "whole_dataset")


def _log_failed_gates(result, log: Callable[[str], None]) -> None:
    """Each failed gate with its own words: what to look at, without opening the UI."""
    for evaluation in result.get_asset_check_evaluations():
        if not evaluation.passed:
            log(f"demo:   {evaluation.asset_key.to_user_string()} {evaluation.check_name} failed: {evaluation.description}")
