"""Hidden states of the tiny target for the training tests, written per the hidden_states contract.

The hidden_states asset is built elsewhere; these tests need its output
without it, so a direct transformers forward of the tiny target over templated
demo conversations stands in for it: aux = hidden_states[k] for k in the layer
ids (vLLM's convention: the residual stream entering layer k), final =
hidden_states[L] (after the final norm, ``post_norm``), or the last layer's
output before the norm (``pre_norm``, what vLLM's extractor gives).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import polars as pl
import torch
from safetensors.torch import save_file

from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.core.target.identity import config_hash
from eagle3_assets.demo.prompt_set import make_traces
from eagle3_assets.demo.tiny_target import response_text

REPO = Path(__file__).resolve().parents[1]
CACHE_FORMAT = 1  # bump when what is written changes


def demo_conversations(target_dir: Path, count: int, seed: int) -> list[tuple[str, list[int], list[int]]]:
    """(id, input_ids, loss_mask) of templated conversations; the mask covers what the target would write."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    rows = []
    for i, (question, reasoning, answer) in enumerate(make_traces(count, seed)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(response_text(reasoning, answer), add_special_tokens=False)["input_ids"]
        rows.append((f"conv-{seed}-{i:04d}", prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)))
    return rows


def write_demo_hidden_states(
    target_dir: Path,
    shard_dir: Path,
    *,
    count: int = 36,
    seed: int = 0,
    layer_ids: tuple[int, ...] = (2, 3, 4),
    final_state: str = "post_norm",
    dtype: torch.dtype = torch.bfloat16,
    samples_per_file: int = 16,
) -> Path:
    from transformers import AutoConfig, LlamaForCausalLM

    from resources.target_model import TargetModel

    config = AutoConfig.from_pretrained(target_dir)
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.__setitem__("pre_norm", o[0] if isinstance(o, tuple) else o))
    conversations = demo_conversations(target_dir, count, seed)
    shard_dir = Path(shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for first in range(0, len(conversations), samples_per_file):
        part = conversations[first : first + samples_per_file]
        tensors: dict[str, list] = {"aux": [], "final": [], "ids": [], "mask": []}
        offsets = [0]
        for _, ids, mask in part:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            states = out.hidden_states
            tensors["aux"].append(torch.cat([states[k][0] for k in layer_ids], dim=-1))
            final = states[config.num_hidden_layers][0] if final_state == "post_norm" else captured["pre_norm"].reshape(len(ids), -1)
            tensors["final"].append(final)
            tensors["ids"].append(torch.tensor(ids, dtype=torch.int64))
            tensors["mask"].append(torch.tensor(mask, dtype=torch.int8))
            offsets.append(offsets[-1] + len(ids))
        name = f"part-{len(files):05d}.safetensors"
        save_file(
            {
                "aux_hidden_states": torch.cat(tensors["aux"]).to(dtype).contiguous(),
                "final_hidden_states": torch.cat(tensors["final"]).to(dtype).contiguous(),
                "input_ids": torch.cat(tensors["ids"]),
                "loss_mask": torch.cat(tensors["mask"]),
                "sample_offsets": torch.tensor(offsets, dtype=torch.int64),
            },
            str(shard_dir / name),
        )
        files.append({"name": name, "first_sample": first, "num_samples": len(part)})
    metadata = {
        "format": 1,
        "backend": "transformers",
        "target_path": str(target_dir),
        "target_config_hash": TargetModel(path=str(target_dir)).config_hash(),
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "aux_layer_ids": list(layer_ids),
        "final_state": final_state,
        "dtype": str(dtype).removeprefix("torch."),
        "sample_ids": [c[0] for c in conversations],
        "num_tokens": [len(c[1]) for c in conversations],
        "files": files,
    }
    (shard_dir / "metadata.json").write_text(json.dumps(metadata, indent=1))
    return shard_dir


def cached_demo_hidden_states(target_dir: Path, shards: int = 2, count: int = 24, **options) -> list[Path]:
    """Shard directories ``shard-0000k`` (seed k), built once and cached under ``.cache/`` across test runs."""
    build_info = json.loads((Path(target_dir) / "build_info.json").read_text())
    # The identity too: the sidecars record it, and a cache written under another definition of it is stale.
    key = stable_hash({"target": build_info["fingerprint"], "identity": config_hash(target_dir), "shards": shards, "count": count, "options": repr(sorted(options.items())), "format": CACHE_FORMAT})
    root = REPO / ".cache" / "test_hidden_states" / key
    if not (root / "complete").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root.parent))
        try:
            for k in range(shards):
                write_demo_hidden_states(target_dir, staging / f"shard-{k:05d}", count=count, seed=k, **options)
            (staging / "complete").write_text("")
            shutil.rmtree(root, ignore_errors=True)
            os.replace(staging, root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return [root / f"shard-{k:05d}" for k in range(shards)]


def copy_hidden_states(shard_dirs: list[Path], data_dir: Path) -> list[Path]:
    """Place cached shards where the hidden_states asset would have written them: ``<data>/hidden_states/<shard>/``."""
    out = []
    for shard in shard_dirs:
        target = data_dir / "hidden_states" / shard.name
        shutil.copytree(shard, target)
        out.append(target)
    return out


def write_validated_traces(target_dir: Path, data_dir: Path, keys: list[str], count: int) -> None:
    """What validated_traces writes for the shards (the columns vocab_mapping reads), from the same conversations."""
    out = data_dir / "validated_traces"
    out.mkdir(parents=True)
    for seed, key in enumerate(keys):
        rows = demo_conversations(target_dir, count, seed)
        pl.DataFrame(
            {"id": [r[0] for r in rows], "input_ids": [r[1] for r in rows], "loss_mask": [r[2] for r in rows], "num_tokens": [len(r[1]) for r in rows]},
            schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)},
        ).write_parquet(out / f"{key}.parquet")


def training_inputs(target_dir: Path, data_dir: Path, count: int = 24):
    """Two shards of hidden states and their traces in ``data_dir``, registered in a fresh instance (returned)."""
    from dagster import DagsterInstance

    from eagle3_assets.glue.partitions import register_shards

    keys = [s.name for s in copy_hidden_states(cached_demo_hidden_states(target_dir, shards=2, count=count), data_dir)]
    write_validated_traces(target_dir, data_dir, keys, count)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, keys)
    return instance
