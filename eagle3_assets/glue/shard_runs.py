"""One run over a range of shards, each shard still its own partition in Dagster's records.

A backfill of a per-shard asset whose definition carries
``BackfillPolicy.multi_run(max_partitions_per_run=N)`` becomes runs over ranges
of up to N shards (a single shard from the UI is a range of one). Such a run
keeps one server busy across shard boundaries (``raw_responses``) or loads the
target once for all its shards (``hidden_states``); Dagster's own output event
would record one materialization for the whole range, with one data version
and no check result per shard. So these assets are ``multi_asset``s with
``can_subset=True`` (their outputs and check outputs are optional) and report
each shard themselves as soon as it is durable, through :class:`ShardReporter`:

- an ``AssetMaterialization`` of that partition, with the shard's own metadata,
  data version and the input-provenance tags Dagster writes for its own
  materializations, so the UI's staleness and lineage stay per shard;
- one ``AssetCheckEvaluation`` per gate, for that partition.

A shard reported is recorded even when the run dies afterwards (SIGKILL, OOM):
the rerun of the range finds its files and journal, and does only the rest.
When a shard's blocking gate fails, the run still finishes the other shards and
then fails, naming every such shard (:meth:`ShardReporter.raise_for_blocked`),
which is what raises the UI's alert.

A run of ONE shard (the UI's materialise, ``materialize(..., partition_key=)``)
is reported through Dagster's own output instead (:meth:`ShardReporter.report`
keeps it, :meth:`ShardReporter.results` yields it as a ``MaterializeResult``):
an output the step does not yield makes Dagster skip every step downstream of
it in the same run, so a one-shard run of ``prompts -> raw_responses ->
validated_traces`` would stop after ``raw_responses``. Ranged runs come from
backfills, which put an asset with its own backfill policy in runs of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    BackfillPolicy,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
)
from dagster._core.definitions.data_version import (  # no public names for the tags Dagster writes on its own materializations
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)

from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.reporting.checks import CheckOutcome


def shards_per_run_policy(shards_per_run: int) -> BackfillPolicy:
    """How a backfill splits the shards of an asset into runs (a run over a range of at most ``shards_per_run``)."""
    if shards_per_run < 1:
        raise ValueError(f"shards per run must be at least 1, got {shards_per_run}")
    return BackfillPolicy.multi_run(max_partitions_per_run=shards_per_run)


class ShardReporter:
    """Reports each shard of a ranged run to Dagster as its own partition: materialization and gate results."""

    def __init__(self, context: AssetExecutionContext, gates: AssetChecks, code_version: str, upstream: Iterable[str] = ()):
        self.context = context
        self.gates = gates
        self.asset_key = AssetKey(gates.asset)
        self.code_version = code_version
        self.upstream = [AssetKey(name) for name in upstream]
        self.blocked: dict[str, list[str]] = {}  # shard -> the blocking gates it failed
        self.kept: list[MaterializeResult] = []  # a one-shard run's result, yielded by results()

    def _input_tags(self, shard: str) -> dict[str, str]:
        """The input-provenance tags of Dagster's own materializations: the upstream partition's version and event."""
        tags = {}
        for key in self.upstream:
            record = self.context.instance.get_latest_data_version_record(key, is_source=False, partition_key=shard)
            if record is None:
                continue
            materialization = record.asset_materialization or record.asset_observation
            version = (materialization.tags or {}).get(DATA_VERSION_TAG) if materialization else None
            if version is None:
                continue
            tags[get_input_data_version_tag(key)] = version
            tags[get_input_event_pointer_tag(key)] = str(record.storage_id)
        return tags

    def materialized(self, shard: str, metadata: Mapping[str, Any], data_version: DataVersion | str) -> None:
        """Records ``shard`` as materialized, with its own metadata and data version."""
        version = data_version.value if isinstance(data_version, DataVersion) else data_version
        tags = {
            CODE_VERSION_TAG: self.code_version,
            DATA_VERSION_TAG: version,
            DATA_VERSION_IS_USER_PROVIDED_TAG: "true",
            **self._input_tags(shard),
        }
        self.context.log_event(AssetMaterialization(self.asset_key, partition=shard, metadata=dict(metadata), tags=tags))

    def checked(self, shard: str, outcomes: Iterable[CheckOutcome]) -> list[str]:
        """Records the gates' outcomes for ``shard``; returns the names of the blocking gates that failed."""
        failed = []
        for outcome in outcomes:
            gate = self.gates.by_name.get(outcome.name)
            if gate is None:
                raise KeyError(f"{self.gates.asset} declares no check {outcome.name!r}; its checks: {self.gates.names}")
            self.context.log_event(
                AssetCheckEvaluation(
                    asset_key=self.asset_key,
                    check_name=outcome.name,
                    passed=outcome.passed,
                    metadata={
                        k: MetadataValue.json(v) if isinstance(v, (list, dict)) else v for k, v in outcome.metadata.items()
                    },
                    severity=self.gates.severity(outcome),
                    description=outcome.description or None,
                    blocking=gate.blocking,
                    partition=shard,
                )
            )
            if gate.blocking and not outcome.passed:
                failed.append(outcome.name)
        if failed:
            self.blocked[shard] = failed
        return failed

    def report(self, shard: str, metadata: Mapping[str, Any], data_version: DataVersion | str, outcomes: Iterable[CheckOutcome]) -> None:
        """One durable shard: recorded now in a ranged run; in a one-shard run kept for :meth:`results` (see the module)."""
        if len(self.context.partition_keys) > 1:
            self.materialized(shard, metadata, data_version)
            self.checked(shard, outcomes)
            return
        version = data_version if isinstance(data_version, DataVersion) else DataVersion(data_version)
        self.kept.append(
            MaterializeResult(
                asset_key=self.asset_key, metadata=dict(metadata), data_version=version,
                check_results=[self.gates.result(outcome) for outcome in outcomes],
            )
        )  # fmt: skip

    def results(self, stopped: Mapping[str, str] | None = None) -> Iterator[MaterializeResult]:
        """Ends the step: a one-shard run's result through Dagster's own output (its blocking gates as Dagster
        handles them); a ranged run fails here when a shard needs attention (:meth:`raise_for_blocked`)."""
        if self.kept:
            yield from self.kept
        if stopped or len(self.context.partition_keys) > 1:
            self.raise_for_blocked(stopped)

    def reported_through_pipes(self) -> None:
        """Call after a Pipes session whose stage reported the shards: its results are the events logged here.

        Opening a Pipes session makes Dagster require the step to yield every
        selected output and check (it expects ``get_results()``); a ranged run
        must not yield them, since Dagster would record one materialization, of
        one data version, for the whole range. Dagster has no public way to lift
        the requirement, so this resets the flag the session set.
        """
        self.context.get_step_execution_context()._requires_typed_event_stream = False

    def raise_for_blocked(self, stopped: Mapping[str, str] | None = None) -> None:
        """Fails the run when a shard's blocking gate failed or a shard stopped (``stopped``: shard -> why), naming each."""
        lines = [f"- {shard}: blocking check(s) failed: {', '.join(names)}" for shard, names in sorted(self.blocked.items())]
        lines += [f"- {shard}: {why}" for shard, why in sorted((stopped or {}).items())]
        if lines:
            done = len(self.context.partition_keys) - len(self.blocked) - len(stopped or {})
            raise Failure(
                f"{self.gates.asset}: {len(lines)} of {len(self.context.partition_keys)} shard(s) of this run need attention "
                f"({done} reported green); rerun those shards after fixing the cause:\n" + "\n".join(lines)
            )
