"""Run the training on the stored shards in this process, or under ``torchrun`` with one process per GPU.

``python -m eagle3_assets.core.training --config launch_config.json`` is the
torchrun worker (the one docs/training.md runs by hand); its events reach the
launcher as prefixed JSON lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from eagle3_assets.core.storage.shard_paths import RESULT_FILE
from eagle3_assets.core.storage.files import write_json_atomic
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.loop import Event, OnEvent, train

EVENT_PREFIX = "EAGLE3_TRAIN_EVENT "


def run_training(config: TrainConfig, nproc: int = 1, on_event: OnEvent | None = None, python: str = sys.executable) -> dict:
    """Train in this process (``nproc == 1``) or under ``torchrun`` with ``nproc`` processes; return result.json.

    Over several nodes of a Ray cluster: :func:`eagle3_assets.core.training.ray_launch.run_training_on_cluster`."""
    on_event = on_event or (lambda event: None)
    if nproc <= 1:
        result = train(config, on_event=on_event)
        return asdict(result) | {"history": None}
    config_file = write_launch_config(config)
    command = [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(nproc)}",
        "-m", "eagle3_assets.core.training", "--config", str(config_file),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    tail = relay_events(process.stdout, on_event)
    if process.wait() != 0:
        raise RuntimeError(f"torchrun training exited with {process.returncode}:\n" + "\n".join(tail))
    return json.loads((Path(config.training_dir) / RESULT_FILE).read_text())


def write_launch_config(config: TrainConfig) -> Path:
    """The config every torchrun worker reads (``--config``), in the training directory."""
    training_dir = Path(config.training_dir)
    training_dir.mkdir(parents=True, exist_ok=True)
    config_file = training_dir / "launch_config.json"
    write_json_atomic(config_file, config.to_dict())
    return config_file


def relay_events(lines: Iterable[str], on_event: OnEvent, keep: int = 40) -> list[str]:
    """Each event the ranks print on ``lines`` to ``on_event``; the last ``keep`` other lines (for an error)."""
    tail: list[str] = []
    decoder = json.JSONDecoder()
    for line in lines:
        if EVENT_PREFIX not in line:
            tail = (tail + [line.rstrip()])[-keep:]
            continue
        # Every rank writes to this one pipe: two ranks' writes can land on one line, so each event is
        # decoded where its prefix starts, and whatever follows it on the line is not taken for JSON.
        for chunk in line.split(EVENT_PREFIX)[1:]:
            on_event(decoder.raw_decode(chunk.strip())[0])
    return tail


def print_event(event: Event) -> None:
    print(EVENT_PREFIX + json.dumps(event, default=str), flush=True)


def main(argv: list[str] | None = None) -> None:
    """The torchrun worker: ``python -m eagle3_assets.core.training --config launch_config.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a JSON file of TrainConfig fields")
    args = parser.parse_args(argv)
    train(TrainConfig.from_json(Path(args.config).read_text()), on_event=print_event)


if __name__ == "__main__":
    main()
