"""Each shard's state in the instance, for the whole-dataset assets that train on the green ones.

Reads, per asset, the latest materialisation of each registered shard and the
blocking gates evaluated on that very materialisation (a gate's evaluation
names the materialisation it targeted: a multi-shard run's checks fall on the
right shard). A shard whose files are present but that this instance never
materialised (states copied from another instance, or placed by a test) is
green: its files are the record. The rule itself is Dagster-free:
:mod:`eagle3_assets.core.planning.shard_selection`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dagster import AssetCheckKey, AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance, MetadataValue

from eagle3_assets.core.planning.shard_selection import BLOCKED, GREEN, MISSING, ShardSelection, ShardVerdict, select_shards
from eagle3_assets.core.prompts.retired import retired_shards
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.glue.partitions import SAMPLE_SHARDS

PAGE = 1000
DESCRIPTION_CHARS = 240  # of a failed gate's words, per shard left out: the check itself holds the rest


def _has_output(asset: str) -> Callable[[str], bool]:
    """Whether a shard's output of ``asset`` is complete on this machine (the sidecar of a states directory is written last)."""
    if asset == "hidden_states":
        return lambda key: ShardPaths(asset, key).sidecar.is_file()
    return lambda key: ShardPaths(asset, key).parquet.is_file()


def records_filter(asset: str, keys: Sequence[str]) -> AssetRecordsFilter:
    """The materialisations of ``asset`` for ``keys``; of every shard when they are many (a query's parameters are bounded: SQLite's 32,766)."""
    return AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=list(keys) if len(keys) <= PAGE else None)


def latest_materializations(instance: DagsterInstance, asset: str, keys: Sequence[str]) -> dict[str, tuple[int, str]]:
    """Shard -> (storage id, run id) of its latest materialisation of ``asset``, for the shards that have one."""
    latest: dict[str, tuple[int, str]] = {}
    wanted = set(keys)
    cursor = None
    while wanted - set(latest):
        page = instance.fetch_materializations(records_filter(asset, keys), limit=PAGE, cursor=cursor)
        for record in page.records:  # newest first
            if record.partition_key in wanted and record.partition_key not in latest:
                latest[record.partition_key] = (record.storage_id, record.run_id)
        if not page.has_more:
            break
        cursor = page.cursor
    return latest


def gate_outcomes(instance: DagsterInstance, asset: str, check: str, latest: dict[str, tuple[int, str]]) -> dict[int, tuple[bool, str]]:
    """Materialisation storage id -> (passed, description) of the latest evaluation of ``check`` on it, for ``latest``'s.

    An evaluation names its materialisation; one reported per shard of a multi-shard run
    (:mod:`eagle3_assets.glue.shard_runs`) names its partition instead, in the run that materialised it.
    """
    targets = {storage_id for storage_id, _ in latest.values()}
    by_run_and_shard = {(run_id, key): storage_id for key, (storage_id, run_id) in latest.items()}
    found: dict[int, tuple[bool, str]] = {}
    cursor = None
    storage = instance.event_log_storage
    while targets - set(found):
        records = storage.get_asset_check_execution_history(AssetCheckKey(AssetKey(asset), check), limit=PAGE, cursor=cursor)
        for record in records:  # newest first
            event = record.event.dagster_event if record.event else None
            evaluation = event.event_specific_data if event and event.event_type == DagsterEventType.ASSET_CHECK_EVALUATION else None
            if evaluation is None:
                continue
            target = getattr(evaluation, "target_materialization_data", None)
            storage_id = target.storage_id if target is not None else by_run_and_shard.get((record.run_id, evaluation.partition))
            if storage_id in targets and storage_id not in found:
                found[storage_id] = (bool(evaluation.passed), evaluation.description or "")
        if len(records) < PAGE:
            break
        cursor = records[-1].id
    return found


def _shortened(text: str, limit: int = DESCRIPTION_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def shard_verdicts(instance: DagsterInstance, asset: str, blocking_checks: Sequence[str], keys: Sequence[str]) -> dict[str, ShardVerdict]:
    """Each shard's verdict for ``asset``: green, blocked by a failed blocking gate (its words), or missing."""
    has_output = _has_output(asset)
    latest = latest_materializations(instance, asset, keys)
    outcomes = {check: gate_outcomes(instance, asset, check, latest) for check in blocking_checks}
    verdicts = {}
    for key in keys:
        if not has_output(key):
            verdicts[key] = ShardVerdict(MISSING, "no output yet" if key not in latest else "materialised, but its files are not on this machine")
            continue
        if key not in latest:
            verdicts[key] = ShardVerdict(GREEN, "files present, never materialised in this instance")
            continue
        failed = []
        for check in blocking_checks:
            passed, description = outcomes[check].get(latest[key][0], (None, ""))
            if passed is None:
                failed.append(f"{check} not evaluated on the latest materialisation")
            elif not passed:
                failed.append(f"{check} failed" + (f" ({_shortened(description)})" if description else ""))
        verdicts[key] = ShardVerdict(BLOCKED, "; ".join(failed)) if failed else ShardVerdict(GREEN)
    return verdicts


def green_shards(instance: DagsterInstance, assets: dict[str, Sequence[str]], named: Sequence[str] | None = None) -> ShardSelection:
    """The registered shards green for every asset of ``assets`` (name -> its blocking gates), or the ``named`` ones, with the rest and why."""
    keys = sorted(instance.get_dynamic_partitions(SAMPLE_SHARDS))
    per_asset = {asset: shard_verdicts(instance, asset, checks, keys) for asset, checks in assets.items()}
    verdicts = {key: [(asset, per_asset[asset][key]) for asset in assets] for key in keys}
    return select_shards(keys, verdicts, retired_shards(), named)


def selection_metadata(selection: ShardSelection) -> dict:
    """The selection as an asset's metadata: the shards used, those left out and why."""
    return {name: MetadataValue.json(value) if isinstance(value, (list, dict)) else value for name, value in selection.as_metadata().items()}
