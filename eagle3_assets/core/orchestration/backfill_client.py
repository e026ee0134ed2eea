"""Backfills of chosen sample shards through the Dagster webserver's GraphQL API.

For a dataset of thousands of shards, ticking partitions in the UI's dialog is
not a workflow: this client launches the same asset backfill the dialog does
(the ``launchPartitionBackfill`` mutation with ``assetSelection`` and
``partitionNames``), from a list of shard keys or every registered shard.

Shard names are checked against the partitions the webserver knows before
anything is launched, because Dagster accepts a backfill of an unregistered
dynamic partition and only fails later, inside the daemon; a typo should fail
here, naming the shard. The standard library only (``urllib``): this talks
HTTP, it needs neither Dagster nor an instance.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.core.prompts.sharding import PER_SHARD_ASSETS, SAMPLE_SHARDS

# Backfill statuses after which nothing more happens (Dagster's BulkActionStatus).
FINISHED = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
SUCCEEDED = {"COMPLETED", "COMPLETED_SUCCESS"}


class BackfillError(Exception):
    """A backfill could not be launched or followed; the message says why."""


class UnknownShardsError(BackfillError):
    def __init__(self, unknown: Sequence[str], registered: Sequence[str]):
        self.unknown = list(unknown)
        shown = ", ".join(self.unknown[:20]) + (f" (+{len(self.unknown) - 20} more)" if len(self.unknown) > 20 else "")
        known = f"{len(registered)} registered: {registered[0]} .. {registered[-1]}" if registered else "none registered"
        super().__init__(
            f"unknown shard(s): {shown} ({known}); register new shards first "
            f"(eagle3_assets.glue.partitions.register_shards or the new_prompt_shards sensor)"
        )


@dataclass
class BackfillStatus:
    backfill_id: str
    status: str
    partitions: list[str]
    assets: list[str]
    # per asset: targeted, in progress, materialized, failed
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def succeeded(self) -> bool:
        return self.status in SUCCEEDED

    def summary(self) -> str:
        parts = [f"{a}: {c['materialized']}/{c['targeted']} done, {c['failed']} failed, {c['in_progress']} running" for a, c in self.counts.items()]
        return f"backfill {self.backfill_id} {self.status}" + (f" ({'; '.join(parts)})" if parts else "")


def check_shards(requested: Sequence[str], registered: Sequence[str]) -> list[str]:
    """The requested shards, de-duplicated in order; :class:`UnknownShardsError` names any not registered."""
    wanted = list(dict.fromkeys(s.strip() for s in requested if s.strip()))
    if not wanted:
        raise BackfillError("no shard given")
    known = set(registered)
    unknown = [s for s in wanted if s not in known]
    if unknown:
        raise UnknownShardsError(unknown, list(registered))
    return wanted


_ASSET_NODES = """
query ShardAssets($keys: [AssetKeyInput!]) {
  assetNodes(assetKeys: $keys) {
    assetKey { path }
    isPartitioned
    partitionDefinition { dimensionTypes { dynamicPartitionsDefinitionName } }
    partitionKeys
  }
}"""

_LAUNCH = """
mutation LaunchShardBackfill($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
    ... on PartitionSetNotFoundError { message }
    ... on PartitionKeysNotFoundError { message }
    ... on UnauthorizedError { message }
    ... on InvalidSubsetError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}"""

_STATUS = """
query ShardBackfill($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill {
      id
      status
      partitionNames
      assetSelection { path }
      assetBackfillData {
        assetBackfillStatuses {
          ... on AssetPartitionsStatusCounts {
            assetKey { path }
            numPartitionsTargeted numPartitionsInProgress numPartitionsMaterialized numPartitionsFailed
          }
        }
      }
    }
    ... on BackfillNotFoundError { message }
    ... on PythonError { message }
  }
}"""


class BackfillClient:
    """Launches and follows shard backfills on one Dagster webserver (``url``: its base, e.g. ``http://127.0.0.1:3000``)."""

    def __init__(self, url: str, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise BackfillError(f"the Dagster webserver at {self.url} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise BackfillError(f"cannot reach the Dagster webserver at {self.url} ({reason}): is `make dev` running?") from None
        if payload.get("errors"):
            raise BackfillError(f"GraphQL error from {self.url}: " + "; ".join(e.get("message", str(e)) for e in payload["errors"]))
        return payload["data"]

    def registered_shards(self, assets: Sequence[str]) -> list[str]:
        """The shard keys the instance knows, after checking that every asset exists and is sharded."""
        if not assets:
            raise BackfillError("no asset given")
        nodes = self.graphql(_ASSET_NODES, {"keys": [{"path": a.split("/")} for a in assets]})["assetNodes"]
        by_name = {"/".join(n["assetKey"]["path"]): n for n in nodes}
        missing = [a for a in assets if a not in by_name]
        if missing:
            raise BackfillError(f"unknown asset(s): {', '.join(missing)} (the per-shard assets: {', '.join(PER_SHARD_ASSETS)})")
        unsharded = [a for a, n in by_name.items() if not _is_sharded(n)]
        if unsharded:
            raise BackfillError(
                f"asset(s) not partitioned by sample shard: {', '.join(unsharded)}; "
                f"backfill only the per-shard assets ({', '.join(PER_SHARD_ASSETS)}) and materialise the others once"
            )
        # Every selected asset shares the sample_shards partitions; the first one's keys are everyone's.
        return list(by_name[assets[0]]["partitionKeys"])

    def launch(self, assets: Sequence[str], shards: Sequence[str], run_config: dict | None = None, title: str | None = None) -> str:
        """Launch one asset backfill of ``assets`` x ``shards`` (already checked); return its id."""
        params: dict[str, Any] = {
            "assetSelection": [{"path": a.split("/")} for a in assets],
            "partitionNames": list(shards),
            "tags": [{"key": "eagle3/launched_by", "value": "eagle3_assets.backfill"}],
        }
        if title:
            params["title"] = title
        if run_config:
            params["runConfigData"] = run_config
        result = self.graphql(_LAUNCH, {"params": params})["launchPartitionBackfill"]
        if result["__typename"] == "LaunchBackfillSuccess":
            return result["backfillId"]
        if result["__typename"] == "RunConfigValidationInvalid":
            raise BackfillError("run config rejected: " + "; ".join(e["message"] for e in result["errors"]))
        raise BackfillError(f"backfill not launched ({result['__typename']}): {result.get('message', '')}")

    def status(self, backfill_id: str) -> BackfillStatus:
        result = self.graphql(_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        if result["__typename"] != "PartitionBackfill":
            raise BackfillError(f"backfill {backfill_id}: {result.get('message', result['__typename'])}")
        counts = {}
        for entry in (result.get("assetBackfillData") or {}).get("assetBackfillStatuses", []):
            if "assetKey" in entry:  # partitioned assets only; the union also has unpartitioned ones
                counts["/".join(entry["assetKey"]["path"])] = {
                    "targeted": entry["numPartitionsTargeted"],
                    "in_progress": entry["numPartitionsInProgress"],
                    "materialized": entry["numPartitionsMaterialized"],
                    "failed": entry["numPartitionsFailed"],
                }
        return BackfillStatus(
            backfill_id=result["id"],
            status=result["status"],
            partitions=list(result.get("partitionNames") or []),
            assets=["/".join(k["path"]) for k in result.get("assetSelection") or []],
            counts=counts,
        )

    def wait(
        self, backfill_id: str, timeout_s: float, poll_s: float = 5.0, on_poll: Callable[[BackfillStatus], None] | None = None
    ) -> BackfillStatus:
        """Poll until the backfill is finished; :class:`BackfillError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status(backfill_id)
            if on_poll:
                on_poll(status)
            if status.finished:
                return status
            if time.monotonic() > deadline:
                raise BackfillError(f"still {status.status} after {timeout_s:.0f}s: {status.summary()}")
            time.sleep(poll_s)

    def backfill_url(self, backfill_id: str) -> str:
        return f"{self.url}/runs/b/{backfill_id}"


def _is_sharded(node: dict[str, Any]) -> bool:
    if not node["isPartitioned"]:
        return False
    dims = (node.get("partitionDefinition") or {}).get("dimensionTypes") or []
    return any(d.get("dynamicPartitionsDefinitionName") == SAMPLE_SHARDS for d in dims)
