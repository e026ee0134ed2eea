"""The GPU host as a Ray cluster, on the cluster's side: the pre-flight over its nodes, and where a stage's work goes.

The orchestrator submits every stage as a Ray job (``resources/ray_jobs.py``).
Before the stage, it submits this module as a job of its own::

    python -m eagle3_assets.core.gpu_host.ray_cluster '<spec json>'

which prints one JSON report as its last line, like :mod:`.preflight`:

- on the node that runs the job's driver (the stage runner, its lock, the data
  directory it writes): the SSH host's checks, GPUs aside (a head node
  usually has none);
- on every alive node, as a task pinned to it: the modules the stage needs,
  the node's eagle3-assets against the orchestrator's, and its GPUs (nvidia-smi
  and the GPUs Ray was started with) against what the stage needs per engine.

A node whose code differs fails the pre-flight: the stage would run other code
there. A node short of GPUs is only left out (a CPU-only head is the usual
case); none left is a failure naming each node and why. The nodes that fit,
in order (the driver's own node first), become the stage's placement
(``$EAGLE3_RAY_PLACEMENT``, :mod:`eagle3_assets.core.cluster.placement`):
extraction builds one engine on each, training takes the first ``nnodes``.

Ray is imported only where it runs: the rest of the package imports this
module's names without Ray installed.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from eagle3_assets.core.cluster.placement import first_line
from eagle3_assets.core.gpu_host import preflight as host_checks

PROBE_TIMEOUT_S = 120.0


def node_checks(spec: Mapping[str, Any]) -> dict[str, Any]:
    """On one node (a Ray task pinned there): what the stage needs of it; ``failures`` refuse the stage, ``unfit`` leaves the node out."""
    import ray

    context = ray.get_runtime_context()
    report: dict[str, Any] = {
        "node_id": context.get_node_id(),
        "host": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "python": sys.executable,
        "failures": [],
        "unfit": [],
    }
    for name in spec["modules"]:
        _version, error = host_checks.import_module_version(name)
        if error:
            report["failures"].append(f"module {name}: does not import in {sys.executable}: {error}")
    if spec.get("code_version"):
        code = host_checks.code_version()
        report["code_version"] = {k: v for k, v in code.items() if k != "files"}
        problem = host_checks.code_version_problem(code, spec["code_version"], sys.executable)
        if problem:
            report["failures"].append(problem)
    gpus, reason_none = host_checks.query_gpus(spec.get("nvidia_smi", "nvidia-smi"))
    report["gpus"] = len(gpus)
    report["unfit"] += host_checks.evaluate_gpus(
        gpus,
        reason_none,
        stage=spec["stage"],
        cpu_allowed=spec["cpu_allowed"],
        min_gpus=spec["min_gpus"],
        min_free_mib=spec["min_free_gpu_memory_mib"],
    )
    return report


def gpus_per_engine(spec: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> int:
    """The GPUs each engine asks Ray for: the stage's need where the fitting nodes have GPUs, none on a CPU cluster."""
    return int(spec["min_gpus"]) if any(n.get("ray_gpus", 0) > 0 for n in nodes) else 0


def cluster_preflight(spec: Mapping[str, Any], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The driver node's checks, then every alive node's; the report, with the placement when it passes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The driver's node runs the runner and writes the data: lock, disk, partial files, modules, code. Its GPUs
    # are the engines' business, checked per node below.
    driver_spec = {**spec, "min_gpus": 0, "cpu_allowed": True, "min_free_gpu_memory_mib": 0, "systemd_units": {}}
    report = host_checks.run_preflight(driver_spec)
    for key in ("gpus", "gpu_note", "gpu_processes"):
        report.pop(key, None)
    failures: list[str] = list(report["failures"])

    ray.init(log_to_driver=False, logging_level="ERROR")
    driver_node = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    # The driver's own node first, then the others in a stable order: the order engines are placed in.
    alive.sort(key=lambda n: (n["NodeID"] != driver_node, n.get("NodeManagerAddress", ""), n["NodeID"]))
    probe = ray.remote(num_cpus=0, max_retries=0)(node_checks)
    pending = {
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(dict(spec)): n for n in alive
    }
    ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    nodes: list[dict[str, Any]] = []
    for ref in pending:
        node = pending[ref]
        ray_gpus = int(node.get("Resources", {}).get("GPU", 0))
        where = f"node {node.get('NodeManagerAddress')} ({node['NodeID'][:12]})"
        if ref in late:
            checked = {"node_id": node["NodeID"], "failures": [f"{where}: did not answer the pre-flight within {timeout_s:.0f}s"], "unfit": []}
        else:
            try:
                checked = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a node that died or cannot start a worker: one line, named
                checked = {"node_id": node["NodeID"], "failures": [f"{where}: the pre-flight task failed: {type(exc).__name__}: {first_line(exc)}"], "unfit": []}
        checked["ip"] = checked.get("ip") or node.get("NodeManagerAddress")
        checked["ray_gpus"] = ray_gpus
        if spec["min_gpus"] > 0 and not spec["cpu_allowed"] and ray_gpus < spec["min_gpus"] and not checked["unfit"]:
            checked["unfit"].append(f"Ray was started there with {ray_gpus} GPU(s) (ray start --num-gpus); stage {spec['stage']} needs {spec['min_gpus']}")
        if node.get("Resources", {}).get("CPU", 0) < 1:  # an engine or a trainer asks Ray for one CPU: it would wait forever
            checked["unfit"].append("Ray was started there with no CPU (ray start --num-cpus 0): nothing of a stage can be placed on it")
        checked["driver"] = node["NodeID"] == driver_node
        checked["fits"] = not checked["failures"] and not checked["unfit"]
        failures += [line if line.startswith("node ") else f"{where}: {line}" for line in checked["failures"]]
        nodes.append(checked)
    fitting = [n for n in nodes if n["fits"]]
    wanted = int(spec.get("ray_engines") or 0)
    if not fitting and not failures:
        why = "; ".join(f"node {n['ip']}: {', '.join(n['unfit'])}" for n in nodes) or "the cluster has no alive node"
        failures.append(f"Ray cluster: no node can run stage {spec['stage']} ({why}); add nodes with the GPUs it needs")
    elif wanted > len(fitting) and not failures:
        failures.append(
            f"Ray cluster: gpu_host.ray_engines is {wanted}, but {len(fitting)} node(s) can run stage {spec['stage']}; "
            "lower it (0: every node that fits) or add nodes"
        )
    chosen = fitting[:wanted] if wanted else fitting
    report["ray"] = {
        "nodes": nodes,
        "placement": {"nodes": [n["node_id"] for n in chosen], "gpus_per_engine": gpus_per_engine(spec, chosen)},
    }
    report["failures"] = failures
    report["ok"] = not failures
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eagle3_assets.core.gpu_host.ray_cluster '<spec json>'``: the report as the last line of stdout."""
    return host_checks.main(argv, check=cluster_preflight)


if __name__ == "__main__":
    sys.exit(main())
