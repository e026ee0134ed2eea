"""``eagle3-gpu-check`` (``make gpu-check``): a GPU host's self-test before a long run, one table, non-zero on a failure.

On the built-in tiny target, each path the platform runs on a GPU host, in order:

1. ``extraction (transformers)``: the ``extract_hidden_states`` stage's own
   function on CUDA, bf16 states, every gate;
2. ``extraction (vllm)``: the same with the vLLM backend, when vLLM is installed;
3. ``training (bf16 autocast)``: a few hundred optimizer steps of the training
   loop on those states, with the memory plan of a real run;
4. ``export``: the vLLM-native directory and ``config_complete``'s checks;
5. ``loads_in_vllm``: vLLM serves the tiny target with that draft, when vLLM is installed;
6. ``bench``: the training step at the configured target's width
   (``--target``, default ``$EAGLE3_TARGET_MODEL``, else the Kimi-K2 preset)
   with the micro-batch the planner chooses on this GPU: tokens/s, share of the
   GPU's bf16 matrix-product rate, peak memory against the card's.

A path that cannot run here is *skipped* with the reason (no CUDA device, vLLM
not installed, an earlier path failed); a path that raises is *failed* with the
error. It needs torch (and transformers, safetensors, polars) but neither
vLLM nor Dagster, and imports nothing of Dagster (the last row says so).
``--allow-cpu`` runs the paths on the CPU of a host without CUDA (a check of
the self-test itself; its figures are no GPU's). Without a CUDA device the
command says so plainly in its last line (:data:`NO_GPU_PROVED`) and its JSON
summary (``"gpu_checked": false``): a pass there proves nothing about a GPU.

Fault injection for the tests: ``EAGLE3_GPU_CHECK_FAULT=<path name>`` makes
that path raise before it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.core.settings.environment import ALLOW_CPU, TARGET_MODEL
from eagle3_assets.demo.environment import GPU_CHECK_FAULT, TINY_TARGET_DIR

FAULT_ENV = GPU_CHECK_FAULT.name
# The verdict of a run without a CUDA device, whatever its table says: a pass on a CPU host is no GPU's.
NO_GPU_PROVED = "eagle3-gpu-check: this proved nothing about a GPU: there is no CUDA device on this host"
LAYER_IDS = [2, 3, 4]


@dataclass
class Row:
    path: str
    status: str = "skipped"  # passed | failed | skipped
    detail: str = ""
    tokens_per_s: float | None = None
    share: float | None = None  # of the device's matrix-product rate
    peak_bytes: int | None = None
    capacity_bytes: int | None = None


@dataclass
class Context:
    device: str | None  # None: the CUDA paths are skipped
    work: Path
    args: argparse.Namespace
    state: dict = field(default_factory=dict)


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.2f}" if n is not None else "-"


def render(rows: list[Row]) -> str:
    """The table: one line per path."""
    header = ("path", "result", "tokens/s", "share of GPU rate", "peak GiB / device GiB", "detail")
    lines = [header]
    for r in rows:
        peak = f"{_gib(r.peak_bytes)} / {_gib(r.capacity_bytes)}" if r.peak_bytes is not None else "-"
        lines.append(
            (r.path, r.status.upper(), f"{r.tokens_per_s:.0f}" if r.tokens_per_s else "-", f"{r.share:.3f}" if r.share is not None else "-", peak, r.detail)
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for i, line in enumerate(lines):
        out.append(" | ".join(c.ljust(w) for c, w in zip(line, widths)) + " | " + line[-1])
        if i == 0:
            out.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
    return "\n".join(out)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _peak(device: str) -> tuple[int | None, int | None]:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(), torch.cuda.get_device_properties(0).total_memory
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


# -- the paths ---------------------------------------------------------------------------------


def extraction(ctx: Context, backend: str) -> Row:
    from eagle3_assets.core.extraction.job import ExtractionJob, ExtractionShard, StageTarget
    from eagle3_assets.core.serving.profile import ServingProfile
    from eagle3_assets.core.target.identity import target_identity
    from eagle3_assets.demo.tiny_target import ensure_tiny_target
    from eagle3_assets.demo.validated_traces import write_validated_traces
    from eagle3_assets.stages.extract_hidden_states import run

    row = Row(f"extraction ({backend})")
    # The tiny target of $EAGLE3_TINY_TARGET_DIR when one is cached there (a build takes minutes), else built here.
    cached = TINY_TARGET_DIR.get()
    target = ctx.state.get("target") or ensure_tiny_target(Path(cached) if cached else ctx.work / "tiny_target", log=lambda line: None)
    ctx.state["target"] = target
    traces = ctx.state.get("traces") or write_validated_traces(ctx.work / "data", "shard-00000", target, count=ctx.args.samples)
    ctx.state["traces"] = traces
    output = ctx.work / "data" / f"hidden_states-{backend}" / "shard-00000"
    job = ExtractionJob(
        shards=[ExtractionShard(shard="shard-00000", traces=str(traces), output=str(output), data_version="gpu-check", check_seed=1)],
        target=StageTarget(path=str(target), trust_remote_code=False, aux_layer_ids=LAYER_IDS, config_hash=target_identity(target).config_hash,
            serving=ServingProfile(),
        ),
        backend=backend, dtype="bfloat16", recompute=True,
    )  # fmt: skip
    _reset_peak(ctx.device)
    started = time.monotonic()
    (result,) = run(job, log=lambda line: None)
    outcomes = result.outcomes
    elapsed = time.monotonic() - started
    failed = [o for o in outcomes if not o.passed]
    row.status = "failed" if failed or result.stopped else "passed"
    row.detail = result.stopped or "; ".join(f"{o.name}: {o.description}" for o in failed) or f"{len(outcomes)} gates passed"
    tokens = sum(int(n) for n in __import__("polars").read_parquet(traces, columns=["num_tokens"])["num_tokens"])
    row.tokens_per_s = tokens / elapsed if elapsed > 0 else None
    row.peak_bytes, row.capacity_bytes = _peak(ctx.device)
    if not failed and backend == "transformers":
        ctx.state["states"] = str(output)
    return row


def training(ctx: Context) -> Row:
    import torch

    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.loop import train
    from eagle3_assets.core.training.sources import StoredShards
    from eagle3_assets.core.draft.vocab import build_vocab_mapping, save_vocab_mapping

    row = Row("training")
    states = ctx.state["states"]
    counts = torch.zeros(640, dtype=torch.int64)
    from safetensors.torch import load_file

    for part in Path(states).glob("part-*.safetensors"):
        tensors = load_file(str(part))
        counts += torch.bincount(tensors["input_ids"][tensors["loss_mask"] == 1].long(), minlength=640)
    mapping = save_vocab_mapping(ctx.work / "vocab_mapping", build_vocab_mapping(counts, 200), {})
    config = TrainConfig(
        hidden_state_dirs=[states], vocab_mapping=str(mapping), target_path=str(ctx.state["target"]),
        training_dir=str(ctx.work / "training"), learning_rate=2e-3, warmup_ratio=0.05, ttt_steps=3, batch_tokens=256,
        max_seq_len=256, seed=0, log_every=10**9, bf16_autocast=True, epochs=1,
    )  # fmt: skip
    source = StoredShards(config.hidden_state_dirs)
    source.describe(config)
    per_epoch = source.steps_per_epoch(config, 1)
    config = TrainConfig(**{**config.to_dict(), "epochs": max(1, -(-ctx.args.train_steps // per_epoch))})
    _reset_peak(ctx.device)
    result = train(config)
    losses = [r["loss"] for r in result.history]
    row.tokens_per_s = result.tokens_per_s
    row.peak_bytes, row.capacity_bytes = _peak(ctx.device)
    went_down = losses[-1] < losses[0]
    row.status = "passed" if went_down else "failed"
    precision = "bf16 autocast" if ctx.device.startswith("cuda") else "float32 on the CPU"
    row.detail = f"{len(losses)} steps ({precision}), loss {losses[0]:.3f} -> {losses[-1]:.3f}" + ("" if went_down else " (did not go down)")
    ctx.state["checkpoint"] = result.checkpoint
    return row


def export(ctx: Context) -> Row:
    from eagle3_assets.core.draft.export import config_problems
    from eagle3_assets.core.training.checkpoints import export_trained_draft

    out = export_trained_draft(ctx.state["checkpoint"], ctx.state["target"], ctx.work / "model", dtype="bfloat16")
    problems = config_problems(out, LAYER_IDS, target_vocab_size=640)
    ctx.state["draft"] = out
    return Row("export", "failed" if problems else "passed", "; ".join(problems) or f"config_complete passed ({out})")


def loads_in_vllm(ctx: Context) -> Row:
    from eagle3_assets.core.draft.load_check import check_loads_in_vllm
    from eagle3_assets.core.serving.profile import ServingProfile

    # The host's own EAGLE3_* profile, on purpose: the self-test checks this host as it is configured.
    report = check_loads_in_vllm(
        Path(ctx.state["target"]), ctx.state["draft"], num_speculative_tokens=3, log_path=ctx.work / "vllm.log", profile=ServingProfile()
    )
    return Row("loads_in_vllm", "passed" if report.passed else "failed", report.detail)


def bench(ctx: Context) -> Row:
    from eagle3_assets.core.training import throughput

    target = ctx.args.target or TARGET_MODEL.get()
    argv = ["--device", ctx.device, "--ttt", str(ctx.args.bench_depth), "--steps", str(ctx.args.bench_steps), "--warmup", "1", "--plan", "--norms", "plain"]
    argv += ["--target", target] if target else ["--preset", ctx.args.bench_preset]
    if not ctx.device.startswith("cuda"):
        argv += ["--matmul-size", "512", "--matmul-repeats", "3"]
    (result,) = throughput.run(throughput.parser().parse_args(argv))
    where = f"target {target}" if target else f"preset {ctx.args.bench_preset}"
    return Row(
        "bench", "passed",
        f"{where}, depth {ctx.args.bench_depth}, {result['batch'] * result['seq_len']} tokens per micro-batch (planned), {result['tflops']:.2f} TFLOP/s "
        f"against {result['reference_tflops']:.2f} for one matrix product; estimate {_gib(result['estimate_bytes'])} GiB",
        result["tokens_per_s"], result["share"], result["peak_bytes"], result["capacity_bytes"],
    )  # fmt: skip


PATHS = [
    ("extraction (transformers)", lambda ctx: extraction(ctx, "transformers"), [], False),
    ("extraction (vllm)", lambda ctx: extraction(ctx, "vllm"), [], True),
    ("training", training, ["extraction (transformers)"], False),
    ("export", export, ["training"], False),
    ("loads_in_vllm", loads_in_vllm, ["export"], True),
    ("bench", bench, [], False),
]


def check(ctx: Context) -> list[Row]:
    """Every path's row, in order: run, failed, or skipped with the reason."""
    rows: list[Row] = []
    outcome: dict[str, str] = {}
    fault = GPU_CHECK_FAULT.get()
    for name, path, needs, needs_vllm in PATHS:
        if ctx.device is None:
            row = Row(name, detail="no CUDA device on this host (torch.cuda.is_available() is False): CUDA path not run")
        elif needs_vllm and not _installed("vllm"):
            row = Row(name, detail="vLLM is not installed on this host")
        elif any(outcome.get(n) != "passed" for n in needs):
            row = Row(name, detail=f"needs {', '.join(needs)}, which did not pass")
        else:
            try:
                if fault == name:
                    raise RuntimeError(f"fault injected by {FAULT_ENV}={fault}")
                row = path(ctx)
                row.path = name
            except Exception as exc:  # noqa: BLE001 - a failed path is a row of the table, the rest still run
                row = Row(name, "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                (ctx.work / f"{name.split()[0]}.traceback.txt").write_text(traceback.format_exc())
        outcome[name] = row.status
        rows.append(row)
    dagster = sorted(m for m in sys.modules if m == "dagster" or m.startswith("dagster."))
    rows.append(Row("imports", "failed" if dagster else "passed", f"Dagster imported: {dagster[:3]}" if dagster else "no Dagster module imported"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="where the check's files go (default: a temporary directory, removed after)")
    parser.add_argument("--allow-cpu", action="store_true", help="run the paths on the CPU when there is no CUDA device")
    parser.add_argument("--samples", type=int, default=48, help="traces of the tiny target to extract")
    parser.add_argument("--train-steps", type=int, default=300, help="optimizer steps of the training path (at least)")
    parser.add_argument("--target", help="the bench's width: a target's HF directory (default: $EAGLE3_TARGET_MODEL, else --bench-preset)")
    parser.add_argument("--bench-preset", default="kimi-k2", help="the bench's preset when no target is configured")
    parser.add_argument("--bench-depth", type=int, default=7, help="ttt_steps of the bench")
    parser.add_argument("--bench-steps", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() else ("cpu" if args.allow_cpu else None)
    if device == "cpu":
        os.environ[ALLOW_CPU.name] = "1"  # the stages refuse a CPU unless told
    if device == "cpu" and args.bench_preset == "kimi-k2" and not args.target:
        args.bench_preset = "tiny"  # a Kimi-width step takes minutes on a CPU: the self-test checks the path, not the figure
    with tempfile.TemporaryDirectory(prefix="eagle3-gpu-check-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("EAGLE3_DATA_DIR", str(work / "data"))
        name = torch.cuda.get_device_name(0) if device == "cuda" else "no CUDA device"
        print(f"eagle3-gpu-check: torch {torch.__version__}, {name}; files in {work}")
        rows = check(Context(device, work, args))
        print(render(rows))
        failed = [r.path for r in rows if r.status == "failed"]
        skipped = [r.path for r in rows if r.status == "skipped"]
        print(json.dumps({"failed": failed, "skipped": skipped, "gpu_checked": device == "cuda"}))
        if device is None:
            print(f"{NO_GPU_PROVED}; every CUDA path was skipped (--allow-cpu runs them on the CPU). Run it on the GPU host.")
        elif device == "cpu":
            print(f"{NO_GPU_PROVED}; the paths ran on the CPU (--allow-cpu): a check of the self-test itself, its figures this CPU's.")
    return 1 if failed else 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
