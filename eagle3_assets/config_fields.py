"""Dagster config fields made from the typed settings in :mod:`eagle3_assets.core` (see :mod:`eagle3_assets.core.job_schema`).

A ``Config`` class or resource lists its fields by name and type, each made by
:func:`config_field` from the dataclass field that holds its default,
description and range, so that none of them is written twice;
:func:`settings_of` hands a config's values back to the dataclass by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field

from eagle3_assets.core.job_schema import DESCRIPTION, LIMITS, default_of


def _field(settings: type, name: str) -> dataclasses.Field:
    by_name = {f.name: f for f in dataclasses.fields(settings)}
    if name not in by_name:
        raise KeyError(f"{settings.__name__} has no setting {name!r}; its settings: {sorted(by_name)}")
    return by_name[name]


def config_field(settings: type, name: str, **overrides: Any) -> Any:
    """A pydantic ``Field`` with the default, description and limits of the setting ``name`` of ``settings``."""
    source = _field(settings, name)
    default = default_of(source)
    if default is dataclasses.MISSING:
        raise ValueError(f"{settings.__name__}.{name} has no default: the asset fills it in, it is not a config field")
    return Field(**{"default": default, "description": source.metadata[DESCRIPTION], **source.metadata[LIMITS], **overrides})


def settings_of(config: Any, settings: type) -> dict[str, Any]:
    """The values of ``config``'s fields that are settings (fields with a default) of ``settings``, by name."""
    names = {f.name for f in dataclasses.fields(settings) if default_of(f) is not dataclasses.MISSING}
    return {name: getattr(config, name) for name in type(config).model_fields if name in names}
