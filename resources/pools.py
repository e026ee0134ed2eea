"""Dagster concurrency pools: the limit a pool gets on an instance unless one was set by hand."""

from __future__ import annotations

from dagster import DagsterInstance

from eagle3_assets.core.settings.environment import Variable


def ensure_pool_limit(instance: DagsterInstance, pool: str, limit_env: Variable, limit: int | None = None) -> int:
    """Give ``pool`` its limit on ``instance`` unless one was set already; return the limit in force.

    The limit is ``limit``, else the variable ``limit_env`` (its default: 1). A limit set by hand
    (``dagster instance concurrency set POOL N`` or the UI) is kept. An
    instance without global concurrency limits enforces none: the wanted limit
    is returned, nothing is set.
    """
    wanted = limit if limit is not None else limit_env.get()
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return wanted
    current = {p.name: p.limit for p in storage.get_pool_limits()}
    if current.get(pool) is not None:
        return current[pool]
    storage.set_concurrency_slots(pool, wanted)
    return wanted
