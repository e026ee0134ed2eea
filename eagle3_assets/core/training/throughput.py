"""Draft training's throughput: tokens/s, achieved TFLOP/s against the device's matrix-product rate, and peak memory, per depth.

``bench/training.py`` runs it; ``eagle3-gpu-check`` runs it at the configured
target's width with the planned micro-batch. In the package so that a GPU host
with the package installed (and no repository) has it.

Each configuration runs in a child process (so that its peak memory is its
own) the training step of eagle3_assets.core.training on synthetic batches of
the preset's shape (the tiny one is the built-in tiny target's): the target's head (full-vocabulary top-1 and the
draft-vocabulary logits), the training-time-test unroll with the memory
settings of a training run (``--no-memory-settings``: all off), backward,
gradient clipping, AdamW. Data loading is left out: it is a slice of a
memory-mapped file per sample.

The FLOP count of one token's step (:func:`step_flops`, model FLOPs: what the
step must compute, not what recomputation adds): the target head's forward
(2·H·V), ``fc`` forward and weight gradient (2 x 2·3H·H), and per unrolled
step the draft layer (q/k/v over 2·H inputs, o, the MLP, causal attention over
the sequence) and its ``lm_head``, forward and backward (3 x forward).
Achieved TFLOP/s = FLOPs per token x tokens/s. Its share is against one
matrix product timed in the same run on the same device (bf16 on CUDA,
float32 on CPU, where training runs in float32).

``--norms``: the draft's norm flags (``plain`` EAGLE-3, ``eagle3.1`` =
``fc_norm`` + ``norm_output``, each flag alone, ``speculators``' defaults),
each variant's time per step printed against the first variant's at the same
depth in the same run. The norms' own FLOPs (elementwise) are not counted.
``--losses``: the training loss (``kl``, ``ce``, or the LK losses ``nla`` and
``lk_hybrid``), compared the same way (every norm variant with every loss).

``--lengths``: one epoch of samples of those lengths instead of fixed-shape
steps, planned as training plans it (``--packing``: packed and padded
micro-batches of ``batch_tokens``), every step timed; tokens/s counts the
samples' tokens, never the padding, and each plan's time per token is
printed against the first's.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` against the card's
memory; on CPU the child's maximum RSS (torch itself included); beside it the
planner's estimate (eagle3_assets.core.training.memory).

    .venv/bin/python bench/training.py                                  # the tiny draft on CPU
    python bench/training.py --device cuda --preset llama3-8b           # a GPU host: an 8B-class draft
    python bench/training.py --device cuda --preset kimi-k2 --ttt 1 3 7
    python bench/training.py --device cuda --target /models/Kimi-K2 --plan   # the target's width, the planned micro-batch
    python bench/training.py --device cuda --preset kimi-k2 --ttt 7 --lengths bench/long_trace_lengths.json   # packed vs padded
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from eagle3_assets.core.training.losses import LOSSES

# Draft shapes: one decoder layer as wide as the target, over a draft vocabulary.
PRESETS = {
    "tiny": dict(hidden=64, heads=1, kv_heads=1, head_dim=64, intermediate=192, vocab=640, draft_vocab=256, seq_len=80, batch_tokens=2048),
    "small": dict(hidden=512, heads=8, kv_heads=8, head_dim=64, intermediate=1536, vocab=16000, draft_vocab=4000, seq_len=256, batch_tokens=1024),
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, draft_vocab=32000, seq_len=2048, batch_tokens=16384),
    "kimi-k2": dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432, vocab=163840, draft_vocab=32000, seq_len=2048, batch_tokens=8192),
}


def shape_of_target(path: str, draft_vocab: int = 32000, seq_len: int = 2048, batch_tokens: int = 8192) -> dict:
    """A preset at a target's width: the draft layer shaped like one of its layers (as training makes it)."""
    from eagle3_assets.core.draft.model import DraftConfig

    config = json.loads((Path(path) / "config.json").read_text())
    draft = DraftConfig.for_target(config, min(draft_vocab, int(config.get("vocab_size", draft_vocab))), [1, 2, 3])
    return dict(
        hidden=draft.hidden_size, heads=draft.num_attention_heads, kv_heads=draft.num_key_value_heads, head_dim=draft.head_dim,
        intermediate=draft.intermediate_size, vocab=draft.vocab_size, draft_vocab=draft.draft_vocab_size,
        seq_len=min(seq_len, draft.max_position_embeddings), batch_tokens=batch_tokens,
    )  # fmt: skip


