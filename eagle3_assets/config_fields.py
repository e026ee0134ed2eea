"""Dagster config fields picked one by one from a settings model (:mod:`eagle3_assets.core.settings.job_schema`).

Only for a ``Config`` class that shows a *subset* of a model's settings
(``draft_checkpoint``'s, today: ``TrainConfig`` holds settings a launchpad has
no use for, and a tuple Dagster cannot show). A stage whose settings are all
user-facing has its Config class be the model itself
(``class HiddenStatesConfig(ExtractionRecipe, Config)``), with no field listed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from eagle3_assets.core.settings.job_schema import values_of


def config_field(settings: type[BaseModel], name: str) -> Any:
    """The pydantic field of the setting ``name`` of ``settings``: its default, description and limits, as written there."""
    if name not in settings.model_fields:
        raise KeyError(f"{settings.__name__} has no setting {name!r}; its settings: {sorted(settings.model_fields)}")
    field = settings.model_fields[name]
    if field.is_required():
        raise ValueError(f"{settings.__name__}.{name} has no default: the asset fills it in, it is not a config field")
    return field


def settings_of(config: Any, settings: type[BaseModel]) -> dict[str, Any]:
    """The values of ``config``'s fields that are settings (fields with a default) of ``settings``, by name."""
    names = {name for name, field in settings.model_fields.items() if not field.is_required()}
    return {name: value for name, value in values_of(config, settings).items() if name in names and name in type(config).model_fields}
