"""``make gpu-truth``: on one GPU, within 9 minutes, the figures this project's CPU machines cannot give.

One table and one JSON file (``--out``, default ``gpu_truth.json``). Every
figure says how it was obtained: *measured* (with what, on which device, in
this run), *derived* (arithmetic over measured figures, named), *estimate*
(the memory plan's), or *not measured* (why, and the command that measures it
where it can run). Sections, in the order of what they are worth, each stopped
at the time budget (``--budget-s``, 540) rather than overrunning it:

1. ``kimi_width_step`` (P13, P14): the training step at Kimi-K2's width,
   depth 7, 8,192 tokens per sample, bf16 autocast, the default memory
   settings, on the micro-batch the memory plan chooses on this card: tokens/s,
   TFLOP/s against one bf16 matrix product timed in the same run, the measured
   peak against the plan's estimate (``core/training/throughput.py``).
2. ``kimi_family_extraction``: the built-in Kimi-family target (MLA, MoE,
   remote-code tokenizer) extracted on CUDA in bf16 by the transformers
   backend, with every hidden-states gate (``core/extraction``).
3. ``packed_vs_padded``: one epoch of the long-trace demo's sample lengths
   (``bench/long_trace_lengths.json``) at Kimi width, planned packed and
   padded as training plans them, time per token of each.
4. The figures that need vLLM on CUDA (P5c on the Kimi family, sampled
   acceptance of the default loss against ``nla`` and ``lk_hybrid``, EAGLE 3.1
   against plain under sampling, the Kimi-family extraction through vLLM):
   measured only where ``vllm`` imports and CUDA is present, else *not
   measured* with the reason and the ``bench/peer_acceptance.py`` command.

On a lent device (no network, 64 MiB carried per call, torch but no vLLM,
polars or pydantic): ``make gpu-truth-carry`` here first writes
``.gpu-truth/`` (the Python wheels the device lacks and the built Kimi-family
target); there, ``python3 bench/gpu_truth.py --out $OUT/gpu_truth.json``
installs the wheels into ``.gpu-truth/site`` and runs again with them on the
path. Nothing it runs needs polars or Dagster. ``--allow-cpu`` runs the
sections on a CPU at a small width (a check of the command itself; its
figures are this CPU's and say so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LENGTHS = REPO / "bench" / "long_trace_lengths.json"
CARRIED = REPO / ".gpu-truth"  # make gpu-truth-carry writes it; git ignores it; a lent device's call carries it
INSTALLED = "EAGLE3_GPU_TRUTH_SITE"  # set once the carried wheels are on the path (the command re-runs itself)
BUDGET_S = 540  # 9 minutes: a second run still fits in a lent device's 15
GOALS = {"P13": 0.50, "P14": 90e9}  # share of the bf16 matrix rate (at least); peak bytes (at most)
# What the device lacks that the sections import (pydantic: the settings; transformers: the version this project pins).
CARRIED_PACKAGES = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "transformers")


@dataclass
class Figure:
    name: str
    value: float | int | str | None
    unit: str
    how: str  # measured | derived | estimate | planned | not measured
    source: str  # with what, where; the arithmetic; or why not and the command
    goal: str = ""
    met: bool | None = None


@dataclass
class Section:
    name: str
    status: str = "skipped"  # passed | failed | skipped
    seconds: float = 0.0
    detail: str = ""
    figures: list[Figure] = field(default_factory=list)


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: a CPU's figures are small, and a fixed number of decimals would zero them."""
    return float(f"{x:.{digits}g}")


class Run:
    def __init__(self, args: argparse.Namespace, device: str, device_name: str):
        self.args, self.device, self.device_name = args, device, device_name
        self.cuda = device == "cuda"
        self.started = time.monotonic()
        self.work = Path(args.work)

    def measured(self, what: str) -> str:
        return f"{what}, on {self.device_name}, in this run"

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)


# -- the sections ------------------------------------------------------------------------------------------------


