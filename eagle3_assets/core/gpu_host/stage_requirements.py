"""What a GPU stage needs from its host, and the pre-flight's spec built from it (on the orchestrator's side).

The spec is JSON; :mod:`.preflight` runs it in the host's Python.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from eagle3_assets.core.gpu_host.preflight import STAGE_PACKAGE
from eagle3_assets.core.serving.profile import GPUNeed

MIB = 1 << 20
# Modules every stage needs besides its own: the Pipes protocol that carries its results back.
BASE_MODULES = ("dagster_pipes", "pydantic")  # every stage reads its job with pydantic (core/settings/job_schema.py)
UNIT_STATES = ("active", "inactive")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class StageRequirements:
    """What a GPU stage needs from its host; checked by the pre-flight before every run.

    ``modules``: modules that must import in the host's Python (the stage's own
    module is always imported too, so a syntax error or a missing import in it
    fails here, not an hour into the run). ``lock``: name of the stage lock on
    the host (default: the stage's name). ``systemd_units``: unit -> "active" or
    "inactive". ``min_gpus`` GPUs must be present, each of them (or those in
    ``gpu_indices``) with ``min_free_gpu_memory`` bytes free. ``cpu_allowed``:
    the stage may run without a GPU. ``disk_bytes``: estimate of what the stage
    writes into its first output dir; ``disk_note`` says what it counts (e.g. the
    tokens and the storage precision), and is quoted when the disk is too small.
    ``output_dirs``: relative to the host's
    data dir (default: the stage's name), scanned for partial files.
    ``gpu_memory_note``: what ``min_free_gpu_memory`` counts (a stage that starts the
    target: its share of the weights and a KV cache, :func:`with_serving_need`),
    quoted when a GPU has less free. ``serves_target``: the stage starts the
    target as its serving profile says (for sequences of up to
    ``serving_context`` tokens; None: the target's context), so the
    ``gpu_host_ready`` job checks the profile's GPUs and memory for it as the
    stage's own run does.
    """

    modules: Sequence[str] = ()
    lock: str | None = None
    systemd_units: Mapping[str, str] = field(default_factory=dict)
    min_gpus: int = 1
    min_free_gpu_memory: int = 0
    gpu_indices: Sequence[int] | None = None
    cpu_allowed: bool = False
    disk_bytes: int = 0
    disk_note: str = ""
    output_dirs: Sequence[str] | None = None
    gpu_memory_note: str = ""
    serves_target: bool = False
    serving_context: int | None = None

    def __post_init__(self) -> None:
        # Accept lists and dicts from callers, keep the object hashable and immutable.
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "systemd_units", dict(self.systemd_units))
        if self.gpu_indices is not None:
            object.__setattr__(self, "gpu_indices", tuple(int(i) for i in self.gpu_indices))
        if self.output_dirs is not None:
            object.__setattr__(self, "output_dirs", tuple(self.output_dirs))
        for module in self.modules:
            if not _NAME.match(module):
                raise ValueError(f"StageRequirements.modules: {module!r} is not a module name")
        if self.lock is not None and not _is_plain_name(self.lock):
            raise ValueError(f"StageRequirements.lock: {self.lock!r} must be a plain name (letters, digits, _ . -)")
        for unit, state in self.systemd_units.items():
            if state not in UNIT_STATES:
                raise ValueError(f"StageRequirements.systemd_units[{unit!r}]: {state!r} is not one of {UNIT_STATES}")
        for name, value in (("min_gpus", self.min_gpus), ("min_free_gpu_memory", self.min_free_gpu_memory), ("disk_bytes", self.disk_bytes)):
            if value < 0:
                raise ValueError(f"StageRequirements.{name}: {value} is negative")

    def lock_name(self, stage: str) -> str:
        return self.lock or stage


def with_serving_need(requirements: StageRequirements, need: GPUNeed) -> StageRequirements:
    """``requirements`` of a stage that starts the target: at least the GPUs one start of it takes (TP x PP x DP),
    each with its share of the weights and a KV cache free (:func:`eagle3_assets.core.serving.profile.gpu_need`)."""
    return dataclasses.replace(
        requirements,
        min_gpus=max(requirements.min_gpus, need.gpus),
        min_free_gpu_memory=max(requirements.min_free_gpu_memory, need.bytes_per_gpu),
        gpu_memory_note=need.note,
    )


def validate_stage_name(stage: str) -> str:
    """A stage is a module under ``eagle3_assets.stages``: a plain identifier, nothing a shell could read."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", stage or ""):
        raise ValueError(f"stage {stage!r}: not a stage module name (lower-case letters, digits, _)")
    return stage


def _is_plain_name(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name)) and ".." not in name



def build_spec(
    stage: str,
    requirements: StageRequirements,
    *,
    data_dir: str,
    lock_dir: str,
    partial_suffix: str,
    remove_partial_files: bool,
    cpu_allowed_by_host: bool,
    nvidia_smi: str = "nvidia-smi",
    systemctl: str = "systemctl",
    serving_unit: str = "",
) -> dict:
    """The JSON the host's pre-flight runs from: paths resolved on the host's side, nothing secret."""
    validate_stage_name(stage)
    outputs = requirements.output_dirs if requirements.output_dirs is not None else (stage,)
    return {
        "stage": stage,
        "modules": [*BASE_MODULES, *requirements.modules, f"{STAGE_PACKAGE}.{stage}"],
        "lock_path": lock_path(lock_dir, requirements.lock_name(stage)),
        "systemd_units": dict(requirements.systemd_units),
        "cpu_allowed": requirements.cpu_allowed or cpu_allowed_by_host,
        "cpu_allowed_by": "stage" if requirements.cpu_allowed else ("host" if cpu_allowed_by_host else None),
        "min_gpus": requirements.min_gpus,
        "min_free_gpu_memory_mib": -(-requirements.min_free_gpu_memory // MIB),
        "gpu_indices": list(requirements.gpu_indices) if requirements.gpu_indices is not None else None,
        "gpu_memory_note": requirements.gpu_memory_note,
        "serving_unit": serving_unit,
        "disk_bytes": requirements.disk_bytes,
        "disk_note": requirements.disk_note,
        "output_dirs": [os.path.join(data_dir, d) for d in outputs],
        "partial_suffix": partial_suffix,
        "remove_partial_files": remove_partial_files,
        "nvidia_smi": nvidia_smi,
        "systemctl": systemctl,
    }


def lock_path(lock_dir: str, name: str) -> str:
    if not _is_plain_name(name):
        raise ValueError(f"lock name {name!r}: must be a plain name (letters, digits, _ . -)")
    return os.path.join(lock_dir, f"{name}.lock")
