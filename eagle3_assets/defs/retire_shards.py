"""The UI's way to retire a sample shard (its files kept, the reason recorded) or restore one: the job ``retire_shards``.

Launchpad: the shards and the reason; the run keeps who retired what and why
in its log. ``python -m eagle3_assets.retire`` is the same through the command
line. Either way the shard's partition is deleted (a backfill of every shard
no longer includes it), its files stay, the new-shards sensor never registers
it again, and ``vocab_mapping`` / ``draft_checkpoint`` list it among the shards
left out with its reason.
"""

from dagster import Config, DagsterInstance, OpExecutionContext, job, op
from pydantic import Field

from eagle3_assets.core.prompts.retired import record_path
from eagle3_assets.glue.partitions import restore_shards, retire_shards


class RetireShardsConfig(Config):
    shards: list[str] = Field(description="the shard keys to retire (or restore), e.g. ['shard-00003']")
    reason: str = Field(default="", description="why (required to retire): shown wherever the shard is left out")
    restore: bool = Field(default=False, description="take the shards off the retired record and register them again")


@op(description="Retire sample shards (files kept, reason recorded) or restore them")
def retire_shards_op(context: OpExecutionContext, config: RetireShardsConfig) -> None:
    context.log.info(apply(context.instance, config.shards, config.reason, config.restore))


@job(name="retire_shards", description="Retire sample shards: their partitions are deleted, their files kept, the reason recorded (or restore them)")
def retire_shards_job():
    retire_shards_op()


def apply(instance: DagsterInstance, shards: list[str], reason: str, restore: bool) -> str:
    """Retire or restore ``shards``; a line that says what changed."""
    if restore:
        restored = restore_shards(instance, shards)
        others = sorted(set(shards) - set(restored))
        return f"restored {restored or 'nothing'}" + (f"; not retired: {others}" if others else "")
    added = retire_shards(instance, shards, reason)
    kept = sorted(set(shards) - set(added))
    line = f"retired {sorted(added) or 'nothing'} ({reason.strip()}); files kept; record {record_path()}"
    return line + (f"; already retired: {kept}" if kept else "")