def throughput_rows(run: Run, extra: list[str]) -> list[dict]:
    from eagle3_assets.core.training import throughput

    width = ["--preset", "kimi-k2"] if run.cuda else ["--preset", "tiny"]
    # The platform's default norm flags (TrainConfig: norm_before_residual alone).
    argv = ["--device", run.device, *width, "--norms", "norm_before_residual", "--warmup", "1", *extra]
    if not run.cuda:
        argv += ["--matmul-size", "256", "--matmul-repeats", "3"]
    return throughput.run(throughput.parser().parse_args(argv))


def kimi_width_step(run: Run) -> list[Figure]:
    seq_len, steps = ("8192", "3") if run.cuda else ("256", "1")
    (row,) = throughput_rows(run, ["--ttt", "7" if run.cuda else "2", "--steps", steps, "--seq-len", seq_len, "--plan"])
    width = "Kimi-K2 width (7168), depth 7" if run.cuda else "the tiny width (64), depth 2 (--allow-cpu)"
    tokens = row["batch"] * row["seq_len"]
    peak, estimate = row["peak_bytes"], row["estimate_bytes"]
    peak_how = "torch.cuda.max_memory_allocated over the timed steps" if run.cuda else "the step's process's maximum RSS, torch included"
    share, p14 = row["share"], (peak <= GOALS["P14"]) if run.cuda else None
    return [
        Figure("matrix product rate", sig(row["reference_tflops"]), "TFLOP/s", "measured",
               run.measured(f"one {'bf16 8192x8192' if run.cuda else 'float32 256x256'} matrix product, mean of the timed repeats")),
        Figure("planned micro-batch", tokens, "tokens", "planned", f"the memory plan on this device, {width}, samples of {seq_len} tokens"),
        Figure("training tokens/s", round(row["tokens_per_s"]), "tokens/s", "measured", run.measured(f"{width}, {'bf16 autocast' if run.cuda else 'float32'}, default memory settings, {steps} timed optimizer step(s) after 1")),
        Figure("achieved TFLOP/s", sig(row["tflops"]), "TFLOP/s", "derived", f"{sig(row['gflop_per_token'])} GFLOP a token (counted, model FLOPs) x the measured tokens/s"),
        Figure("P13: share of the matrix rate", sig(share), "", "derived", "achieved TFLOP/s over the matrix product's, both of this run",
               f">= {GOALS['P13']:.2f}", share >= GOALS["P13"] if run.cuda else None),
        Figure("P14: peak memory", sig(peak / 1e9), "GB", "measured", run.measured(peak_how), f"<= {GOALS['P14'] / 1e9:.0f} GB", p14),
        Figure("memory estimate", sig(estimate / 1e9), "GB", "estimate", "the memory plan (core/training/memory.py) for this step's shape"),
        Figure("estimate over measured peak", sig(estimate / peak), "", "derived", "the two figures above"),
    ]  # fmt: skip