def step_flops(p: dict, ttt: int, window: int | None = None) -> float:
    """Model FLOPs of one token's optimizer step (see the module's docstring); ``window``: the draft's sliding window."""
    h, q, kv, inter = p["hidden"], p["heads"] * p["head_dim"], p["kv_heads"] * p["head_dim"], p["intermediate"]
    layer = 2 * (2 * h) * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * inter  # q/k/v over [embedding ; state], o, MLP
    # Scores and weighted values over the keys a query sees: the causal half on average, or at most the window.
    attention = 2 * 2 * q * min(p["seq_len"] / 2, window or p["seq_len"])
    per_step = 3 * (layer + attention + 2 * h * p["draft_vocab"])  # forward and backward, lm_head included
    return 2 * h * p["vocab"] + 2 * (2 * 3 * h * h) + ttt * per_step


# The draft's norm flags (core/draft/model.py) each variant sets: plain EAGLE-3, EAGLE 3.1, each flag alone,
# and speculators' training defaults. Every variant names all four flags: DraftConfig defaults them off but
# TrainConfig has norm_before_residual on, so a variant that left a flag out would differ between the two.
_NORM_FLAGS_OFF = {"fc_norm": False, "norm_output": False, "norm_before_fc": False, "norm_before_residual": False}
NORM_VARIANTS = {
    name: {**_NORM_FLAGS_OFF, **on}
    for name, on in {
        "plain": {},
        "eagle3.1": {"fc_norm": True, "norm_output": True},
        "fc_norm": {"fc_norm": True},
        "norm_output": {"norm_output": True},
        "norm_before_fc": {"norm_before_fc": True},
        "norm_before_residual": {"norm_before_residual": True},
        "speculators": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
    }.items()
}


def draft_config_of(p: dict, sliding_window: int | None = None, **norm_flags: bool):
    from eagle3_assets.core.draft.model import DraftConfig

    return DraftConfig(
        hidden_size=p["hidden"], intermediate_size=p["intermediate"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], vocab_size=p["vocab"],
        draft_vocab_size=p["draft_vocab"], target_hidden_size=p["hidden"], aux_layer_ids=(2, 3, 4),
        sliding_window=sliding_window, **norm_flags,
    )  # fmt: skip


