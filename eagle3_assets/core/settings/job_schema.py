"""Typed settings: pydantic models whose fields carry their one default, description and limits.

A stage's settings are one model (``ExtractionRecipe``, ``EvaluationRecipe``,
``GenerationSettings``...). The same class is

- the Dagster run config (or resource) of the asset that runs the stage: the
  asset's ``Config`` class is the settings model with Dagster's base mixed in,
  ``class HiddenStatesConfig(ExtractionRecipe, Config)``, and lists no field
  again, so the launchpad shows each field's default, description and limits
  as written here;
- the base of the job sent to the GPU stage over Pipes: the job adds the fields
  the asset fills in (paths, the target, the shard) with :func:`given`; the
  asset sends ``job.model_dump()`` and the stage reads it back with
  :meth:`JobSchema.from_dict` (``model_validate``, strict, with an error that
  names the key).

Dagster-free (``pydantic`` only), so the GPU host's stages import it without
Dagster.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_LIMITS = ("gt", "ge", "lt", "le")


def setting(default: Any, description: str, *, repr: bool = True, **limits: float) -> Any:
    """A field with its one default, its description and optional limits (``gt``, ``ge``, ``lt``, ``le``).

    ``repr=False`` keeps a secret out of the model's repr.
    """
    unknown = set(limits) - set(_LIMITS)
    if unknown:
        raise TypeError(f"setting limits {sorted(unknown)}: one of {list(_LIMITS)}")
    if isinstance(default, (list, dict)):  # a fresh copy per instance
        return Field(default_factory=lambda: type(default)(default), description=description, repr=repr, **limits)
    return Field(default=default, description=description, repr=repr, **limits)


def given(description: str) -> Any:
    """A field without a default: what the orchestrator fills in (paths, the target, the shard)."""
    return Field(description=description)


def setting_names(model: type[BaseModel]) -> list[str]:
    """The fields of ``model`` that have a default: what a user may set (the rest the asset fills in)."""
    return [name for name, field in model.model_fields.items() if not field.is_required()]


class JobSchema(BaseModel):
    """Base of the typed settings: unknown keys refused; to and from plain JSON data, checked field by field."""

    model_config = ConfigDict(extra="forbid")

    def to_dict(self) -> dict[str, Any]:
        """``model_dump()``: what travels as the stage's Pipes extras (JSON)."""
        return self.model_dump()

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: Any, where: str | None = None):
        """``model_validate`` in strict JSON mode ("3" is no int, "yes" no bool); a ``ValueError`` naming each bad key."""
        where = where or cls.__name__
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected an object of settings, got {type(raw).__name__}")
        try:
            return cls.model_validate_json(json.dumps(raw), strict=True)
        except ValidationError as exc:
            raise ValueError(_explain(exc, where)) from None


def _key(where: str, loc: tuple) -> str:
    key = where
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else f".{part}"
    return key


def _explain(exc: ValidationError, where: str) -> str:
    """One line per problem, each naming the setting: unknown and missing keys grouped by the object they are in."""
    unknown: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    lines = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        if error["type"] == "extra_forbidden":
            unknown.setdefault(_key(where, loc[:-1]), []).append(str(loc[-1]))
        elif error["type"] == "missing":
            missing.setdefault(_key(where, loc[:-1]), []).append(str(loc[-1]))
        else:
            lines.append(f"setting {_key(where, loc)} is {error['input']!r}: {error['msg']}")
    lines = [f"{key}: unknown setting(s) {sorted(names)}" for key, names in unknown.items()] + [
        f"{key}: missing setting(s) {sorted(names)}" for key, names in missing.items()
    ] + lines
    return "; ".join(lines)


def values_of(source: Any, model: type[BaseModel]) -> dict[str, Any]:
    """The values ``source`` (a config, a resource, another model) holds for the fields of ``model``, by name."""
    return {name: getattr(source, name) for name in model.model_fields if hasattr(source, name)}
