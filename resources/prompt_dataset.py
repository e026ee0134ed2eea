"""The prompt dataset and how it is cut into sample shards."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from eagle3_assets.core.prompt_loading import ShardPrompts, count_rows, load_shard
from eagle3_assets.core.sharding import DEFAULT_SHARD_SIZE, shard_keys_for

DEMO_SOURCE = "demo"
# 1 %: 100 evaluation prompts from the story's 10,000, and a draft trained on the other 99 %.
DEFAULT_HOLDOUT_SHARE = 0.01


class PromptDataset(ConfigurableResource):
    """Where the prompts come from: a JSONL or Parquet path, a hub dataset name, or ``demo``."""

    source: str = Field(
        default=DEMO_SOURCE,
        description="JSONL/Parquet path, hub dataset name ('org/name' or 'org/name:split'), or 'demo' for the built-in set",
    )
    shard_size: int = Field(default=DEFAULT_SHARD_SIZE, gt=0, description="rows per sample shard; changing it re-keys every shard")
    holdout_share: float = Field(
        default=DEFAULT_HOLDOUT_SHARE,
        ge=0,
        lt=1,
        description="share of prompts kept out of training (chosen by a hash of the id) for draft_evaluation's held-out set",
    )

    def resolved_source(self) -> str:
        if self.source == DEMO_SOURCE:
            from eagle3_assets.demo.stack import demo_prompts_path

            return str(demo_prompts_path())
        return str(Path(self.source).expanduser()) if Path(self.source).expanduser().exists() else self.source

    def file_version(self) -> dict | None:
        """Size and mtime of the dataset file, read without opening it; None for a hub dataset.

        What the new-shards sensor compares between ticks before it parses anything.
        """
        path = Path(self.resolved_source())
        if not path.is_file():
            return None
        st = path.stat()
        return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def shard_keys(self) -> list[str]:
        return shard_keys_for(count_rows(self.resolved_source()), self.shard_size)

    def load_shard(self, key: str) -> ShardPrompts:
        return load_shard(self.resolved_source(), key, self.shard_size)