def matmul_rate(device: str, size: int, repeats: int) -> float:
    """FLOP/s of one square matrix product on ``device`` (bf16 on CUDA, float32 on CPU)."""
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def child(spec: dict) -> dict:
    import torch

    from eagle3_assets.core.draft.model import Eagle3Draft
    from eagle3_assets.core.target.head import TargetHead
    from eagle3_assets.core.training.loss import TrainingTimeTest
    from eagle3_assets.core.draft.vocab import build_vocab_mapping

    device = torch.device(spec["device"])
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    p, memory = spec["shape"], spec["memory"]
    mapping = build_vocab_mapping(torch.randint(0, 1000, (p["vocab"],)), p["draft_vocab"])
    draft = Eagle3Draft(draft_config_of(p, spec.get("window") or None, **NORM_VARIANTS[spec["norms"]]))
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
    ttt = TrainingTimeTest(
        draft, spec["ttt"], 0.8, checkpoint_steps=memory["activation_checkpointing"], loss_chunk_tokens=memory["loss_chunk_tokens"],
        loss=spec.get("loss", "kl"),
    ).to(device)
    trainable = [q for q in draft.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step(aux, final, ids, mask, documents=None) -> None:
        logits, top = target_head.draft_logits(final, "post_norm", draft_to_target, chunk=memory["target_head_chunk_tokens"] or ids.numel())
        with autocast:
            loss, _ = ttt(aux, ids, mask, logits, top, documents)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def batch_of(lengths: list[int], packed: bool) -> tuple:
        """Random states for samples of ``lengths``: one packed row (``documents``), or a row each padded to the longest."""
        rows, width = (1, sum(lengths)) if packed else (len(lengths), max(lengths))
        aux = torch.randn(rows, width, 3 * p["hidden"], device=device)
        final = torch.randn(rows, width, p["hidden"], device=device)
        ids = torch.randint(0, p["vocab"], (rows, width), device=device)
        if packed:
            documents = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])[None].to(device)
            return aux, final, ids, torch.ones(rows, width, dtype=torch.bool, device=device), documents
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        return aux, final, ids, mask.to(device), None

    if "lengths" in spec:
        return epoch_of_lengths(spec, step, batch_of, sync, device)
    batch, length = max(1, p["batch_tokens"] // p["seq_len"]), p["seq_len"]
    tensors = batch_of([length] * batch, packed=False)
    for _ in range(spec["warmup"]):
        step(*tensors)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        step(*tensors)
    sync()
    elapsed = time.perf_counter() - started
    peak, capacity = peak_memory(device)
    return {"tokens_per_s": batch * length * spec["steps"] / elapsed, "step_s": elapsed / spec["steps"], "peak_bytes": peak, "capacity_bytes": capacity, "batch": batch, "seq_len": length}


def peak_memory(device) -> tuple[int, int | None]:
    """The peak since the last reset and the card's memory on CUDA; the process's maximum RSS on a CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(), torch.cuda.get_device_properties(device).total_memory
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None


def epoch_of_lengths(spec: dict, step, batch_of, sync, device) -> dict:
    """One epoch of samples of ``spec["lengths"]``, planned as training plans it (packed or padded micro-batches of
    ``batch_tokens``): every micro-batch's optimizer step timed on its own (the random states are made between the
    timings), after ``warmup`` steps of the largest one. tokens/s counts the samples' tokens, never the padding."""
    import torch

    from eagle3_assets.core.training.data import epoch_micro_batches

    lengths, packed = spec["lengths"], spec["packed"]
    plan = epoch_micro_batches(lengths, spec["shape"]["batch_tokens"], seed=0, epoch=0, packed=packed)
    cost = (lambda b: sum(lengths[i] for i in b)) if packed else (lambda b: max(lengths[i] for i in b) * len(b))
    largest = max(plan, key=cost)
    for _ in range(spec["warmup"]):
        step(*batch_of([lengths[i] for i in largest], packed))
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elapsed = 0.0
    for micro_batch in plan:
        tensors = batch_of([lengths[i] for i in micro_batch], packed)
        sync()
        started = time.perf_counter()
        step(*tensors)
        sync()
        elapsed += time.perf_counter() - started
    peak, capacity = peak_memory(device)
    return {
        "tokens_per_s": sum(lengths) / elapsed, "step_s": elapsed / len(plan), "epoch_s": elapsed, "micro_batches": len(plan),
        "computed_tokens": sum(cost(b) for b in plan), "peak_bytes": peak, "capacity_bytes": capacity,
        "batch": len(largest), "seq_len": max(lengths[i] for i in largest),
    }  # fmt: skip


