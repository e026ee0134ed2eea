"""Benchmark of draft training: tokens/s and peak memory of one optimizer step, per unrolled depth.

Each configuration runs in a child process (so that its peak memory is its
own) the training step of eagle3_assets.core.training on synthetic batches of
the preset's shape (the tiny one is the demo's): the target's head (full-vocabulary top-1 and the
draft-vocabulary distribution), the training-time-test unroll, backward,
gradient clipping, AdamW. Data loading is left out: it is a slice of a
memory-mapped file per sample.

Prints tokens/s and peak memory for each ``--ttt`` depth and their ratios to
depth 1 (the cost of training-time test). On CPU the peak is the child's
maximum RSS (torch itself included; the growth during the steps is printed
beside it); on CUDA, ``torch.cuda.max_memory_allocated``.

    .venv/bin/python bench/training.py                                  # the demo's tiny draft on CPU
    python bench/training.py --device cuda --preset llama3-8b           # a GPU host: an 8B-class draft
    python bench/training.py --device cuda --preset kimi-k2 --ttt 1 3 7
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Draft shapes: one decoder layer as wide as the target, over a draft vocabulary.
PRESETS = {
    "tiny": dict(hidden=64, heads=1, kv_heads=1, head_dim=64, intermediate=192, vocab=640, draft_vocab=256, seq_len=80, batch_tokens=2048),
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, draft_vocab=32000, seq_len=2048, batch_tokens=16384),
    "kimi-k2": dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, vocab=163840, draft_vocab=32000, seq_len=2048, batch_tokens=8192),
}


def child(spec: dict) -> dict:
    import torch

    from eagle3_assets.core.draft_model import DraftConfig, Eagle3Draft
    from eagle3_assets.core.target_head import TargetHead
    from eagle3_assets.core.training.loss import TrainingTimeTest
    from eagle3_assets.core.vocab import build_vocab_mapping

    device = torch.device(spec["device"])
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    p = spec["shape"]
    mapping = build_vocab_mapping(torch.randint(0, 1000, (p["vocab"],)), p["draft_vocab"])
    config = DraftConfig(
        hidden_size=p["hidden"], intermediate_size=p["intermediate"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], vocab_size=p["vocab"],
        draft_vocab_size=p["draft_vocab"], target_hidden_size=p["hidden"], aux_layer_ids=(2, 3, 4),
    )  # fmt: skip
    draft = Eagle3Draft(config)
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    draft.embed_tokens.weight.requires_grad_(False)
    draft.to(device)
    target = {
        "embed": draft.embed_tokens.weight.detach().cpu(),
        "norm": torch.ones(p["hidden"]),
        "lm_head": torch.randn(p["vocab"], p["hidden"]) * 0.02,
        "rms_norm_eps": 1e-5,
    }
    target_head, draft_to_target = TargetHead.from_weights(target).to(device), mapping.draft_to_target.to(device)
    ttt = TrainingTimeTest(draft, spec["ttt"], 0.8).to(device)
    trainable = [q for q in draft.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    batch, length = max(1, p["batch_tokens"] // p["seq_len"]), p["seq_len"]
    aux = torch.randn(batch, length, 3 * p["hidden"], device=device)
    final = torch.randn(batch, length, p["hidden"], device=device)
    ids = torch.randint(0, p["vocab"], (batch, length), device=device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step() -> None:
        logits, top = target_head.draft_logits(final, "post_norm", draft_to_target)
        with autocast:
            loss, _ = ttt(aux, ids, mask, logits, top)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch, model, batch: not the step's
    for _ in range(spec["warmup"]):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    sync()
    elapsed = time.perf_counter() - started
    if device.type == "cuda":
        peak, step_bytes = torch.cuda.max_memory_allocated(), None
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        step_bytes = peak - before
    return {"tokens_per_s": batch * length * spec["steps"] / elapsed, "peak_bytes": peak, "step_bytes": step_bytes, "batch": batch, "seq_len": length}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--ttt", type=int, nargs="+", default=[1, 3, 7], help="unrolled depths to compare")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (training uses 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    shape = PRESETS[args.preset]
    print(f"bench/training: preset {args.preset} {shape} on {args.device}, {args.steps} steps per configuration")
    results = {}
    for depth in args.ttt:
        spec = {"shape": shape, "device": args.device, "ttt": depth, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"ttt={depth} failed:\n{done.stderr[-3000:]}")
        results[depth] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[depth]
        step = f" (of which the training step {r['step_bytes'] / 2**20:.0f} MiB)" if r["step_bytes"] is not None else ""
        print(f"  ttt_steps={depth}: {r['tokens_per_s']:10.0f} tokens/s, peak memory {r['peak_bytes'] / 2**20:6.0f} MiB{step} (batch {r['batch']} x {r['seq_len']})")
    base = results[args.ttt[0]]
    for depth in args.ttt[1:]:
        r = results[depth]
        print(
            f"  ratio ttt_steps={depth} / {args.ttt[0]}: tokens/s {r['tokens_per_s'] / base['tokens_per_s']:.2f}, "
            f"peak memory {r['peak_bytes'] / base['peak_bytes']:.2f}"
        )


if __name__ == "__main__":
    main()
