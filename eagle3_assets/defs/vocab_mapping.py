"""``vocab_mapping``: the draft vocabulary over the green shards of validated traces.

Counts target token ids where ``loss_mask == 1`` (the tokens the target wrote
itself) over the shards whose validated traces passed their blocking gates (or
the shards the config names; a blocked shard is left out, never waited for,
and the metadata lists it with why: :mod:`eagle3_assets.glue.shard_status`), keeps the ``draft_vocab_size`` most frequent (ties by
id), and writes ``<data>/vocab_mapping/vocab_mapping.safetensors`` (``d2t``,
``t2d``) and ``vocab_mapping.json``. See :mod:`eagle3_assets.core.draft.vocab`.
"""

from types import SimpleNamespace

from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.draft.gates import VOCAB_MAPPING_GATES
from eagle3_assets.core.storage.shard_files import read_shard_parquet
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.storage.files import asset_dir, file_hash, stable_hash
from eagle3_assets.glue.partitions import SAMPLE_SHARDS
from eagle3_assets.core.validation.gates import TRACE_GATES
from eagle3_assets.glue.shard_status import green_shards, selection_metadata
from eagle3_assets.glue.stage_configs import VocabMappingConfig
from resources.target_model import TargetModel

TRACES = "validated_traces"
CHECKS = AssetChecks(VOCAB_MAPPING_GATES)  # the declared gates as this asset's checks


def shard_files(asset_name: str, keys: list[str]) -> dict:
    """The Parquet file of every registered shard of ``asset_name``; an error names the shards without one."""
    if not keys:
        raise ValueError(f"no sample shards are registered ({SAMPLE_SHARDS}): materialise the per-shard assets first")
    files = {key: ShardPaths(asset_name, key).parquet for key in keys}
    missing = [key for key, path in files.items() if not path.exists()]
    if missing:
        raise FileNotFoundError(f"{asset_name} has no output for shards {missing} under {files[keys[0]].parent}: materialise those shards first")
    return files


@asset(
    group_name="training",
    code_version="1",
    kinds={"polars", "safetensors"},
    deps=[AssetDep(AssetKey("validated_traces"), partition_mapping=AllPartitionMapping())],
    check_specs=CHECKS.specs(),
)
def vocab_mapping(context: AssetExecutionContext, config: VocabMappingConfig, target_model: TargetModel) -> MaterializeResult:
    """The draft vocabulary (d2t/t2d): the most frequent target tokens of every shard's assistant turns."""
    # Here, not at the top: core.draft.vocab needs torch, and every run worker loads this module.
    from eagle3_assets.core.draft.vocab import build_vocab_mapping, count_supervised_tokens, coverage, save_vocab_mapping

    selection = green_shards(context.instance, {TRACES: TRACE_GATES.blocking_names}, config.shards)
    context.log.info(f"vocab_mapping: {selection.summary()}")
    keys = selection.used
    files = shard_files(TRACES, keys)
    target_vocab_size = int(target_model.text_config()["vocab_size"])
    draft_vocab_size = min(config.draft_vocab_size, target_vocab_size)
    if draft_vocab_size < config.draft_vocab_size:
        context.log.warning(f"draft_vocab_size {config.draft_vocab_size} exceeds the target's vocabulary: using {target_vocab_size}")

    counts = None
    samples = 0
    for key, path in files.items():
        traces = read_shard_parquet(path, asset="validated_traces", shard=key, columns=["id", "input_ids", "loss_mask"])
        try:
            shard_counts = count_supervised_tokens(traces, target_vocab_size)
        except ValueError as exc:
            raise ValueError(f"validated_traces {path}: {exc}") from None
        counts = shard_counts if counts is None else counts + shard_counts
        samples += traces.height
    mapping = build_vocab_mapping(counts, draft_vocab_size)
    covered = coverage(counts, mapping)
    supervised = int(counts.sum())
    out = asset_dir("vocab_mapping")
    path = save_vocab_mapping(
        out, mapping, {"coverage": covered, "supervised_tokens": supervised, "samples": samples, "shards": keys, "shards_left_out": selection.left_out}
    )

    uncovered = (counts * ~mapping.t2d).topk(min(10, target_vocab_size))
    uncovered_ids = [(int(i), int(c)) for c, i in zip(uncovered.values, uncovered.indices) if c > 0]
    distinct = int((counts > 0).sum())
    context.log.info(
        f"draft vocabulary {draft_vocab_size} of {target_vocab_size}: coverage {covered:.4f} "
        f"of {supervised} supervised tokens ({distinct} distinct) over {len(keys)} shards"
    )
    version = stable_hash(
        {
            "traces": {key: file_hash(p) for key, p in files.items()},
            "draft_vocab_size": draft_vocab_size,
            "target": target_model.config_hash(),
        }
    )
    return MaterializeResult(
        data_version=DataVersion(version),
        metadata={
            "path": MetadataValue.path(str(path)),
            "draft_vocab_size": draft_vocab_size,
            "target_vocab_size": target_vocab_size,
            "coverage": covered,
            "supervised_tokens": supervised,
            "distinct_supervised_tokens": distinct,
            "samples": samples,
            "shards": len(keys),
            **selection_metadata(selection),
        },
        check_results=CHECKS.results(
            SimpleNamespace(covered=covered, uncovered=supervised - int(counts[mapping.t2d].sum()), uncovered_ids=uncovered_ids)
        ),
    )
