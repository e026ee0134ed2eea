"""The GPU host: where GPU stages run, as separate processes speaking Dagster Pipes.

A stage is a module under ``eagle3_assets.stages`` run with the host's Python
(``python -m eagle3_assets.stages.<name>``). Its log lines, materialisation
metadata and check results come back into the Dagster run while it runs. This
is the local form; the SSH form and the pre-flight gate extend it (see the
``gpu-host`` issue).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from dagster import AssetExecutionContext, ConfigurableResource, PipesSubprocessClient
from dagster._core.pipes.client import PipesClientCompletedInvocation
from pydantic import Field

STAGE_PACKAGE = "eagle3_assets.stages"


class GPUHost(ConfigurableResource):
    """Runs GPU stages out of process on this machine."""

    python: str = Field(default=sys.executable, description="the Python interpreter on the host that has torch (and vllm)")
    working_dir: str = Field(default=".", description="working directory of stage processes on the host")
    allow_cpu: bool = Field(default=True, description="let stages run on CPU when the host has no GPU (demo, tests)")

    def run_stage(
        self,
        context: AssetExecutionContext,
        stage: str,
        extras: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
    ) -> PipesClientCompletedInvocation:
        """Run ``eagle3_assets.stages.<stage>`` under Pipes and return what it reported."""
        command = [self.python, "-m", f"{STAGE_PACKAGE}.{stage}"]
        stage_env = {**os.environ, **(env or {}), "EAGLE3_ALLOW_CPU": "1" if self.allow_cpu else "0"}
        return PipesSubprocessClient().run(
            context=context, command=command, extras=dict(extras), env=stage_env, cwd=self.working_dir
        )
