"""``eagle3-gpu-check`` on this CPU host: the CUDA paths are skipped with the reason, and a failing path fails the command.

The command runs as a user runs it (``make gpu-check``, ``python -m
eagle3_assets.demo.gpu_check``), in a process of its own. With ``--allow-cpu`` its
paths run for real on the CPU (extraction of the tiny target, training,
export, the bench); the export is made to fail by fault injection
(``EAGLE3_GPU_CHECK_FAULT``), named as such in the table.

Neither run proves anything about a GPU (this host has none), and the
command's last line and JSON summary must say so: a pass here is not a GPU
host's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from eagle3_assets.demo.gpu_check import NO_GPU_PROVED

REPO = Path(__file__).resolve().parents[1]


def run_check(command: list[str], tiny_target: Path, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "EAGLE3_TINY_TARGET_DIR": str(tiny_target), **env}
    return subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=1200)


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) == 6 and cells[1] in ("PASSED", "FAILED", "SKIPPED"):
            rows[cells[0]] = cells
    return rows


def test_on_a_cpu_host_the_check_skips_the_cuda_paths_says_why_and_passes(tiny_target):
    done = run_check(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}"], tiny_target)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    cuda_paths = ["extraction (transformers)", "extraction (vllm)", "training", "export", "loads_in_vllm", "bench"]
    for path in cuda_paths:
        assert rows[path][1] == "SKIPPED" and "no CUDA device on this host" in rows[path][5], rows.get(path)
    assert rows["imports"][1] == "PASSED" and "no Dagster module imported" in rows["imports"][5]
    # Fails on the mutation that drops the statement (or prints it on a CUDA host's path only).
    assert done.stdout.splitlines()[-1].startswith(f"{NO_GPU_PROVED}; every CUDA path was skipped"), done.stdout[-500:]
    assert json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])["gpu_checked"] is False
    # The console script a user installs points at the same command.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["eagle3-gpu-check"] == "eagle3_assets.demo.gpu_check:cli"


def test_a_failing_path_fails_the_check_and_the_table_names_it(tiny_target, tmp_path):
    done = run_check(
        [sys.executable, "-m", "eagle3_assets.demo.gpu_check", "--allow-cpu", "--samples", "12", "--train-steps", "20",
         "--bench-depth", "2", "--bench-steps", "1", "--work", str(tmp_path)],
        tiny_target,
        EAGLE3_GPU_CHECK_FAULT="export",  # fault injection: the export path raises before it runs
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert rows["extraction (transformers)"][1] == "PASSED", rows
    assert float(rows["extraction (transformers)"][2]) > 0
    assert rows["training"][1] == "PASSED" and "loss" in rows["training"][5], rows["training"]
    assert rows["export"][1] == "FAILED" and "fault injected by EAGLE3_GPU_CHECK_FAULT=export" in rows["export"][5]
    assert rows["loads_in_vllm"][1] == "SKIPPED"  # it needs the export (or, without vLLM, vLLM)
    assert rows["bench"][1] == "PASSED" and float(rows["bench"][3]) > 0, rows["bench"]  # a share of the CPU's matmul rate
    assert rows["imports"][1] == "PASSED"
    summary = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["failed"] == ["export"] and summary["gpu_checked"] is False
    # The paths ran, on the CPU: said to prove nothing about a GPU (fails on the mutation that drops the statement).
    assert done.stdout.splitlines()[-1].startswith(f"{NO_GPU_PROVED}; the paths ran on the CPU (--allow-cpu)"), done.stdout[-500:]
