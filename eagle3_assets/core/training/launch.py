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
from dataclasses import asdict
from pathlib import Path

from eagle3_assets.core.storage.shard_paths import RESULT_FILE
from eagle3_assets.core.storage.files import write_json_atomic
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.loop import Event, OnEvent, train

EVENT_PREFIX = "EAGLE3_TRAIN_EVENT "


def run_training(config: TrainConfig, nproc: int = 1, on_event: OnEvent | None = None, python: str = sys.executable) -> dict:
    """Train in this process (``nproc == 1``) or under ``torchrun`` with ``nproc`` processes; return result.json."""
    on_event = on_event or (lambda event: None)
    if nproc <= 1:
        result = train(config, on_event=on_event)
        return asdict(result) | {"history": None}
    training_dir = Path(config.training_dir)
    training_dir.mkdir(parents=True, exist_ok=True)
    config_file = training_dir / "launch_config.json"
    write_json_atomic(config_file, config.to_dict())
    command = [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(nproc)}",
        "-m", "eagle3_assets.core.training", "--config", str(config_file),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert process.stdout is not None
    decoder = json.JSONDecoder()
    for line in process.stdout:
        if EVENT_PREFIX not in line:
            tail = (tail + [line.rstrip()])[-40:]
            continue
        # Every rank writes to this one pipe: two ranks' writes can land on one line, so each event is
        # decoded where its prefix starts, and whatever follows it on the line is not taken for JSON.
        for chunk in line.split(EVENT_PREFIX)[1:]:
            on_event(decoder.raw_decode(chunk.strip())[0])
    if process.wait() != 0:
        raise RuntimeError(f"torchrun training exited with {process.returncode}:\n" + "\n".join(tail))
    return json.loads((training_dir / RESULT_FILE).read_text())


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
