"""A stage's placement on a Ray cluster, as its GPU host set it, and the Ray calls that follow it.

The GPU host's Ray pre-flight (:mod:`eagle3_assets.core.gpu_host.ray_cluster`)
finds the nodes that fit a stage and sets them, with the GPUs each engine
takes, in the stage job's ``$EAGLE3_RAY_PLACEMENT``. Extraction builds one
engine on each of those nodes (:mod:`eagle3_assets.core.extraction.ray_engines`),
training takes the first ``nnodes`` (:mod:`eagle3_assets.core.training.ray_launch`).

Ray is imported only inside the functions that need it: the package imports
this module without Ray installed.
"""

from __future__ import annotations

from typing import Any

from eagle3_assets.core.settings.environment import RAY_PLACEMENT

# The stage job's environment variable that carries the placement (nodes, GPUs per engine).
PLACEMENT_ENV = RAY_PLACEMENT.name


def placement() -> dict[str, Any]:
    """The stage's placement: ``nodes`` (Ray node ids, the driver's own first) and ``gpus_per_engine``."""
    value = RAY_PLACEMENT.get()
    if not value or not value.get("nodes"):
        raise RuntimeError(f"${PLACEMENT_ENV} is not set: this stage runs on a Ray cluster only as a job its GPU host submitted")
    return value


def on_ray_cluster() -> bool:
    """Whether this stage process was started by a Ray cluster GPU host (its placement is set)."""
    return RAY_PLACEMENT.is_set()


def pinned_to(node_id: str):
    """Ray's scheduling strategy that puts a task or actor on ``node_id`` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def on_this_node():
    """Ray's scheduling strategy for this process's own node: what must live as long as the driver (its log queue),
    and not die with a node the run can lose."""
    import ray

    return pinned_to(ray.get_runtime_context().get_node_id())


def connect() -> None:
    """Join the cluster this job runs on (Ray sets its address in the job's environment); idempotent."""
    import ray

    if not ray.is_initialized():
        # The engines' and workers' own output stays in their nodes' logs: the stage reports what matters itself.
        ray.init(log_to_driver=False, logging_level="ERROR")


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line (Ray's errors run to tracebacks)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
