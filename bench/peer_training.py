"""The platform's training step against speculators' (vLLM's own trainer) at the same shape and tokens: tokens/s and peak memory.

In one run, each configuration in its own process (so that its peak memory is
its own), on synthetic batches of one shape (a preset of ``bench/training.py``,
or a target's width) and the same tokens per step:

- ``ours``: the platform's step (eagle3_assets/core/training/throughput.py, as
  ``bench/training.py`` times it) with the training defaults' memory settings
  (activation checkpointing, chunked heads), and with them off;
- ``peer``: speculators 0.9.0's step (bench/peer/step_speculators.py, in the
  peer environment of ``make peer-env``): one packed micro-batch of documents
  with document ids, at its default draft settings or plain EAGLE-3's
  (``--peer-settings``).

On a CPU both run in float32, the peer with eager attention and its eager
losses. On CUDA (``--device cuda``; GPU-only, not measured on the development
machine) the peer runs as its trainer does there: its compiled forward,
FlexAttention over the packed documents, its fused Triton KL loss, bf16
autocast; ours with bf16 autocast. Peak memory: on CUDA the allocator's peak;
on a CPU the child's maximum RSS, printed beside what building the draft and
the batch alone took (a child that runs no step), since the two trainers
import different libraries.

    make peer-env && .venv/bin/python bench/peer_training.py                  # the demo's tiny draft, depth 3
    .venv/bin/python bench/peer_training.py --preset small --ttt 3 7 --steps 3
    python bench/peer_training.py --device cuda --preset kimi-k2 --ttt 7      # a GPU host with both environments
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEER_STEP = REPO / "bench" / "peer" / "step_speculators.py"


def parser() -> argparse.ArgumentParser:
    from eagle3_assets.core.training.throughput import PRESETS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--target", help="a target's HF directory: the draft at its width (instead of --preset)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (GPU-only: the peer's FlexAttention and fused loss)")
    p.add_argument("--ttt", type=int, nargs="+", default=[3], help="unrolled depths (speculators' default is 3)")
    p.add_argument("--batch-tokens", type=int, help="tokens per step (default: the preset's)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    p.add_argument("--peer-settings", choices=["defaults", "plain"], default="defaults", help="speculators' draft flags")
    p.add_argument("--peer-python", default=str(REPO / ".peer-venv" / "bin" / "python"), help="the peer environment's interpreter")
    return p


def run_peer(python: str, shape: dict, args, depth: int, steps: int, warmup: int) -> dict:
    sys.path.insert(0, str(REPO / "bench" / "peer"))
    from train_speculators import SETTINGS

    spec = {"shape": shape, "ttt": depth, "steps": steps, "warmup": warmup, "device": args.device, "threads": args.threads,
            "settings": SETTINGS[args.peer_settings]}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run([python, str(PEER_STEP), "--spec", json.dumps(spec)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"speculators' step (ttt={depth}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parser().parse_args()
    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.throughput import PRESETS, run_depth, shape_of_target

    if not Path(args.peer_python).is_file():
        sys.exit(f"{args.peer_python}: no peer environment; run `make peer-env` (or pass --peer-python)")
    shape = dict(shape_of_target(args.target) if args.target else PRESETS[args.preset])
    if args.batch_tokens:
        shape["batch_tokens"] = args.batch_tokens
    shape["batch_tokens"] = max(1, shape["batch_tokens"] // shape["seq_len"]) * shape["seq_len"]  # whole sequences: the same tokens on both sides
    defaults = TrainConfig(hidden_state_dirs=["-"], vocab_mapping="-", target_path="-", training_dir="-")
    memory_on = {"activation_checkpointing": defaults.activation_checkpointing, "loss_chunk_tokens": defaults.loss_chunk_tokens,
                 "target_head_chunk_tokens": defaults.target_head_chunk_tokens}  # fmt: skip
    memory_off = {"activation_checkpointing": False, "loss_chunk_tokens": 0, "target_head_chunk_tokens": 0}
    on_cuda = args.device.startswith("cuda")
    print(
        f"bench/peer_training: {'target ' + args.target if args.target else 'preset ' + args.preset} {shape} on {args.device} "
        f"({'bf16 autocast' if on_cuda else 'float32'}), {shape['batch_tokens']} tokens per step "
        f"({shape['batch_tokens'] // shape['seq_len']} x {shape['seq_len']}), {args.steps} timed steps after {args.warmup}; "
        f"peer: speculators 0.9.0, {args.peer_settings} draft settings, "
        f"{'compiled forward, FlexAttention, fused loss' if on_cuda else 'eager attention and losses'}",
        flush=True,
    )

    def timed(kind: str, depth: int, steps: int, warmup: int, memory: dict | None = None) -> dict:
        if kind == "peer":
            return run_peer(args.peer_python, shape, args, depth, steps, warmup)
        child_args = argparse.Namespace(device=args.device, steps=steps, warmup=warmup, threads=args.threads)
        return run_depth(shape, child_args, depth, memory)

    rows = []
    for depth in args.ttt:
        configurations = [("ours", "ours (memory settings on: the defaults)", memory_on), ("ours", "ours (memory settings off)", memory_off),
                          ("peer", f"speculators ({args.peer_settings})", None)]  # fmt: skip
        for kind, label, memory in configurations:
            started = time.monotonic()
            r = timed(kind, depth, args.steps, args.warmup, memory)
            base = None if on_cuda else timed(kind, depth, 0, 0, memory)["peak_bytes"]  # building alone, no step
            row = {"ttt": depth, "label": label, "kind": kind, "tokens_per_s": r["tokens_per_s"], "peak_bytes": r["peak_bytes"], "built_bytes": base,
                   "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
            rows.append(row)
            built = f", {base / 2**30:.2f} GiB built before any step, step's own {(r['peak_bytes'] - base) / 2**30:.2f} GiB" if base else ""
            print(f"  ttt_steps={depth} {label:42s} {r['tokens_per_s']:9.0f} tokens/s, peak memory {r['peak_bytes'] / 2**30:.2f} GiB{built}", flush=True)
        peer = rows[-1]
        for ours in rows[-3:-1]:
            own = ""
            if peer["built_bytes"]:
                own = f", step's own memory {(ours['peak_bytes'] - ours['built_bytes']) / max(1, peer['peak_bytes'] - peer['built_bytes']):.2f}"
            print(
                f"  ratio {ours['label']} / speculators: tokens/s {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}, "
                f"peak memory {ours['peak_bytes'] / peer['peak_bytes']:.2f}{own}"
            )
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_training.json").write_text(json.dumps({"shape": shape, "device": args.device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
