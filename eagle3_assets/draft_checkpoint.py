"""``draft_checkpoint``: train the EAGLE-3 draft on every shard's hidden states, export it for vLLM, prove vLLM loads it.

The training runs on the GPU host (stage ``train_draft``, Dagster Pipes; DDP
under ``torchrun`` with ``nproc_per_node`` > 1). The result is
``<data>/draft_checkpoint/model/`` in vLLM's native EAGLE-3 form; the training
state (epoch checkpoints, ``history.json``) is under
``<data>/draft_checkpoint/training/``. Gates:

- ``config_complete`` (blocking): every field vLLM reads is in ``config.json``,
  every weight is there with its shape, and the layer ids are the ones the
  hidden states were extracted at (vLLM silently uses its defaults otherwise);
- ``loads_in_vllm`` (blocking): vLLM serves the target with this draft as its
  speculative model and answers a chat completion, running the draft;
- ``loss_decreased`` (WARN): the last epoch's mean loss is below the first's.
"""

import json
from pathlib import Path
from typing import Optional

from dagster import (
    AllPartitionMapping,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    Config,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from eagle3_assets.core.preflight import StageRequirements
from eagle3_assets.core.storage import asset_dir, stable_hash
from eagle3_assets.draft_checkpoint_bounded import check_mode, run_bounded_stage
from eagle3_assets.hidden_states import HiddenStatesConfig
from eagle3_assets.partitions import SAMPLE_SHARDS
from eagle3_assets.vocab_mapping import vocab_mapping
from resources.gpu_host import GPU_POOL, GPUHost, register_stage
from resources.target_model import TargetModel

STAGE = "train_draft"
TRAIN_DRAFT_REQUIREMENTS = register_stage(
    STAGE,
    StageRequirements(modules=["torch", "safetensors", "dagster_pipes"], output_dirs=["draft_checkpoint"]),
)


class DraftTrainingConfig(Config):
    """Training knobs: published EAGLE-3 recipes, with the schedule fitted to the data where it is left unset."""

    epochs: Optional[int] = Field(default=None, description="passes over all samples; default: 10, more when that is under 400 optimizer steps")
    learning_rate: Optional[float] = Field(
        default=None, description="peak AdamW learning rate; default: 1e-4 for a published-size draft, scaled to the draft's width and batch"
    )
    warmup_ratio: float = Field(default=0.02, description="share of steps with linear warm-up")
    min_lr_ratio: float = Field(default=0.0, description="cosine decay ends at learning_rate * min_lr_ratio")
    weight_decay: float = 0.0
    grad_clip: float = Field(default=0.5, description="gradient norm clip")
    ttt_steps: int = Field(default=7, description="training-time test: draft steps unrolled on the draft's own states")
    step_weight: float = Field(default=0.8, description="loss weight of unrolled step i is step_weight**i")
    batch_tokens: Optional[int] = Field(
        default=None, description="padded tokens per micro-batch per process; default: up to 16,384, at least 64 micro-batches an epoch"
    )
    grad_accumulation: int = Field(default=1, description="micro-batches per process per optimizer step")
    max_seq_len: int = Field(default=4096, description="longer samples are truncated")
    seed: int = 0
    init_from: Optional[str] = Field(default=None, description="an existing EAGLE-3 directory (on the GPU host) to fine-tune")
    nproc_per_node: int = Field(default=1, description="training processes (GPUs); above 1 runs under torchrun with DDP")
    export_dtype: Optional[str] = Field(default=None, description="float32, bfloat16 or float16; default: the target's dtype")
    draft_intermediate_size: Optional[int] = Field(default=None, description="MLP width of the draft layer (default: the target's)")
    vllm_check_num_speculative_tokens: int = Field(default=3, description="num_speculative_tokens of the loads_in_vllm check")
    # Bounded-disk mode (draft_checkpoint_bounded.py): the states are extracted again each epoch, a window at a time.
    hidden_states_mode: str = Field(
        default="offline",
        description="'offline': train on the materialised hidden_states shards; 'bounded': extract each shard's states as "
        "training consumes them, every epoch, keeping at most window_shards shards on disk (never materialised as hidden_states)",
    )
    window_shards: int = Field(default=2, description="bounded mode: shards of hidden states on disk at most (2: the next is extracted while one is trained on)")
    bounded_checkpoint_every_steps: int = Field(default=50, description="bounded mode: optimizer steps between checkpoints (and at each shard's end)")
    streamed_extraction: HiddenStatesConfig = Field(
        default=HiddenStatesConfig(), description="bounded mode: how each streamed shard is extracted and gated (hidden_states' settings)"
    )


# The demo's tiny draft, over the demo's ~300 traces (~17k tokens). Seen here on 2 cores: 49 s of training
# (~7,500 tokens/s), then acceptance length 3.12 at 3 speculative tokens on 16 held-out prompts through
# vLLM (12 epochs: 26 s, 2.75).
DEMO_TRAINING_CONFIG = DraftTrainingConfig(
    epochs=20, learning_rate=3e-3, warmup_ratio=0.05, ttt_steps=3, batch_tokens=1024, max_seq_len=512
)


def hidden_state_shards(keys: list[str]) -> tuple[list[Path], list[dict]]:
    """Every registered shard's hidden-state directory and sidecar; an error names incomplete shards."""
    if not keys:
        raise ValueError(f"no sample shards are registered ({SAMPLE_SHARDS}): materialise the per-shard assets first")
    root = asset_dir("hidden_states")
    dirs = [root / key for key in keys]
    incomplete = [key for key, d in zip(keys, dirs) if not (d / "metadata.json").is_file()]
    if incomplete:
        raise FileNotFoundError(f"hidden_states of shards {incomplete} are missing or incomplete (no metadata.json under {root})")
    return dirs, [json.loads((d / "metadata.json").read_text()) for d in dirs]


def render_curve(values: list[float], width: int = 60, height: int = 12) -> str:
    """A text plot of ``values`` (markdown code block): the UI shows it as is, no image needed."""
    if not values:
        return "(no steps)"
    if len(values) > width:  # mean of equal slices
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:]) if b > a]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    rows = [[" "] * len(values) for _ in range(height)]
    for x, v in enumerate(values):
        rows[height - 1 - round((v - low) / span * (height - 1))][x] = "*"
    lines = [f"{high:8.3f} |" + "".join(rows[0])]
    lines += ["         |" + "".join(r) for r in rows[1:-1]]
    lines += [f"{low:8.3f} |" + "".join(rows[-1]), "         +" + "-" * len(values) + " steps"]
    return "```\n" + "\n".join(lines) + "\n```"


