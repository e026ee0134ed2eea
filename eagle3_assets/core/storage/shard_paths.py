"""Where a shard's files live: one place for every asset and GPU stage.

Under the data directory, each asset has its directory, and each shard (a
partition key, ``shard-00003``) its files there::

    <data>/<asset>/<shard>.parquet                    the shard (prompts, raw_responses, validated_traces)
    <data>/<asset>/<shard>.rejected.parquet           its rejected rows, each with a reason
    <data>/<asset>/<shard>.heldout.parquet            prompts kept out of training (prompts)
    <data>/<asset>/<shard>.journal.jsonl              raw_responses' journal of settled rows, while it generates
    <data>/<asset>/<shard>.lease                      the lease of the run that writes the shard
    <data>/<asset>/superseded/<shard>.<fp>.parquet    a finished generation of other settings, kept
    <data>/<asset>/<shard>/                           a shard of many files (hidden_states' parts) ...
    <data>/<asset>/<shard>/metadata.json              ... and its sidecar, written last
    <data>/<asset>/<shard>/extraction.json            hidden_states: the stage's record of the finished shard (reuse)
    <data>/<asset>/engine_builds.jsonl                hidden_states: one line per engine the stage built
    <data>/<asset>/.<shard>.*.partial                 temporary files, renamed into place when whole
    <data>/.locks/                                    stage locks and lease guards ($EAGLE3_LOCK_DIR, gpu_host.lock_dir)

and the assets over all shards (:class:`DatasetPaths`)::

    <data>/vocab_mapping/vocab_mapping.safetensors
    <data>/draft_checkpoint/model/                    the exported draft (config.json, model.safetensors, SERVING.md)
    <data>/draft_checkpoint/training/                 checkpoints, history.json, result.json
    <data>/draft_checkpoint/loads_in_vllm.log
    <data>/draft_evaluation/report.json, eval_prompts.jsonl

Every file name of the platform is spelled here, and only here.

A GPU stage is sent the same paths relative to the data directory
(:meth:`ShardPaths.relative`) and resolves them against its host's own.
Standard library only, like :mod:`.shard_lease`, which the GPU host's
pre-flight imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.core.settings.environment import DATA_DIR, LOCK_DIR

PARTIAL_SUFFIX = ".partial"  # temporary files and directories (core.storage.files.atomic_path, staging_dir)
PARQUET_SUFFIX = ".parquet"
REJECTED_SUFFIX = ".rejected.parquet"
HELDOUT_SUFFIX = ".heldout.parquet"
JOURNAL_SUFFIX = ".journal.jsonl"
IMPORT_SUFFIX = ".import.json"  # raw_responses: the files of responses adopted into the shard (core.generation.adopt)
LEASE_SUFFIX = ".lease"
SUPERSEDED_DIR = "superseded"
SIDECAR = "metadata.json"
DRAFT_CONFIG_FILE = "config.json"  # draft_checkpoint: the exported draft's config, the file vLLM reads first
SHARD_RECORD = "extraction.json"  # hidden_states: what the stage reported for a finished shard, written after its gates
ENGINE_BUILDS = "engine_builds.jsonl"  # hidden_states: one JSON line per engine an extraction run built
PART_PATTERN = "part-{:05d}.safetensors"  # hidden_states' parts, in order
PART_GLOB = "part-*.safetensors"
LOCKS_DIR = ".locks"
VOCAB_MAPPING_FILE = "vocab_mapping.safetensors"
HISTORY_FILE = "history.json"  # the training run's per-step losses
RESULT_FILE = "result.json"  # the training run's summary
SERVING_NOTES = "SERVING.md"  # beside the exported draft: how to serve it
LOADS_IN_VLLM_LOG = "loads_in_vllm.log"
EVALUATION_REPORT = "report.json"
EVAL_PROMPTS_FILE = "eval_prompts.jsonl"


def data_dir() -> Path:
    """The root of all asset outputs: ``$EAGLE3_DATA_DIR``, else ``./data``."""
    return Path(DATA_DIR.get()).resolve()


def lock_dir(root: Path | str | None = None) -> Path:
    """Where this machine's stage locks and lease guards live: ``$EAGLE3_LOCK_DIR``, else ``<root>/.locks``.

    ``root``: the data directory (default this process's). On the GPU host the stage process gets
    ``EAGLE3_LOCK_DIR`` from ``gpu_host.lock_dir``, so its shard leases and its stage lock share the one setting.
    """
    chosen = LOCK_DIR.get()
    return Path(chosen) if chosen else Path(root or data_dir()) / LOCKS_DIR


def lease_path(asset_dir: Path | str, shard: str) -> Path:
    return Path(asset_dir) / f"{shard}{LEASE_SUFFIX}"


def superseded_path(parquet_path: Path | str, fingerprint: str) -> Path:
    """Where the finished ``<shard>.parquet`` made with ``fingerprint`` is kept once other settings replace it."""
    parquet_path = Path(parquet_path)
    return parquet_path.parent / SUPERSEDED_DIR / f"{parquet_path.stem}.{fingerprint}{PARQUET_SUFFIX}"


def shard_partials(asset_dir: Path | str, shard: str) -> list[Path]:
    """The shard's temporary files and directories: ``.<shard>.*.partial`` beside them, ``*.partial`` under ``<shard>/``."""
    root = Path(asset_dir)
    found = list(root.glob(f".{shard}.*{PARTIAL_SUFFIX}"))
    inside = root / shard
    if inside.is_dir():
        found += list(inside.rglob(f"*{PARTIAL_SUFFIX}"))
    return sorted(found)


def training_shards(asset_dir: Path | str) -> list[Path]:
    """The shards' own Parquet files in an asset's directory (not their rejected rows, not held-out prompts)."""
    return sorted(p for p in Path(asset_dir).glob(f"shard-*{PARQUET_SUFFIX}") if not p.name.endswith((REJECTED_SUFFIX, HELDOUT_SUFFIX)))


@dataclass(frozen=True)
class ShardPaths:
    """The files of one shard of one asset, under ``root`` (the data directory, read when made)."""

    asset: str
    shard: str
    root: Path = field(default_factory=data_dir)

    @classmethod
    def relative(cls, asset: str, shard: str) -> ShardPaths:
        """The same paths relative to the data directory: what a GPU stage is sent."""
        return cls(asset, shard, Path())

    @property
    def asset_dir(self) -> Path:
        return self.root / self.asset

    def _shard_file(self, suffix: str) -> Path:
        """Every file of the shard is named after it: ``<asset dir>/<shard><suffix>``."""
        return self.asset_dir / f"{self.shard}{suffix}"

    @property
    def parquet(self) -> Path:
        return self._shard_file(PARQUET_SUFFIX)

    @property
    def rejected(self) -> Path:
        return self._shard_file(REJECTED_SUFFIX)

    @property
    def heldout(self) -> Path:
        return self._shard_file(HELDOUT_SUFFIX)

    @property
    def journal(self) -> Path:
        return self._shard_file(JOURNAL_SUFFIX)

    @property
    def import_record(self) -> Path:
        return self._shard_file(IMPORT_SUFFIX)

    @property
    def lease(self) -> Path:
        return lease_path(self.asset_dir, self.shard)

    @property
    def superseded_dir(self) -> Path:
        return self.asset_dir / SUPERSEDED_DIR

    def superseded(self) -> list[Path]:
        """The finished generations of other settings kept for this shard."""
        return sorted(self.superseded_dir.glob(f"{self.shard}.*{PARQUET_SUFFIX}")) if self.superseded_dir.is_dir() else []

    @property
    def directory(self) -> Path:
        """The shard's own directory, for an asset that writes many files per shard (hidden_states)."""
        return self.asset_dir / self.shard

    @property
    def sidecar(self) -> Path:
        return self.directory / SIDECAR

    def partials(self) -> list[Path]:
        return shard_partials(self.asset_dir, self.shard)


@dataclass(frozen=True)
class DatasetPaths:
    """The files of the assets made over all shards, under ``root`` (the data directory, read when made)."""

    root: Path = field(default_factory=data_dir)

    @property
    def vocab_mapping(self) -> Path:
        return self.root / "vocab_mapping" / VOCAB_MAPPING_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "draft_checkpoint"

    @property
    def draft_model(self) -> Path:
        """The exported draft, the directory vLLM loads."""
        return self.checkpoint_dir / "model"

    @property
    def training_dir(self) -> Path:
        return self.checkpoint_dir / "training"

    @property
    def history(self) -> Path:
        return self.training_dir / HISTORY_FILE

    @property
    def loads_in_vllm_log(self) -> Path:
        return self.checkpoint_dir / LOADS_IN_VLLM_LOG

    @property
    def evaluation_dir(self) -> Path:
        return self.root / "draft_evaluation"

    @property
    def evaluation_report(self) -> Path:
        return self.evaluation_dir / EVALUATION_REPORT

    @property
    def eval_prompts(self) -> Path:
        return self.evaluation_dir / EVAL_PROMPTS_FILE
