"""``new_prompt_shards``: turns a grown prompt dataset into new shard partitions.

Shard keys never change meaning when rows are appended, so the sensor only adds
keys: those of new rows, or of a raised sample cap (``EAGLE3_MAX_SAMPLES``),
never a retired shard's. With ``EAGLE3_AUTO_GENERATE=1`` it also requests a generation run
(``prompts`` and ``raw_responses``) for each new shard; off by default, since
generation occupies the vLLM server.

A tick on an unchanged file costs one ``stat``: the cursor keeps the file's size
and mtime (and the shard size) from the last tick that looked inside, and the
sensor reads nothing while they match. A hub dataset has no such stamp and is
counted every tick, as before.
"""

import json

from dagster import AssetSelection, DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from eagle3_assets.core.settings.environment import AUTO_GENERATE
from eagle3_assets.glue.partitions import SAMPLE_SHARDS, sample_shards, unregistered
from resources.prompt_dataset import PromptDataset

AUTO_GENERATE_ENV = AUTO_GENERATE.name


@sensor(
    name="new_prompt_shards",
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.STOPPED,
    target=AssetSelection.groups("generation"),
    description="Adds the partition keys of new prompt shards; optionally requests their generation runs.",
)
def new_prompt_shards(context: SensorEvaluationContext, prompt_dataset: PromptDataset):
    version = prompt_dataset.file_version()
    seen = {**version, "shard_size": prompt_dataset.shard_size, "max_samples": prompt_dataset.max_samples} if version else None
    if seen is not None and context.cursor and json.loads(context.cursor) == seen:
        return SkipReason(
            f"{seen['path']} unchanged since the last look ({seen['size']} bytes, mtime_ns {seen['mtime_ns']}): nothing read"
        )
    cursor = json.dumps(seen, sort_keys=True) if seen else context.cursor
    known = set(context.instance.get_dynamic_partitions(SAMPLE_SHARDS))
    new = unregistered(context.instance, prompt_dataset.shard_keys())
    if not new:
        return SensorResult(skip_reason=SkipReason(f"no new shards ({len(known)} known)"), cursor=cursor)
    runs = []
    if AUTO_GENERATE.get():
        runs = [RunRequest(run_key=f"generate-{key}", partition_key=key) for key in new]
    context.log.info(f"adding {len(new)} shard(s): {new[0]} .. {new[-1]}")
    return SensorResult(run_requests=runs, dynamic_partitions_requests=[sample_shards.build_add_request(new)], cursor=cursor)