def render_accuracy(accuracy: list[float]) -> str:
    rows = ["| draft position | top-1 accuracy | |", "| --- | --- | --- |"]
    rows += [f"| {i + 1} | {a:.3f} | {'#' * round(a * 30)} |" for i, a in enumerate(accuracy)]
    return "\n".join(rows)


def epoch_means(history: list[dict], key: str) -> list:
    by_epoch: dict[int, list] = {}
    for record in history:
        by_epoch.setdefault(record["epoch"], []).append(record[key])
    if key == "loss":
        return [sum(v) / len(v) for _, v in sorted(by_epoch.items())]
    return [[sum(col) / len(col) for col in zip(*v)] for _, v in sorted(by_epoch.items())]


@asset(
    group_name="training",
    code_version="1",
    kinds={"pytorch", "safetensors"},
    pool=GPU_POOL,
    deps=[
        AssetDep(AssetKey("hidden_states"), partition_mapping=AllPartitionMapping()),
        # Bounded mode reads the traces and extracts the states itself (draft_checkpoint_bounded.py).
        AssetDep(AssetKey("validated_traces"), partition_mapping=AllPartitionMapping()),
        vocab_mapping,
    ],
    check_specs=[
        AssetCheckSpec(
            "config_complete",
            asset="draft_checkpoint",
            blocking=True,
            description="config.json has every field vLLM reads, the weights are complete, and the layer ids equal the hidden states'",
        ),
        AssetCheckSpec(
            "loads_in_vllm",
            asset="draft_checkpoint",
            blocking=True,
            description="vLLM serves the target with this draft as --speculative-config and answers a chat completion",
        ),
        AssetCheckSpec("loss_decreased", asset="draft_checkpoint", description="the last epoch's mean loss is below the first's"),
    ],
)
def draft_checkpoint(
    context: AssetExecutionContext, config: DraftTrainingConfig, target_model: TargetModel, gpu_host: GPUHost
) -> MaterializeResult:
    """The trained EAGLE-3 draft as a vLLM-native directory (config.json + model.safetensors with d2t)."""
    check_mode(config.hidden_states_mode, config.window_shards, config.bounded_checkpoint_every_steps, config.nproc_per_node)
    bounded = config.hidden_states_mode == "bounded"
    keys = sorted(context.instance.get_dynamic_partitions(SAMPLE_SHARDS))
    identity = target_model.identity()
    target_hash = identity.config_hash
    if bounded:
        if not keys:
            raise ValueError(f"no sample shards are registered ({SAMPLE_SHARDS}): materialise the per-shard assets first")
        shard_dirs, sidecars = [], []
        layer_ids, vocab_size = target_model.layer_ids(), int(target_model.text_config()["vocab_size"])
    else:
        shard_dirs, sidecars = hidden_state_shards(keys)
        layer_ids, vocab_size = [int(i) for i in sidecars[0]["aux_layer_ids"]], int(sidecars[0]["vocab_size"])
    stale = [key for key, meta in zip(keys, sidecars) if meta.get("target_config_hash") != target_hash]
    if stale:
        raise ValueError(
            f"hidden_states of shards {stale} were extracted from another target (config hash "
            f"{sidecars[keys.index(stale[0])].get('target_config_hash')}) than target_model {identity.path} ({target_hash}): "
            "set target_model.path to the target they came from, or materialise their hidden_states again"
        )

    out = asset_dir("draft_checkpoint")
    model_dir, training_dir = out / "model", out / "training"
    mapping_file = asset_dir("vocab_mapping") / "vocab_mapping.safetensors"
    train_settings = {
        "hidden_state_dirs": [str(d) for d in shard_dirs],
        "vocab_mapping": str(mapping_file),
        "target_path": str(target_model.resolved_path()),
        "training_dir": str(training_dir),
        "init_from": config.init_from,
        "epochs": config.epochs,
        "learning_rate": config.learning_rate,
        "warmup_ratio": config.warmup_ratio,
        "min_lr_ratio": config.min_lr_ratio,
        "weight_decay": config.weight_decay,
        "grad_clip": config.grad_clip,
        "ttt_steps": config.ttt_steps,
        "step_weight": config.step_weight,
        "batch_tokens": config.batch_tokens,
        "grad_accumulation": config.grad_accumulation,
        "max_seq_len": config.max_seq_len,
        "seed": config.seed,
        "draft_intermediate_size": config.draft_intermediate_size,
    }
    common_extras = {
        "export_dir": str(model_dir),
        "export_dtype": config.export_dtype,
        # The gates run in the stage: loads_in_vllm serves the target, which needs the GPU host's GPUs.
        "gates": {
            "aux_layer_ids": layer_ids,
            "target_vocab_size": vocab_size,
            "num_speculative_tokens": config.vllm_check_num_speculative_tokens,
            "trust_remote_code": target_model.trust_remote_code,
            "log_path": str(out / "loads_in_vllm.log"),
        },
    }
    if bounded:
        invocation = run_bounded_stage(
            context, gpu_host, target_model, keys, train_settings, common_extras, out=out, extraction=config.streamed_extraction,
            window_shards=config.window_shards, checkpoint_every_steps=config.bounded_checkpoint_every_steps,
        )  # fmt: skip
    else:
        invocation = gpu_host.run_stage(
            context, STAGE, {"train": train_settings, "nproc_per_node": config.nproc_per_node, **common_extras}
        )
    reported = invocation.get_materialize_result()
    stage_metadata = dict(reported.metadata or {})
    problems = list(stage_metadata.pop("config_problems").value)
    vllm_report = stage_metadata.pop("loads_in_vllm").value  # tried only when config_complete passed

    # -- the training curve
    history = json.loads((training_dir / "history.json").read_text())["history"]
    losses = epoch_means(history, "loss")
    accuracy = epoch_means(history, "accuracy")[-1] if history else []
    # Expected accepted tokens per draft if positions were independent: a rough guide, not a measurement.
    expected_accepted, chain = 0.0, 1.0
    for a in accuracy:
        chain *= a
        expected_accepted += chain

    # -- the gates (computed by the stage, on the GPU host)
    if problems:
        context.log.error("config_complete failed:\n" + "\n".join(f"- {p}" for p in problems))
    else:
        context.log.info(f"loads_in_vllm: {vllm_report['detail']}")
    loss_went_down = len(losses) >= 2 and losses[-1] < losses[0]

    version = stable_hash(
        {
            "training": stage_metadata["training_fingerprint"].value,
            "target": target_hash,
            "layer_ids": layer_ids,
            "export_dtype": config.export_dtype,
        }
    )
    return MaterializeResult(
        data_version=DataVersion(version),
        metadata={
            **stage_metadata,
            "path": MetadataValue.path(str(model_dir)),
            "aux_layer_ids": MetadataValue.json(layer_ids),
            "target": MetadataValue.json(identity.as_dict()),
            "samples": sum(len(m["sample_ids"]) for m in sidecars) if not bounded else sum(
                s["samples"] for s in stage_metadata["streamed_shards"].value if s["epoch"] == 1
            ),
            "shards": len(keys),
            "hidden_states_mode": config.hidden_states_mode,
            # Which storage precision the draft learned from (8-bit states are dequantised to float32 for training).
            "hidden_state_dtypes": MetadataValue.json(
                sorted({str(m.get("dtype")) for m in sidecars}) if not bounded else [config.streamed_extraction.dtype]
            ),
            "epochs": (stage_metadata["schedule"].value or {}).get("epochs"),
            "steps": len(history),
            "first_epoch_loss": losses[0] if losses else None,
            "last_epoch_loss": losses[-1] if losses else None,
            "loss_by_epoch": MetadataValue.json([round(x, 5) for x in losses]),
            "accuracy_by_position": MetadataValue.json([round(a, 4) for a in accuracy]),
            "expected_accepted_tokens_per_draft": round(expected_accepted, 3),
            "training_curve": MetadataValue.md(
                "Loss per optimizer step (all unrolled steps, weighted):\n\n" + render_curve([r["loss"] for r in history])
            ),
            "per_position_accuracy": MetadataValue.md(
                "Last epoch, draft token i vs the target's top-1 token:\n\n" + render_accuracy(accuracy)
            ),
        },
        check_results=[
            AssetCheckResult(
                check_name="config_complete",
                passed=not problems,
                severity=AssetCheckSeverity.ERROR,
                description="; ".join(problems[:5]) or None,
                metadata={"problems": MetadataValue.json(problems), "expected_aux_layer_ids": MetadataValue.json(layer_ids)},
            ),
            AssetCheckResult(
                check_name="loads_in_vllm",
                passed=bool(vllm_report["passed"]),
                severity=AssetCheckSeverity.ERROR,
                description=vllm_report["detail"],
                metadata={k: v for k, v in vllm_report["metadata"].items() if v is not None},
            ),
            AssetCheckResult(
                check_name="loss_decreased",
                passed=loss_went_down,
                severity=AssetCheckSeverity.WARN,
                description=None if loss_went_down else f"mean loss by epoch {[round(x, 4) for x in losses]} did not go down",
                metadata={"first_epoch_loss": losses[0] if losses else None, "last_epoch_loss": losses[-1] if losses else None},
            ),
        ],
    )