def run_depth(shape: dict, args, depth: int, memory: dict, norms: str = "plain", loss: str = "kl", window: int = 0, **epoch) -> dict:
    """One configuration in a child process; ``epoch`` (``lengths``, ``packed``): an epoch of those samples instead."""
    spec = {
        "shape": shape, "device": args.device, "ttt": depth, "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        "memory": memory, "norms": norms, "loss": loss, "window": window, **epoch,
    }  # fmt: skip
    # The child imports this package from where the parent did (a checkout run by bench/training.py, or an install).
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", __name__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"ttt={depth} norms={norms} loss={loss} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> list[dict]:
    """Every depth's figures (also what ``eagle3-gpu-check`` reads)."""
    import torch

    from eagle3_assets.core.training.config import TrainConfig
    from eagle3_assets.core.training.memory import StepShape, estimate_step_bytes, plan_micro_batch

    shape = dict(shape_of_target(args.target) if args.target else PRESETS[args.preset])
    lengths = read_lengths(args.lengths) if args.lengths else None
    if lengths:  # the plan (and the draft's positions) must hold the longest sample
        shape["seq_len"] = max(lengths)
    elif args.seq_len:
        shape["seq_len"] = args.seq_len
        shape["batch_tokens"] = max(shape["batch_tokens"], args.seq_len)
    if args.batch_tokens:
        shape["batch_tokens"] = args.batch_tokens
    defaults = TrainConfig(hidden_state_dirs=["-"], vocab_mapping="-", target_path="-", training_dir="-")
    memory = {
        "activation_checkpointing": defaults.activation_checkpointing and not args.no_memory_settings,
        "loss_chunk_tokens": 0 if args.no_memory_settings else defaults.loss_chunk_tokens,
        "target_head_chunk_tokens": 0 if args.no_memory_settings else defaults.target_head_chunk_tokens,
    }
    bf16 = args.device.startswith("cuda")
    if args.plan:  # the micro-batch a training run would plan on this device, at the deepest depth asked for
        config = TrainConfig(hidden_state_dirs=["-"], vocab_mapping="-", target_path="-", training_dir="-", batch_tokens=shape["batch_tokens"], max_seq_len=shape["seq_len"], ttt_steps=max(args.ttt), **memory)
        planned = plan_micro_batch(draft_config_of(shape), config, longest=shape["seq_len"], device=torch.device(args.device), bf16=bf16)
        shape["batch_tokens"] = planned.batch_tokens
        print(f"  planned micro-batch: {planned.describe()}")
    rate = matmul_rate(args.device, args.matmul_size, args.matmul_repeats)
    print(
        f"bench/training: {'target ' + args.target if args.target else 'preset ' + args.preset} {shape} on {args.device}, "
        f"memory settings {memory}, {args.steps} steps per configuration, median of {args.rounds} round(s)"
    )
    print(f"  reference: one {'bf16' if bf16 else 'float32'} {args.matmul_size}x{args.matmul_size} matrix product: {rate / 1e12:.3f} TFLOP/s")
    if lengths:
        return run_epochs(shape, args, memory, lengths, rate)
    grid = [(n, loss, d, w) for w in args.windows for n in args.norms for loss in args.losses for d in args.ttt]
    # Rounds, each in the other order (drift of a shared machine's load cancels); each configuration's median round.
    runs: dict[tuple[str, str, int, int], list[dict]] = {key: [] for key in grid}
    for round_index in range(args.rounds):
        for key in grid if round_index % 2 == 0 else grid[::-1]:
            runs[key].append(run_depth(shape, args, key[2], memory, key[0], key[1], key[3]))
    rows = []
    for norms, loss, depth, window in grid:
        r = sorted(runs[(norms, loss, depth, window)], key=lambda each: each["step_s"])[len(runs[(norms, loss, depth, window)]) // 2]
        flops = step_flops(shape, depth, window)
        estimate = estimate_step_bytes(
            StepShape.of(draft_config_of(shape, window or None), r["batch"] * r["seq_len"], r["seq_len"], depth, bf16=bf16,
                         activation_checkpointing=memory["activation_checkpointing"], loss_chunk_tokens=memory["loss_chunk_tokens"],
                         target_head_chunk_tokens=memory["target_head_chunk_tokens"], loss=loss)
        )["total"]  # fmt: skip
        achieved = flops * r["tokens_per_s"]
        row = {**r, "ttt": depth, "norms": norms, "loss": loss, "window": window, "gflop_per_token": flops / 1e9, "tflops": achieved / 1e12, "share": achieved / rate, "estimate_bytes": estimate,
               "reference_tflops": rate / 1e12}  # fmt: skip
        rows.append(row)
        capacity = f" of {r['capacity_bytes'] / 2**30:.0f} GiB" if r["capacity_bytes"] else " (RSS, torch included)"
        print(
            f"  norms {norms:>20}, loss {loss:>9}, window {window or 'none':>4}, ttt_steps={depth}: {r['step_s'] * 1e3:9.1f} ms/step, {r['tokens_per_s']:10.0f} tokens/s, {flops / 1e9:8.3f} GFLOP/token (counted), {achieved / 1e12:8.4f} TFLOP/s (derived: "
            f"counted FLOPs x measured tokens/s), share of the matrix product {achieved / rate:.3f}, peak memory {r['peak_bytes'] / 2**30:.2f} GiB{capacity} "
            f"(the planner's estimate {estimate / 2**30:.2f} GiB; batch {r['batch']} x {r['seq_len']})"
        )
    base = rows[0]
    for row in rows[1 : len(args.ttt)]:
        print(
            f"  ratio ttt_steps={row['ttt']} / {base['ttt']} ({base['norms']}): tokens/s {row['tokens_per_s'] / base['tokens_per_s']:.2f}, "
            f"peak memory {row['peak_bytes'] / base['peak_bytes']:.2f}"
        )
    # What the norms and losses cost: each variant's time per step against the first one's at the same depth, in this run.
    reference = {row["ttt"]: row for row in rows[: len(args.ttt)]}
    for row in rows[len(args.ttt) :]:
        ref = reference[row["ttt"]]
        print(
            f"  ratio norms {row['norms']}, loss {row['loss']}, window {row['window'] or 'none'} / norms {ref['norms']}, loss {ref['loss']}, "
            f"window {ref['window'] or 'none'}, ttt_steps={row['ttt']}: time per step {row['step_s'] / ref['step_s']:.3f}, "
            f"peak memory {row['peak_bytes'] / ref['peak_bytes']:.2f}"
        )
    return rows


def read_lengths(path: str) -> list[int]:
    """Sample lengths from a JSON file: a list of token counts, or an object whose ``lengths`` is one."""
    data = json.loads(Path(path).read_text())
    lengths = data["lengths"] if isinstance(data, dict) else data
    if not lengths or not all(isinstance(n, int) and n > 0 for n in lengths):
        raise RuntimeError(f"--lengths {path}: expected a non-empty list of positive token counts")
    return lengths


def run_epochs(shape: dict, args, memory: dict, lengths: list[int], rate: float) -> list[dict]:
    """An epoch of samples of ``lengths`` under each ``--packing``, at each depth: tokens/s of the samples' tokens, and
    the time per token of each packing over the first's, in this run."""
    print(f"  an epoch of {len(lengths)} samples, {sum(lengths)} tokens (longest {max(lengths)}), {shape['batch_tokens']} tokens per micro-batch")
    rows = []
    for depth in args.ttt:
        runs = {packing: [] for packing in args.packing}
        for round_index in range(args.rounds):  # alternating order, the median round of each
            for packing in args.packing if round_index % 2 == 0 else args.packing[::-1]:
                runs[packing].append(run_depth(shape, args, depth, memory, window=args.windows[0], lengths=lengths, packed=packing == "packed"))
        first = None
        for packing in args.packing:
            r = sorted(runs[packing], key=lambda each: each["epoch_s"])[len(runs[packing]) // 2]
            row = {**r, "ttt": depth, "packing": packing, "reference_tflops": rate / 1e12}
            rows.append(row)
            first = first or row
            capacity = f" of {r['capacity_bytes'] / 2**30:.0f} GiB" if r["capacity_bytes"] else " (RSS, torch included)"
            print(
                f"  {packing:>6}, ttt_steps={depth}: {r['micro_batches']} micro-batches, {r['computed_tokens']} token slots computed, "
                f"{r['epoch_s']:.2f} s for the epoch (measured), {r['tokens_per_s']:.0f} tokens/s of the samples' tokens, "
                f"peak memory {r['peak_bytes'] / 2**30:.2f} GiB{capacity}"
            )
            if row is not first:
                print(f"  ratio {packing} / {first['packing']}, ttt_steps={depth}: time per token {first['tokens_per_s'] / row['tokens_per_s']:.3f} (measured in this run)")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--target", help="a target's HF directory: the draft at its width (instead of --preset)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--ttt", type=int, nargs="+", default=[1, 3, 7], help="unrolled depths to compare")
    p.add_argument(
        "--norms", nargs="+", choices=list(NORM_VARIANTS), default=["plain", "eagle3.1"],
        help="the draft's norm flags to compare (eagle3.1: fc_norm + norm_output); ratios against the first",
    )  # fmt: skip
    p.add_argument("--losses", nargs="+", choices=list(LOSSES), default=["kl"], help="training losses to compare; ratios against the first")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per configuration")
    p.add_argument("--rounds", type=int, default=1, help="runs of every configuration, alternating the order; the median is printed")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (training uses 1)")
    p.add_argument("--batch-tokens", type=int, help="tokens per micro-batch (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the preset's; the micro-batch holds at least one)")
    p.add_argument(
        "--windows", type=int, nargs="+", default=[0],
        help="the draft's sliding windows to compare (draft_sliding_window; 0: full attention); ratios against the first",
    )  # fmt: skip
    p.add_argument(
        "--lengths", help="a JSON list of sample lengths (or {\"lengths\": [...]}): time one epoch of them, planned as training plans "
        "it, instead of fixed-shape steps",
    )  # fmt: skip
    p.add_argument("--packing", nargs="+", choices=["packed", "padded"], default=["padded", "packed"], help="with --lengths: the plans to compare; ratios against the first")
    p.add_argument("--plan", action="store_true", help="the micro-batch the memory planner chooses on this device")
    p.add_argument("--no-memory-settings", action="store_true", help="activation checkpointing and the chunked heads off")
    p.add_argument("--matmul-size", type=int, default=None, help="the reference matrix product's size (default: 8192 on CUDA, 1024 on CPU)")
    p.add_argument("--matmul-repeats", type=int, default=10)
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.matmul_size is None:
        args.matmul_size = 8192 if args.device.startswith("cuda") else 1024
    import torch

    torch.set_num_threads(args.threads)  # the reference runs with the children's threads
    try:
        run(args)
    except RuntimeError as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
