"""The prompt dataset and how it is cut into sample shards.

The defaults come from the environment (``EAGLE3_PROMPTS``,
``EAGLE3_SHARD_SIZE``), read when the code location loads, as the schema's
defaults: a launchpad override of one field keeps the others
(:mod:`resources.target_model` says why).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from dagster import ConfigurableResource
from pydantic import Field

from eagle3_assets.core.settings.environment import MAX_SAMPLES, PROMPTS, SHARD_SIZE
from eagle3_assets.core.prompts.loading import ShardPrompts, count_rows, load_shard
from eagle3_assets.core.prompts.heldout import HoldoutPlan, dataset_questions, plan_holdout
from eagle3_assets.core.prompts.sharding import DEFAULT_SHARD_SIZE, rows_per_shard, shard_keys_for
from eagle3_assets.core.storage.files import stable_hash, write_json_atomic
from eagle3_assets.core.storage.shard_paths import data_dir

HOLDOUT_PLAN_FILE = ".holdout_plan.json"  # the plan of the dataset's current file version, under <data>/prompts/

SOURCE_ENV = PROMPTS.name
SHARD_SIZE_ENV = SHARD_SIZE.name
MAX_SAMPLES_ENV = MAX_SAMPLES.name
# 1 %: 100 evaluation prompts from the story's 10,000, and a draft trained on the other 99 %.
DEFAULT_HOLDOUT_SHARE = 0.01
# A figure over fewer prompts says little: 1 % of 640 prompts held out 3. 32 is the least the README's figures use.
DEFAULT_HOLDOUT_MIN_PROMPTS = 32


def shard_size_from_env() -> int | None:
    return SHARD_SIZE.get()


class PromptDataset(ConfigurableResource):
    """Where the prompts come from: a JSONL or Parquet path, or a hub dataset name."""

    # Required unless the environment names the deployment's prompts.
    source: str = Field(
        default=PROMPTS.get() or ...,
        description=f"JSONL/Parquet path, or hub dataset name ('org/name' or 'org/name:split') (default: ${SOURCE_ENV})",
    )
    shard_size: int = Field(
        default=shard_size_from_env() or DEFAULT_SHARD_SIZE,
        gt=0,
        description=f"rows per sample shard; changing it re-keys every shard (default: ${SHARD_SIZE_ENV} or {DEFAULT_SHARD_SIZE})",
    )
    # Ramp-up: the first N prompts only (whole shards); raising it registers more shards, lowering it registers none
    # fewer (retire shards to take them out: python -m eagle3_assets.retire).
    max_samples: Optional[int] = Field(
        default=MAX_SAMPLES.get(),
        gt=0,
        description=f"register only the shards the first max_samples prompts fill (rounded up to whole shards); raise it to grow the run; unset: every row (default: ${MAX_SAMPLES_ENV})",
    )
    holdout_share: float = Field(
        default=DEFAULT_HOLDOUT_SHARE,
        ge=0,
        lt=1,
        description="share of prompts kept out of training (chosen by a hash of the question, so repeats stay together) for draft_evaluation's held-out set",
    )

    holdout_min_prompts: int = Field(
        default=DEFAULT_HOLDOUT_MIN_PROMPTS,
        ge=0,
        description="the least number of prompts held out, across the dataset: where holdout_share holds out fewer, the share "
        "is raised until it does, unless that takes more than 10 % of the dataset; prompts' metadata says how the held-out set was reached",
    )

    @classmethod
    def from_env(cls, **overrides) -> PromptDataset:
        """The deployment's prompts: ``EAGLE3_PROMPTS`` and ``EAGLE3_SHARD_SIZE`` where set, read now."""
        fields = {"source": PROMPTS.get(), "shard_size": shard_size_from_env(), "max_samples": MAX_SAMPLES.get()}
        return cls(**{**{k: v for k, v in fields.items() if v is not None}, **overrides})

    def resolved_source(self) -> str:
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
        """The shards to register: every one the dataset spans, or those the first ``max_samples`` rows fill."""
        return shard_keys_for(count_rows(self.resolved_source()), self.shard_size, self.max_samples)

    def shard_rows(self, keys: list[str]) -> dict[str, int]:
        """The prompts (dataset rows) each of ``keys`` holds."""
        return rows_per_shard(count_rows(self.resolved_source()), self.shard_size, keys)

    def load_shard(self, key: str) -> ShardPrompts:
        return load_shard(self.resolved_source(), key, self.shard_size)


    def holdout_plan(self) -> HoldoutPlan:
        """The held-out share over the whole dataset and how it was reached; cached per file version beside the prompts."""
        version = self.file_version()
        cache = data_dir() / "prompts" / HOLDOUT_PLAN_FILE
        key = stable_hash({"file": version, "share": self.holdout_share, "min": self.holdout_min_prompts})
        if version is not None and cache.is_file():
            cached = json.loads(cache.read_text())
            if cached.get("key") == key:
                return HoldoutPlan(**cached["plan"])
        if self.holdout_share <= 0:
            return plan_holdout([], 0.0, self.holdout_min_prompts)
        plan = plan_holdout(dataset_questions(self.resolved_source()), self.holdout_share, self.holdout_min_prompts)
        if version is not None:
            write_json_atomic(cache, {"key": key, "plan": dataclasses.asdict(plan)})
        return plan
