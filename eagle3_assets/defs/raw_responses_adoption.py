"""``raw_responses``' run config for adopting an existing file of responses, and the asset's side of it.

The logic is :mod:`eagle3_assets.core.generation.adopt`; this module turns
the run config into its call, its report into run-log lines and metadata, and
its record into the shard's data version. Set ``adopt_from`` once for a
backfill through ``EAGLE3_ADOPT_RESPONSES`` (the field's default), or per run
under ``ops: raw_responses: config:`` in the launchpad.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
from dagster import AssetExecutionContext, Config, Failure, MetadataValue
from pydantic import Field

from eagle3_assets.core.generation import adopt
from eagle3_assets.core.generation.completions import Sample
from eagle3_assets.core.generation.config import GenerationConfig
from eagle3_assets.core.generation.response_files import SERVER_PREFIX
from eagle3_assets.core.generation.shard_resume import generation_fingerprint
from eagle3_assets.core.settings.environment import ADOPT_RESPONSES
from eagle3_assets.core.storage.shard_paths import ShardPaths


class RawResponsesConfig(Config):
    adopt_from: str = Field(
        default=ADOPT_RESPONSES.get() or "",
        description="an existing file of responses to adopt before generating: JSONL of chat completions (messages with the "
        "response's reasoning and content) or a raw_responses Parquet of another instance; only the prompts it has no "
        f"usable row for are sent (default: ${ADOPT_RESPONSES.name}; empty: adopt nothing)",
    )
    adopt_match: str = Field(
        default="auto",
        description=f"how the file's rows are matched to the shard's prompts: one of {adopt.MATCH_MODES} (auto: by id, else by the prompt's content)",
    )


def adopt_existing(
    context: AssetExecutionContext, config: RawResponsesConfig, samples: Sequence[Sample], paths: ShardPaths, generation: GenerationConfig
) -> adopt.AdoptionReport | None:
    """Adopt the configured file's rows for this shard into its journal (under the shard's lease); None when none is configured."""
    if not config.adopt_from:
        return None
    try:
        return adopt.adopt_responses(
            config.adopt_from, samples, paths.journal, paths.parquet, generation_fingerprint(samples, generation),
            match=config.adopt_match, allow_truncated=generation.allow_truncated, log=lambda line: context.log.info(f"{paths.shard}: {line}"),
        )  # fmt: skip
    except adopt.AdoptionError as exc:
        raise Failure(f"raw_responses {paths.shard}: {exc}; nothing adopted, nothing sent") from None


def adoption_lineage(paths: ShardPaths) -> dict[str, Any]:
    """The files adopted into the shard, for its data version ({} for a shard that adopted none: its version is unchanged)."""
    return adopt.lineage(paths.parquet)


def adoption_metadata(paths: ShardPaths, frame: pl.DataFrame) -> dict[str, Any]:
    """How many of the shard's rows are adopted ones, and the import record, where the shard ever adopted rows."""
    record = adopt.read_import_record(paths.parquet)
    if record is None:
        return {}
    adopted = frame.filter(pl.col("server").str.starts_with(SERVER_PREFIX))
    return {
        # Rows of the finished shard that came from a file (re-tokenised: validated_traces builds their ids).
        "adopted_rows": adopted.height,
        "adopted_from": MetadataValue.json({Path(e["source"]).name: e["source_sha256"] for e in record["imports"].values()}),
        "import": MetadataValue.json(record),
        "import_record": MetadataValue.path(str(paths.import_record)),
    }
