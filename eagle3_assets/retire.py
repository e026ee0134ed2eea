"""Retire a sample shard (its files kept, the reason recorded), or restore one: a command and the UI's job.

Examples::

    python -m eagle3_assets.retire shard-00003 --reason "batch of prompts scraped twice"
    python -m eagle3_assets.retire --list
    python -m eagle3_assets.retire shard-00003 --restore

The command works on the Dagster instance of ``$DAGSTER_HOME`` (``make dev``'s
``.dagster``) and the data directory of ``$EAGLE3_DATA_DIR``, as the
webserver does; the UI's way is the job ``retire_shards`` (Launchpad: the
shards and the reason), whose run keeps who retired what and why in the run
log. Either way the shard's partition is deleted (a backfill of every shard no
longer includes it), its files stay, the new-shards sensor never registers it
again, and ``vocab_mapping`` / ``draft_checkpoint`` list it among the shards
left out with its reason. Exit status: 0 done, 2 bad input.
"""


import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from dagster import Config, DagsterInstance, OpExecutionContext, job, op
from pydantic import Field

from eagle3_assets.core.prompts.retired import record_path, retired_shards
from eagle3_assets.partitions import restore_shards, retire_shards


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_assets.retire", description="Retire (or restore) sample shards: files kept, reason recorded.")
    parser.add_argument("shards", nargs="*", help="shard keys, e.g. shard-00003")
    parser.add_argument("--reason", default="", help="why the shards are retired (required to retire)")
    parser.add_argument("--restore", action="store_true", help="restore the shards instead")
    parser.add_argument("--list", action="store_true", help="print the retired shards and their reasons")
    args = parser.parse_args(argv)
    try:
        if args.list:
            for key, record in sorted(retired_shards().items()):
                print(f"{key}\t{record['reason']}\t{record['retired_at']}\t{record['retired_by']}")
            return 0
        if not args.shards:
            raise ValueError("name at least one shard (or --list)")
        with DagsterInstance.get() as instance:
            print(apply(instance, args.shards, args.reason, args.restore))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
