"""One extraction run over a Ray cluster's nodes: an engine per node, shards handed out as engines free up.

Called by ``extract_hidden_states`` when its GPU host is a Ray cluster (the
job's ``$EAGLE3_RAY_PLACEMENT`` names the nodes its pre-flight found fit and
the GPUs each engine takes). The stage process is the job's driver; each
engine is an actor pinned to its node, built once there with the target's
serving profile (one target load per engine per run, P11), and kept for the
whole run. Every shard goes to the first engine that is free, so a slow node
takes fewer shards and nothing waits for the slowest.

A node lost mid-run (its actor dies with it) loses the shard it held, and only
that shard: it is reported stopped, its lease is ended at once (the cluster
said its writer is gone: a rerun need not wait for the heartbeat to go stale),
and the other engines go on with the rest. It is not handed to another engine
in the same run: a shard that brought its node down (a trace too long for the
memory, say) would bring down every engine in turn. One rerun extracts it,
resuming from its durable parts, and keeps every finished shard.

The engines' log lines reach the stage's log through a Ray queue, as they are
written, prefixed with the engine and its node.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from eagle3_assets.core.cluster.placement import connect, first_line, on_this_node, pinned_to, placement

STAGE = "extract_hidden_states"
POLL_S = 0.5


class _QueueLog:
    """An engine's ``log``: each line into the driver's queue, prefixed with the engine and its node."""

    def __init__(self, queue, prefix: str):
        self.queue, self.prefix = queue, prefix

    def __call__(self, line: str) -> None:
        self.queue.put_nowait(f"{self.prefix} {line}")


def extract_on_cluster(
    engine_class,
    job,
    pending: list,
    longest: int,
    log: Callable[[str], None],
    run_id: str | None,
    done: Callable[[Any], None],
    stopped: Callable[[Any, str], Any],
) -> None:
    """Extract ``pending`` (the stage's ``_Pending`` without traces) over the placement's nodes.

    ``engine_class(job, longest, shard names, run_id, log)`` is the stage's engine (``extract(each)`` returns a
    result); each result goes to ``done`` as it comes, and ``stopped(each, why)`` makes the result of a lost shard.
    """
    import ray
    from ray.exceptions import RayActorError
    from ray.util.queue import Queue

    from eagle3_assets.core.storage.shard_lease import lapse

    connect()
    where = placement()
    nodes, gpus = list(where["nodes"]), int(where.get("gpus_per_engine") or 0)
    lines = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": on_this_node()})
    names = [each.spec.shard for each in pending]
    engine_actor = ray.remote(engine_class)
    addresses = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    engines = []
    for index, node in enumerate(nodes[: len(pending)]):  # never more engines than shards: each one loads the target
        prefix = f"[engine {index + 1}/{min(len(nodes), len(pending))} on {addresses.get(node, node[:12])}]"
        actor = engine_actor.options(
            num_cpus=1, num_gpus=gpus, scheduling_strategy=pinned_to(node), max_restarts=0, max_task_retries=0
        ).remote(job, longest, names, run_id, _QueueLog(lines, prefix))
        engines.append((actor, prefix))
    log(f"{STAGE}: {len(pending)} shard(s) over {len(engines)} engine(s), one per node ({gpus} GPU(s) each)")

    queue = deque(pending)
    inflight: dict[Any, tuple[int, Any]] = {}
    handed = {index: 0 for index in range(len(engines))}

    def hand_out(index: int) -> None:
        if queue:
            each = queue.popleft()
            inflight[engines[index][0].extract.remote(each)] = (index, each)
            handed[index] += 1

    def drain() -> None:
        while not lines.empty():
            log(lines.get_nowait())

    for index in range(len(engines)):
        hand_out(index)
    lost: list[str] = []
    while inflight:
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=POLL_S)
        drain()
        for ref in ready:
            index, each = inflight.pop(ref)
            prefix = engines[index][1]
            try:
                result = ray.get(ref)
            except RayActorError as exc:
                why = f"{prefix} was lost while it extracted this shard ({first_line(exc)})"
                lost.append(prefix)
                lapse(each.shard_dir.parent, each.shard_dir.name, run_id=run_id, why=why, log=log)
                log(f"{STAGE}: {each.spec.shard}: {why}; the other engines go on, and a rerun extracts it")
                done(stopped(each, f"{why}: rerun the run to extract it"))
                continue
            done(result)
            hand_out(index)
    drain()
    for each in queue:  # every engine was lost: nothing was started of these
        done(stopped(each, f"every engine of the run was lost ({', '.join(lost)}): rerun the run to extract it"))
    log(f"{STAGE}: shards per engine: " + ", ".join(f"{engines[i][1]} {handed[i]}" for i in handed))
    for actor, _ in engines:
        ray.kill(actor)