def packed_vs_padded(run: Run) -> list[Figure]:
    from eagle3_assets.core.training.throughput import read_lengths

    lengths_file = Path(run.args.lengths)
    lengths = read_lengths(str(lengths_file))
    if not run.cuda:  # the CPU's check of the command: the same plan's logic on lengths a tiny step takes in seconds
        lengths = [max(8, n // 32) for n in lengths[:12]]
        lengths_file = run.work / "cpu_lengths.json"
        lengths_file.write_text(json.dumps(lengths))
    depth = "7" if run.cuda else "2"
    rows = throughput_rows(run, ["--ttt", depth, "--lengths", str(lengths_file), "--packing", "padded", "packed", "--batch-tokens", "8192" if run.cuda else "256"])
    padded, packed = rows
    ratio = padded["tokens_per_s"] / packed["tokens_per_s"]
    what = f"one epoch of {len(lengths)} samples ({sum(lengths)} tokens, longest {max(lengths)}) at {'Kimi-K2 width' if run.cuda else 'the tiny width'}, depth {depth}"
    return [
        Figure("padded tokens/s", round(padded["tokens_per_s"]), "tokens/s", "measured", run.measured(f"{what}, {padded['micro_batches']} padded micro-batches, each step timed")),
        Figure("packed tokens/s", round(packed["tokens_per_s"]), "tokens/s", "measured", run.measured(f"{what}, {packed['micro_batches']} packed micro-batches, each step timed")),
        Figure("packed over padded, time per token", sig(ratio), "", "derived", "padded tokens/s over packed tokens/s, the two above", "<= 1.10", ratio <= 1.10 if run.cuda else None),
    ]  # fmt: skip


def kimi_family_extraction(run: Run) -> list[Figure]:
    import torch

    from eagle3_assets.core.extraction.hidden_state_checks import gate_extracted_shard, keep_logits_references
    from eagle3_assets.core.extraction.job import ExtractionRecipe
    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.traces import TargetFacts, Trace
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
    from eagle3_assets.core.target.description import default_aux_layer_ids
    from eagle3_assets.core.target.head import TargetHead
    from eagle3_assets.core.target.identity import config_hash
    from eagle3_assets.core.target.tokenizer import load_tokenizer
    from eagle3_assets.core.validation.chat_rendering import ChatRenderer
    from eagle3_assets.demo.prompt_set import make_traces

    target = Path(run.args.kimi_target)
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"--kimi-target {target}: no built target there (make gpu-truth-carry copies one into .gpu-truth/)")
    layer_ids = tuple(default_aux_layer_ids(int(json.loads((target / "config.json").read_text())["num_hidden_layers"])))
    renderer = ChatRenderer(load_tokenizer(target, trust_remote_code=True))
    traces = []
    for i, (question, reasoning, answer) in enumerate(make_traces(run.args.traces, seed=7)):
        rendered = renderer.render([{"role": "user", "content": question}], reasoning, answer)
        traces.append(Trace.of(f"kimi-{i:03d}", rendered.input_ids, rendered.loss_mask))
    recipe = ExtractionRecipe()
    backend = TransformersBackend(target, layer_ids, recipe, device=run.device, dtype=torch.bfloat16, trust_remote_code=True)
    shard = run.work / "kimi_family_states" / "shard-00000"
    shutil.rmtree(shard, ignore_errors=True)
    try:
        keep_logits_references(backend, traces, recipe.logits_check_samples, 1)
        started = time.perf_counter()
        report = extract_shard(traces, shard, ExtractionSettings(str(target), config_hash(target), layer_ids, dtype="bfloat16"), backend)
        seconds = time.perf_counter() - started
        outcomes = gate_extracted_shard(
            shard, traces, TargetHead.from_checkpoint(target), backend.reference_argmax, layer_ids, TargetFacts.from_path(target),
            lambda ids: backend.reference_forward(ids)[1], recipe, 1,
        )  # fmt: skip
    finally:
        backend.close()
    failed = [o for o in outcomes if not o.passed]
    logits = next(o for o in outcomes if o.name == "final_state_reproduces_logits")
    what = f"{len(traces)} traces, {report.tokens} tokens, of the built-in Kimi-family target in bf16 (transformers backend)"
    return [
        Figure("gates passed", f"{len(outcomes) - len(failed)} of {len(outcomes)}", "", "measured", run.measured(what) + "".join(f"; {o.name} FAILED: {o.description}" for o in failed),
               "all", not failed),
        Figure("argmax agreement", sig(logits.metadata["argmax_agreement"], 5), "", "measured", run.measured(f"final_state_reproduces_logits over {logits.metadata['positions']} positions")),
        Figure("extraction tokens/s", round(report.tokens / seconds), "tokens/s", "measured", run.measured(what + ", a tiny target: launch-bound, not a rate to plan by")),
    ]  # fmt: skip


# What needs vLLM on CUDA: the figure and the command that measures it on a GPU host with vLLM installed.
VLLM_FIGURES = {
    "P5c on the Kimi family": "make peer-env; bench/peer_acceptance.py --demo-target kimi --variants ours peer-defaults peer-own --seeds 3",
    "sampled acceptance, default against nla and lk_hybrid": (
        "bench/peer_acceptance.py --demo-target kimi --variants ours ours-nla ours-lkh --ours-variant ours-nla:loss=nla "
        "--ours-variant ours-lkh:loss=lk_hybrid --seeds 3 --temperature 1 --draft-sample-method probabilistic"
    ),
    "EAGLE 3.1 against plain, sampled": (
        "bench/peer_acceptance.py --demo-target kimi --variants ours-eagle31 ours-plain "
        "--ours-variant ours-eagle31:fc_norm=true,norm_output=true,norm_before_fc=false,norm_before_residual=false "
        "--ours-variant ours-plain:fc_norm=false,norm_output=false,norm_before_fc=false,norm_before_residual=false "
        "--seeds 3 --temperature 1 --draft-sample-method probabilistic"
    ),
    "extraction and serving through vLLM": "make gpu-check (its extraction (vllm) and loads_in_vllm rows, on the tiny target)",
}


def vllm_reason() -> str | None:
    """Why the vLLM figures cannot be measured here (None: they can)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return (
            f"vLLM is not installed here (torch {torch.__version__}). A lent device cannot be given it: vLLM 0.32 pins torch "
            "2.13.0 and its own CUDA build, far more than the 64 MiB a call carries, and the device reaches no registry"
        )
    if not torch.cuda.is_available():
        return "no CUDA device: these are CUDA figures (this CPU's own are in docs/performance.md)"
    return None


def vllm_figures(run: Run) -> list[Figure]:
    """Not measured within the budget: each trains drafts before it serves them. The reason, and the command."""
    reason = vllm_reason()
    why = f"{reason}. Measure it on a GPU host with vLLM" if reason else "vLLM and CUDA are here, but each trains drafts first, past this command's budget. Measure it here"
    return [Figure(name, None, "", "not measured", f"{why}: {command}") for name, command in VLLM_FIGURES.items()]


SECTIONS = [
    ("kimi_width_step", kimi_width_step),
    ("kimi_family_extraction", kimi_family_extraction),
    ("packed_vs_padded", packed_vs_padded),
    ("needs_vllm_on_cuda", vllm_figures),
]


def measure(run: Run) -> list[Section]:
    sections = []
    for name, body in SECTIONS:
        section = Section(name)
        if name != "needs_vllm_on_cuda" and run.left_s() <= 0:
            section.detail = f"the {run.args.budget_s:.0f} s budget was spent before it"
        else:
            started = time.monotonic()
            try:
                section.figures = body(run)
                section.status = "skipped" if name == "needs_vllm_on_cuda" else "passed"
            except Exception as exc:  # noqa: BLE001 - a failed section is a row of the table, the rest still run
                section.status, section.detail = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
                (run.work / f"{name}.traceback.txt").write_text(traceback.format_exc())
            section.seconds = round(time.monotonic() - started, 1)
        print(f"gpu-truth: {name}: {section.status} in {section.seconds:.0f} s {section.detail}", flush=True)
        sections.append(section)
    return sections


def render(sections: list[Section]) -> str:
    lines = [("section", "figure", "value", "how", "goal", "source")]
    for s in sections:
        if not s.figures:
            lines.append((s.name, f"({s.status})", "-", "-", "-", s.detail))
        for f in s.figures:
            value = "-" if f.value is None else f"{f.value} {f.unit}".strip()
            goal = f"{f.goal} {'met' if f.met else 'MISSED'}" if f.goal and f.met is not None else f.goal or "-"
            lines.append((s.name, f.name, value, f.how, goal, f.source))
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(line, widths)) + " | " + line[-1] for line in lines)


# -- carrying to a lent device -----------------------------------------------------------------------------------


def prepare(into: Path, python_version: str) -> None:
    """Write what a lent device needs beside the working tree: the wheels it lacks, at this environment's versions, for
    its Python (3.12), and the built Kimi-family target (built here first if it is not)."""
    from importlib.metadata import version

    from eagle3_assets.demo.stack import kimi_target_dir

    wheels = into / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    names = [name.replace("_", "-") for name in CARRIED_PACKAGES]
    pins = [f"{name}=={version(name)}" for name in names]
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
         "--implementation", "cp", *platforms, "-d", str(wheels), *pins], check=True,
    )  # fmt: skip
    (into / "python-version").write_text(python_version + "\n")
    target = into / "kimi_target"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(kimi_target_dir(), target)
    size = sum(p.stat().st_size for p in into.rglob("*") if p.is_file())
    print(f"gpu-truth: {into}: {', '.join(pins)} and the Kimi-family target, {size / 2**20:.1f} MiB (a call carries 64 MiB with the tree)")


def install_carried(carried: Path, argv: list[str] | None) -> float | None:
    """Install the carried wheels into ``carried/site`` and run this command again with them on the path (once); the
    seconds the install took, read back by the second run (None: nothing carried)."""
    if os.environ.get(INSTALLED):
        return float(os.environ[INSTALLED])
    wheels = sorted((carried / "wheels").glob("*.whl"))
    if not wheels:
        return None
    site, started = carried / "site", time.monotonic()
    shutil.rmtree(site, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--target", str(site)]
    done = subprocess.run([*pip, *map(str, wheels)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(
            f"gpu-truth: the wheels in {carried / 'wheels'} do not install on this Python {platform.python_version()} (--prepare "
            f"fetched them for Python {(carried / 'python-version').read_text().strip() if (carried / 'python-version').is_file() else '?'}): "
            f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
        )
    seconds = round(time.monotonic() - started, 1)
    print(f"gpu-truth: {len(wheels)} carried wheels installed into {site} in {seconds} s", flush=True)
    path = os.pathsep.join(filter(None, [str(site.resolve()), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, INSTALLED: str(seconds)}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)], env)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_truth.json", help="the JSON file written")
    p.add_argument("--work", default=None, help="the sections' files (default: a folder beside --out)")
    p.add_argument("--carried", default=str(CARRIED), help="what --prepare wrote: its wheels are installed into DIR/site first")
    p.add_argument("--kimi-target", help="the built Kimi-family target (default: the carried one)")
    p.add_argument("--lengths", default=str(LENGTHS), help="the sample lengths of packed_vs_padded (JSON)")
    p.add_argument("--traces", type=int, default=24, help="traces of the Kimi-family extraction")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="no section starts after this many seconds")
    p.add_argument("--allow-cpu", action="store_true", help="run the sections on the CPU, at a small width, when there is no CUDA device")
    p.add_argument("--prepare", metavar="DIR", help="write DIR for a lent device (wheels, the Kimi-family target) and stop")
    p.add_argument("--python-version", default="3.12", help="with --prepare: the device's Python, whose wheels are fetched")
    args = p.parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare), args.python_version)
        return 0
    install_s = install_carried(Path(args.carried), argv)
    args.kimi_target = args.kimi_target or str(Path(args.carried) / "kimi_target")
    import torch

    device = "cuda" if torch.cuda.is_available() else ("cpu" if args.allow_cpu else None)
    if device is None:
        sys.exit("gpu-truth: no CUDA device here; --allow-cpu checks the command on the CPU (its figures are then this CPU's)")
    name = torch.cuda.get_device_name(0) if device == "cuda" else f"this CPU ({platform.processor() or platform.machine()}, --allow-cpu)"
    out = Path(args.out)
    args.work = args.work or str(out.with_suffix("")) + "-work"
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if device == "cpu":
        from eagle3_assets.core.settings.environment import ALLOW_CPU

        os.environ[ALLOW_CPU.name] = "1"  # the backends refuse a CPU unless told
    run = Run(args, device, name)
    print(f"gpu-truth: torch {torch.__version__} on {name}; budget {args.budget_s:.0f} s; files in {args.work}", flush=True)
    sections = measure(run)
    print(render(sections))
    report = {
        "device": name, "gpu_checked": device == "cuda", "torch": torch.__version__, "python": platform.python_version(),
        "seconds": round(time.monotonic() - run.started, 1), "budget_s": args.budget_s, "install_s": install_s,
        "sections": [asdict(s) for s in sections],
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    missed = [f.name for s in sections for f in s.figures if f.met is False]
    failed = [s.name for s in sections if s.status == "failed"]
    print(f"gpu-truth: {report['seconds']:.0f} s; failed: {failed or 'none'}; goals missed: {missed or 'none'}; {out}")
    if device == "cpu":
        print("gpu-truth: these figures are this CPU's (--allow-cpu): a check of the command, nothing about a GPU")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
