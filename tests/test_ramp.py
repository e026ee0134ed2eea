"""A ramp-up on the demo, as the story's operator ramped 10 -> 1,000 -> 10,000: one shard, then three, then all, training after each step.

Each step raises the sample cap (``prompt_dataset.max_samples``, what
``EAGLE3_MAX_SAMPLES`` sets); the ``new_prompt_shards`` sensor registers the
shards the new cap fills, and only those run through the per-shard assets
(against the session's real vLLM server); then ``vocab_mapping`` and
``draft_checkpoint`` (a short recipe: the point is the ramp, not the draft's
quality) train on every green shard, and every gate of every step passes,
``loads_in_vllm`` included. The capacity plan follows: after each step it has
measured more shards.
"""

from __future__ import annotations

import pytest
from dagster import AssetKey, DagsterInstance, RunConfig, build_sensor_context, materialize

from eagle3_assets.capacity_plan import capacity_plan
from eagle3_assets.demo.pipeline import demo_resources
from eagle3_assets.demo.plugin import SHARD_SIZE, DemoPromptDataset
from eagle3_assets.draft_checkpoint import DraftTrainingConfig, draft_checkpoint
from eagle3_assets.graph import PER_SHARD_ASSETS
from eagle3_assets.partitions import SAMPLE_SHARDS
from eagle3_assets.vocab_mapping import VocabMappingConfig, vocab_mapping
from sensors.new_shards import new_prompt_shards

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]

# Enough to train and export a draft that vLLM loads; the demo's own recipe (20 epochs) is the end-to-end test's.
SHORT_TRAINING = DraftTrainingConfig(epochs=2, learning_rate=3e-3, warmup_ratio=0.05, ttt_steps=2, batch_tokens=1024, max_seq_len=512)


def test_a_ramp_from_one_to_three_to_all_shards_trains_green_after_each_step(vllm_server, data_dir):
    instance = DagsterInstance.ephemeral()
    resources = demo_resources(vllm_server.base_url, vllm_server.served_model_name)
    every_shard = resources["prompt_dataset"].shard_keys()
    assert len(every_shard) > 3  # the demo's prompts fill a handful of shards
    cursor, done, planned = None, [], []
    for cap in (SHARD_SIZE, 3 * SHARD_SIZE, None):
        dataset = DemoPromptDataset(holdout_share=resources["prompt_dataset"].holdout_share, max_samples=cap)
        step = {**resources, "prompt_dataset": dataset}
        tick = new_prompt_shards(build_sensor_context(instance=instance, cursor=cursor, resources={"prompt_dataset": dataset}))
        cursor = tick.cursor
        for request in tick.dynamic_partitions_requests:
            instance.add_dynamic_partitions(SAMPLE_SHARDS, list(request.partition_keys))
        registered = instance.get_dynamic_partitions(SAMPLE_SHARDS)
        assert registered == every_shard[: len(registered)] and len(registered) == (len(every_shard) if cap is None else cap // SHARD_SIZE)

        for key in [k for k in registered if k not in done]:  # only the shards the raised cap added
            shard = materialize(PER_SHARD_ASSETS, partition_key=key, resources=step, instance=instance, raise_on_error=False)
            assert shard.success, key
            assert all(e.passed for e in shard.get_asset_check_evaluations()), [(e.check_name, e.description) for e in shard.get_asset_check_evaluations() if not e.passed]
            done.append(key)

        trained = materialize(
            [vocab_mapping, draft_checkpoint], resources=step, instance=instance, raise_on_error=False,
            run_config=RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=256), "draft_checkpoint": SHORT_TRAINING}),
        )  # fmt: skip
        assert trained.success, f"training after the ramp to {len(registered)} shard(s) failed"
        failed = [(e.check_name, e.description) for e in trained.get_asset_check_evaluations() if not e.passed and e.check_name != "loss_decreased"]
        assert not failed, failed  # loss_decreased is advisory: two epochs of a short recipe may not show it
        for asset in ("vocab_mapping", "draft_checkpoint"):
            metadata = instance.get_latest_materialization_event(AssetKey(asset)).asset_materialization.metadata
            assert metadata["shards_used"].value == registered and metadata["shards_left_out"].value == {}, asset

        plan = materialize([capacity_plan], resources=step, instance=instance, raise_on_error=False)
        assert plan.success and plan.get_asset_check_evaluations()[0].passed
        figures = plan.get_asset_materialization_events()[0].materialization.metadata
        assert figures["shards_extracted"].value == len(registered) == figures["shards"].value
        assert figures["rates_tokens_per_s"].value["extraction"]["source"].startswith(f"measured on {len(registered)} shard(s)")
        planned.append(figures["projected_tokens"].value)
    assert planned == sorted(planned) and planned[0] < planned[-1]  # the plan grew with the ramp
