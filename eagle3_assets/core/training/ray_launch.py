"""The one training loop over several nodes of a Ray cluster: torchrun on each, on the rendezvous Ray provides.

``train_draft`` with ``nnodes`` > 1 on a GPU host that is a Ray cluster. Ray
places one task on each of the first ``nnodes`` nodes of the stage's
placement (the nodes its pre-flight found fit); the first node's address and a
free port there are the rendezvous, and each task runs the same torchrun
worker as one host does (``python -m eagle3_assets.core.training``) with its
node rank. The loop is the same: DDP over ``nnodes x nproc`` ranks, checkpoints
to the shared training directory, resume from the newest one on a rerun. So a
run over two nodes of one process each ends with the weights of a run of two
processes on one host, and of one process with the same batches
(tests/test_ray_cluster.py holds the first to the last).

The ranks' events reach the stage as they are printed, through a Ray queue.
A node lost mid-run fails the run, naming it, once the other nodes are
stopped; the rerun resumes from the last checkpoint.
"""

from __future__ import annotations

import ctypes
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from eagle3_assets.core.cluster.placement import connect, first_line, on_this_node, pinned_to, placement
from eagle3_assets.core.storage.shard_paths import RESULT_FILE
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.launch import relay_events, write_launch_config
from eagle3_assets.core.training.loop import OnEvent

POLL_S = 0.5


def _rendezvous() -> tuple[str, int]:
    """On the first node: its address and a port free there."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _die_with_parent() -> None:
    # torchrun and its ranks must not outlive the Ray task (a cancelled or lost task): SIGTERM when it dies.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _node_rank(command: list[str], events) -> dict[str, Any]:
    """One node's torchrun: its events into ``events`` as they come; its exit code and last lines."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
    assert process.stdout is not None
    tail = relay_events(process.stdout, events.put)
    return {"returncode": process.wait(), "tail": tail, "host": socket.gethostname()}


def run_training_on_cluster(config: TrainConfig, nproc: int, nnodes: int, on_event: OnEvent, python: str = sys.executable) -> dict:
    """DDP over ``nnodes`` nodes of ``nproc`` processes each; result.json of the run."""
    import ray
    from ray.util.queue import Queue

    connect()
    where = placement()
    nodes = list(where["nodes"])[:nnodes]
    if len(nodes) < nnodes:
        raise RuntimeError(
            f"train_draft: nnodes is {nnodes}, but the Ray cluster has {len(where['nodes'])} node(s) that can train; lower nnodes or add nodes"
        )
    gpus = nproc if int(where.get("gpus_per_engine") or 0) > 0 else 0
    config_file = write_launch_config(config)
    address, port = ray.get(ray.remote(num_cpus=0)(_rendezvous).options(scheduling_strategy=pinned_to(nodes[0])).remote())
    events = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": on_this_node()})
    task = ray.remote(max_retries=0)(_node_rank)
    running = {}
    for rank, node in enumerate(nodes):
        command = [
            python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={rank}", f"--nproc-per-node={int(nproc)}",
            f"--master-addr={address}", f"--master-port={port}",
            "-m", "eagle3_assets.core.training", "--config", str(config_file),
        ]  # fmt: skip
        ref = task.options(num_cpus=max(1, nproc if gpus == 0 else 1), num_gpus=gpus, scheduling_strategy=pinned_to(node)).remote(command, events)
        running[ref] = (rank, node)

    def drain() -> None:
        while not events.empty():
            on_event(events.get_nowait())

    failure = None
    while running and failure is None:
        ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
        drain()
        for ref in ready:
            rank, node = running.pop(ref)
            try:
                done = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the node or its worker died (RayTaskError, WorkerCrashedError, NodeDiedError)
                failure = f"node rank {rank} ({node[:12]}) was lost: {first_line(exc)}"
                break
            if done["returncode"] != 0:
                failure = f"node rank {rank} on {done['host']}: torchrun exited with {done['returncode']}:\n" + "\n".join(done["tail"])
                break
    if failure is not None:
        for ref in running:  # the others wait on a rank that is gone: stop them, their torchrun dies with them
            ray.cancel(ref, force=True)
        raise RuntimeError(f"training over {nnodes} Ray nodes stopped: {failure}; a rerun resumes from the last checkpoint")
    drain()
    return json.loads((Path(config.training_dir) / RESULT_FILE).read_text())
