"""Retire a sample shard (its files kept, the reason recorded), or restore one, from the command line.

Examples::

    python -m eagle3_assets.retire shard-00003 --reason "batch of prompts scraped twice"
    python -m eagle3_assets.retire --list
    python -m eagle3_assets.retire shard-00003 --restore

The command works on the Dagster instance of ``$DAGSTER_HOME`` (``make dev``'s
``.dagster``) and the data directory of ``$EAGLE3_DATA_DIR``, as the
webserver does; the UI's way is the job ``retire_shards``
(:mod:`eagle3_assets.defs.retire_shards`, which this command calls). Either way the shard's partition is deleted (a backfill of every shard no
longer includes it), its files stay, the new-shards sensor never registers it
again, and ``vocab_mapping`` / ``draft_checkpoint`` list it among the shards
left out with its reason. Exit status: 0 done, 2 bad input.
"""


import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from dagster import DagsterInstance

from eagle3_assets.core.prompts.retired import retired_shards
from eagle3_assets.defs.retire_shards import apply


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
