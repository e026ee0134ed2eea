"""``gpu_host_ready``: the GPU host's pre-flight on its own, before anyone commits GPU hours.

The same checks run before every GPU stage; this job runs them for every
declared GPU stage (or the ones named in the config) without starting any of
them, records each stage's report as metadata, and fails with one line per
problem. A stage that starts the target (extraction's vLLM engine,
``loads_in_vllm``, evaluation) is checked for what the target's serving profile
needs, as its own run is: TP x PP x DP GPUs, each with its share of the
weights and a KV cache free, so a host whose generation server still holds
the cards is refused here, with the processes and the unit to stop, before
any backfill is queued. When every pre-flight passes it also runs the ``host_probe`` stage
end to end (SSH, the stage runner, the lock, Dagster Pipes), so a green run
means a stage can really be started on the host.
"""

from dagster import Config, Failure, MetadataValue, Nothing, OpExecutionContext, Out, Output, job, op
from pydantic import Field

from eagle3_assets.core.gpu_host.stage_requirements import with_serving_need
from resources.gpu_host import STAGE_REQUIREMENTS, GPUHost, preflight_summary
from resources.target_model import TargetModel

PROBE_STAGE = "host_probe"


class GPUHostReadyConfig(Config):
    stages: list[str] = Field(default_factory=list, description="GPU stages to check; empty: every stage declared in STAGE_REQUIREMENTS")
    run_probe: bool = Field(default=True, description="when every pre-flight passes, also run the host_probe stage end to end")
    probe_modules: list[str] = Field(default_factory=lambda: ["torch"], description="modules host_probe reports the versions of")


@op(
    out=Out(Nothing),
    description="Runs the GPU host's pre-flight for each GPU stage (and the host_probe stage); fails listing every problem.",
)
def gpu_host_preflight(context: OpExecutionContext, config: GPUHostReadyConfig, gpu_host: GPUHost, target_model: TargetModel):
    stages = config.stages or sorted(STAGE_REQUIREMENTS)
    failures: list[str] = []
    metadata: dict = {"host": gpu_host.connection().label, "stages": MetadataValue.json(stages)}
    for stage in stages:
        requirements = gpu_host.requirements_for(stage)
        if requirements.serves_target:
            requirements = with_serving_need(requirements, target_model.gpu_need(requirements.serving_context))
        report = gpu_host.preflight(stage, requirements)
        metadata[f"preflight/{stage}"] = MetadataValue.json(report)
        if report["ok"]:
            context.log.info(f"{stage}: ready ({preflight_summary(report)})")
        for failure in report["failures"]:
            context.log.error(f"{stage}: {failure}")
            failures.append(f"{stage}: {failure}")
    metadata["failures"] = MetadataValue.json(failures)
    if failures:
        lines = "\n".join(f"- {f}" for f in failures)
        raise Failure(description=f"GPU host {gpu_host.connection().label} is not ready:\n{lines}", metadata=metadata, allow_retries=False)
    if config.run_probe:
        invocation = gpu_host.run_stage(context, PROBE_STAGE, {"modules": list(config.probe_modules)})
        reports = invocation.get_custom_messages()
        if not reports:
            raise Failure(description=f"{PROBE_STAGE} ran on {gpu_host.connection().label} but reported nothing", metadata=metadata)
        metadata[PROBE_STAGE] = MetadataValue.json(reports[-1])
    return Output(None, metadata=metadata)


@job(name="gpu_host_ready", description="The GPU host's pre-flight for every GPU stage, on its own, plus an end-to-end host_probe stage.")
def gpu_host_ready_job():
    gpu_host_preflight()
