"""The production servers: the vLLM servers that serve the target with the deployed draft.

Not the generation server (``vllm_server``): these answer users, and the
platform only reads them (``/metrics``, ``/v1/models``). Defaults come from
the environment (:meth:`ProductionServers.from_env`):

- ``EAGLE3_PRODUCTION_URLS``: comma-separated base URLs; none set, nothing is watched;
- ``EAGLE3_PRODUCTION_API_KEY``: the servers' API key, as a Dagster ``EnvVar``
  (never shown in the launchpad, logs or metadata).

Each server should be started with the ``eagle3-draft-<hash12>`` alias that
the exported draft's ``SERVING.md`` gives, so that it says which draft it runs.
"""

from __future__ import annotations

import time
from typing import Any

from dagster import ConfigurableResource, EnvVar
from pydantic import Field

from eagle3_assets.core.settings.environment import PRODUCTION_API_KEY, PRODUCTION_URLS
from eagle3_assets.core.serving.production_watch import Scrape, scrape

URLS_ENV = PRODUCTION_URLS.name
API_KEY_ENV = PRODUCTION_API_KEY.name


def production_urls_from_env() -> list[str]:
    return PRODUCTION_URLS.get()


class ProductionServers(ConfigurableResource):
    """Where the deployed draft runs, and how strictly to judge it."""

    base_urls: list[str] = Field(default=production_urls_from_env(), description=f"base URLs of the production servers (no /v1); from ${URLS_ENV}")
    api_key: str | None = Field(default=None, description=f"bearer token; set it with EnvVar('{API_KEY_ENV}'), never as a literal")
    timeout_s: float = Field(default=10.0, gt=0, description="a server that does not answer /metrics within this is 'not answering'")
    min_drafts_per_window: int = Field(
        default=200, gt=0, description="a window with fewer drafts is recorded as too small, not judged; its counts carry into the next"
    )
    tolerance: float = Field(
        default=0.3, ge=0, description="acceptance length below draft_evaluation's figure (at the server's k) by more than this is a drop"
    )
    windows_below: int = Field(default=3, gt=0, description="judged windows in a row below the threshold before the drop alert")

    @classmethod
    def from_env(cls, **overrides: Any) -> ProductionServers:
        fields: dict[str, Any] = {"base_urls": production_urls_from_env()}
        if PRODUCTION_API_KEY.is_set():  # an EnvVar of an unset variable fails: only pass it when set
            fields["api_key"] = EnvVar(API_KEY_ENV)
        return cls(**{**fields, **overrides})

    def scrape_all(self) -> list[Scrape]:
        now = time.time()
        return [scrape(url, now, self.api_key, self.timeout_s) for url in self.base_urls]
