"""``bench/gpu_truth.py`` (``make gpu-truth``) on this CPU, as a lent GPU device would run it, without polars.

The device has torch but no polars, vLLM or Dagster, and a call carries at
most 64 MiB: polars alone is 55 MB. So the command runs here with polars made
unimportable (fault injection: a ``polars`` package on the path that raises
on import), every section at a small width on the CPU (``--allow-cpu``).
Each figure must say how it was obtained, and the figures that need vLLM on
CUDA must say why they were not measured and how to measure them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eagle3_assets.core.training.data import epoch_micro_batches

REPO = Path(__file__).resolve().parents[1]
HOW = {"measured", "derived", "estimate", "planned", "not measured"}


def run_truth(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    blocked = tmp_path / "no_polars"
    (blocked / "polars").mkdir(parents=True)
    # Fault injection: the lent device has no polars; the command and its child processes must not import it.
    (blocked / "polars" / "__init__.py").write_text("raise ImportError('fault injection: no polars on a lent GPU device')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)])}
    out = tmp_path / "gpu_truth.json"
    command = [sys.executable, "bench/gpu_truth.py", "--allow-cpu", "--out", str(out), "--carried", str(tmp_path / "nothing-carried"), *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_every_section_runs_without_polars_and_every_figure_says_how_it_was_obtained(kimi_target, tmp_path):
    done, report = run_truth(tmp_path, "--kimi-target", str(kimi_target), "--traces", "4")
    sections = {s["name"]: s for s in report["sections"]}
    # Fails when a module the sections import reads polars at import (the mutation: shard_files.py's `import polars`
    # back at the top fails kimi_family_extraction with the injected ImportError).
    assert {n: s["status"] for n, s in sections.items()} == {
        "kimi_width_step": "passed", "kimi_family_extraction": "passed", "packed_vs_padded": "passed", "needs_vllm_on_cuda": "skipped",
    }, {n: s["detail"] for n, s in sections.items()}  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert report["gpu_checked"] is False and "--allow-cpu" in report["device"]
    figures = {f["name"]: f for s in report["sections"] for f in s["figures"]}
    for figure in figures.values():
        assert figure["how"] in HOW and figure["source"], figure
        if figure["how"] == "measured":  # with what, on which device, in this run
            assert figure["source"].endswith(f"on {report['device']}, in this run"), figure
        if figure["how"] == "not measured":
            assert figure["value"] is None and "Measure it on a GPU host with vLLM: " in figure["source"], figure
    # A goal is judged only on a GPU: a CPU's figure neither meets nor misses it.
    assert all(f["met"] is None for f in figures.values() if f["name"].startswith(("P13", "P14"))), figures

    # The derived figures are the arithmetic they name, over this run's measured figures.
    step = figures["achieved TFLOP/s"]["value"] / figures["matrix product rate"]["value"]
    assert abs(figures["P13: share of the matrix rate"]["value"] - step) <= 0.01 * step + 0.002
    ratio = figures["padded tokens/s"]["value"] / figures["packed tokens/s"]["value"]
    assert abs(figures["packed over padded, time per token"]["value"] - ratio) < 0.01
    estimate, peak = figures["memory estimate"]["value"], figures["P14: peak memory"]["value"]
    assert abs(figures["estimate over measured peak"]["value"] - estimate / peak) < 0.02

    # The epoch is planned as training plans it: the bench's micro-batches are epoch_micro_batches' for the lengths.
    lengths = json.loads((tmp_path / "gpu_truth-work" / "cpu_lengths.json").read_text())
    for plan in ("padded", "packed"):
        planned = len(epoch_micro_batches(lengths, 256, seed=0, epoch=0, packed=plan == "packed"))
        assert f", {planned} {plan} micro-batches," in figures[f"{plan} tokens/s"]["source"], figures[f"{plan} tokens/s"]

    extraction = figures["gates passed"]
    assert extraction["met"] is True and extraction["value"].split(" of ")[0] == extraction["value"].split(" of ")[1]
    assert figures["argmax agreement"]["value"] >= 0.999
    needs_vllm = sections["needs_vllm_on_cuda"]["figures"]
    assert {f["name"] for f in needs_vllm} >= {"P5c on the Kimi family", "sampled acceptance, default against nla and lk_hybrid"}
    assert all("no CUDA device" in f["source"] for f in needs_vllm)
    assert done.stdout.splitlines()[-1].startswith("gpu-truth: these figures are this CPU's (--allow-cpu)")


def test_no_section_starts_once_the_budget_is_spent(tmp_path):
    done, report = run_truth(tmp_path, "--budget-s", "0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    statuses = {s["name"]: (s["status"], s["detail"]) for s in report["sections"]}
    for name in ("kimi_width_step", "kimi_family_extraction", "packed_vs_padded"):
        assert statuses[name] == ("skipped", "the 0 s budget was spent before it"), statuses
    assert report["install_s"] is None  # nothing carried: nothing installed, the command ran once
