"""``python -m eagle3_assets.backfill``: launch a backfill of chosen sample shards through the webserver.

Examples::

    python -m eagle3_assets.backfill --shards shard-00000,shard-00003
    python -m eagle3_assets.backfill --all --assets prompts,raw_responses --wait
    python -m eagle3_assets.backfill --all --run-config sampling.yaml   # e.g. resources.vllm_server.config

The webserver (``make dev``, or any deployment's) must be running; the daemon
then runs the backfill as if launched from the UI's partitions dialog: a run
per shard, or per range of shards for an asset with a backfill policy
(``raw_responses``: ``EAGLE3_SHARDS_PER_RUN``; ``prompts``: all in one run). The logic lives in :mod:`eagle3_assets.core.orchestration.backfill_client`.
Exit status: 0 launched (with ``--wait``: and succeeded), 1 the backfill
failed or timed out, 2 bad input (unknown shard or asset, unreadable config,
webserver unreachable).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from eagle3_assets.core.orchestration.backfill_client import PER_SHARD_ASSETS, BackfillClient, BackfillError, check_shards
from eagle3_assets.core.settings.environment import DAGSTER_URL



def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eagle3_assets.backfill", description="Launch a backfill of sample shards through the Dagster webserver.")
    parser.add_argument("--url", default=DAGSTER_URL.get(), help=f"the webserver's base URL (default ${DAGSTER_URL.name} or {DAGSTER_URL.default})")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--shards", type=_names, help="comma-separated shard keys, e.g. shard-00000,shard-00003")
    which.add_argument("--shards-file", type=Path, help="a file of shard keys, one per line (for thousands of shards)")
    which.add_argument("--all", action="store_true", help="every registered shard")
    parser.add_argument("--assets", type=_names, default=list(PER_SHARD_ASSETS), help=f"comma-separated assets (default: {','.join(PER_SHARD_ASSETS)})")
    parser.add_argument("--run-config", type=Path, help="YAML or JSON run config applied to every run, e.g. {resources: {vllm_server: {config: ...}}}")
    parser.add_argument("--title", help="the backfill's title in the UI")
    parser.add_argument("--wait", action="store_true", help="follow the backfill until it finishes; exit 1 unless it succeeded")
    parser.add_argument("--timeout", type=float, default=24 * 3600, help="seconds --wait waits (default a day)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    client = BackfillClient(args.url)
    try:
        run_config = None
        if args.run_config:
            try:
                run_config = yaml.safe_load(args.run_config.read_text())  # JSON is YAML too
            except (OSError, yaml.YAMLError) as exc:
                raise BackfillError(f"cannot read the run config {args.run_config}: {exc}") from None
            if not isinstance(run_config, dict):
                raise BackfillError(f"the run config {args.run_config} is not a mapping")
        registered = client.registered_shards(args.assets)
        if args.all:
            if not registered:
                raise BackfillError("no shard is registered yet (eagle3_assets.glue.partitions.register_shards or the new_prompt_shards sensor)")
            shards = registered
        else:
            requested = args.shards if args.shards is not None else _read_shards_file(args.shards_file)
            shards = check_shards(requested, registered)
        backfill_id = client.launch(args.assets, shards, run_config=run_config, title=args.title)
    except BackfillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"launched backfill {backfill_id}: {len(shards)} shard(s) x {', '.join(args.assets)}", flush=True)
    print(f"  {client.backfill_url(backfill_id)}", flush=True)
    if not args.wait:
        return 0
    last = [""]

    def report(status) -> None:  # a line when something changed, not every poll
        if status.summary() != last[0]:
            last[0] = status.summary()
            print(f"  {last[0]}", flush=True)

    try:
        status = client.wait(backfill_id, args.timeout, on_poll=report)
    except BackfillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if status.succeeded else 1


def _read_shards_file(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    except OSError as exc:
        raise BackfillError(f"cannot read the shards file {path}: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
