"""Typed settings: dataclasses whose fields carry their one default and their description.

The GPU stages get their work as one of these (:mod:`eagle3_assets.core.stage_jobs`):
the orchestrator sends ``job.to_dict()`` as the stage's Pipes extras (JSON)
and the stage reads it back with ``Job.from_dict(extras)``, which refuses an
unknown key, a missing one, a value of the wrong type or one out of its range,
naming the key. The Dagster ``Config`` classes and resources take each field's
default, description and range from here (:func:`eagle3_assets.config_fields.config_field`),
so a default is written once.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import types
import typing
from typing import Any

DESCRIPTION = "description"
LIMITS = "limits"
_CHECKS = {"gt": lambda v, b: v > b, "ge": lambda v, b: v >= b, "lt": lambda v, b: v < b, "le": lambda v, b: v <= b}
_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
# type -> (whether a JSON value is one, what the error says is expected); bool is no int here, an int is a float.
_SCALARS = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def setting(default: Any, description: str, *, repr: bool = True, **limits: float) -> Any:
    """A field with a default, a description and optional limits (``gt``, ``ge``, ``lt``, ``le``, pydantic's names).

    ``repr=False`` keeps a secret out of the dataclass's repr.
    """
    unknown = set(limits) - set(_CHECKS)
    if unknown:
        raise TypeError(f"setting limits {sorted(unknown)}: one of {sorted(_CHECKS)}")
    metadata = {DESCRIPTION: description, LIMITS: limits}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), repr=repr, metadata=metadata)
    return dataclasses.field(default=default, repr=repr, metadata=metadata)


def given(description: str) -> Any:
    """A field without a default: what the orchestrator fills in (paths, the target, the shard)."""
    return dataclasses.field(metadata={DESCRIPTION: description, LIMITS: {}})


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


class JobSchema:
    """Base of the typed settings dataclasses: to and from plain JSON data, checked field by field."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: Any, where: str | None = None):
        """An instance from plain data; a clear error naming the key for anything unknown, missing or mistyped."""
        where = where or cls.__name__
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected an object of settings, got {type(raw).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown setting(s) {unknown}; known: {sorted(known)}")
        missing = sorted(name for name, f in known.items() if name not in raw and default_of(f) is dataclasses.MISSING)
        if missing:
            raise ValueError(f"{where}: missing setting(s) {missing}")
        hints = typing.get_type_hints(cls)
        values = {}
        for name, value in raw.items():
            values[name] = _typed(value, hints[name], f"{where}.{name}")
            _check_limits(values[name], known[name].metadata.get(LIMITS) or {}, f"{where}.{name}")
        return cls(**values)


def _check_limits(value: Any, limits: dict, key: str) -> None:
    if value is None:
        return
    for op, bound in limits.items():
        if not _CHECKS[op](value, bound):
            raise ValueError(f"setting {key} is {value!r}, must be {_WORDS[op]} {bound}")


def _typed(value: Any, hint: Any, key: str) -> Any:
    """``value`` as the type ``hint`` names (lists to tuples, ints to floats), or an error naming ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _typed(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else f"setting {key} is {value!r}, expected {_name(hint)}")
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and issubclass(hint, JobSchema):
        return hint.from_dict(value, where=key)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"setting {key} is {value!r}, expected a list ({_name(hint)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(f"setting {key} is {value!r}, expected {len(args)} values ({_name(hint)})")
            return tuple(_typed(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_typed(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or hint) is tuple else items
    if origin in (dict, collections.abc.Mapping) or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"setting {key} is {value!r}, expected an object ({_name(hint)})")
        return dict(value)
    if hint in _SCALARS:
        accepts, expected = _SCALARS[hint]
        if not accepts(value):
            raise ValueError(f"setting {key} is {value!r}, expected {expected}")
        return float(value) if hint is float else value
    raise TypeError(f"setting {key}: no rule for type {hint!r}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint)) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")
