"""A hidden_states run made on the Ray cluster host, as the user sees it in the UI (issue #43).

``dagster dev`` (tests/dagster_dev.py) over a temporary ``DAGSTER_HOME``, its
code location given the session's local Ray cluster (tests/ray_cluster.py)
through the environment a deployment sets: ``EAGLE3_GPU_HOST=ray``,
``EAGLE3_RAY_ADDRESS`` and ``EAGLE3_RAY_RUNTIME_ENV``. Two shards of validated
traces of the tiny target are written first, so the run spreads them over both
nodes (one engine each). The run is launched through the webserver's GraphQL,
as the UI's **Materialize** does (tests/test_ui.py drives that dialog already);
what this test is for is what the run then shows: in headless Chromium, the
engines' log lines on the run page, and the pre-flight's node table and Ray
job id on the asset page. The pages are read against the cluster itself (the
nodes its dashboard lists, Ray's status of the job id shown), not against what
the product recorded, so a product that records nothing fails in the browser.

Screenshots go to ``$EAGLE3_TEST_ARTIFACTS/ui`` (named ``ray-*``), as test_ui's.
"""

from __future__ import annotations

import re
import time

import pytest
from dagster import AssetKey, DagsterRunStatus
from playwright.sync_api import expect

from eagle3_assets.glue.partitions import register_shards
from tests.dagster_dev import DagsterDev
from tests.test_extraction_runs import range_tags, shard_keys, write_shards
from tests.test_ray_cluster import ray_host
from tests.test_ui import UI_TIMEOUT_MS, browser, evidence, shot, wait_for_run  # noqa: F401 - browser: the fixture

RUN_TIMEOUT_S = 300  # a run worker loads the code, the pre-flight job, two engines load the tiny target on one CPU each

_LAUNCH = """mutation ($params: ExecutionParams!) { launchRun(executionParams: $params) { __typename
  ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } ... on RunConfigValidationInvalid { errors { message } } } }"""


def launch_hidden_states(dev: DagsterDev, keys: list[str]) -> str:
    """What **Materialize** on hidden_states with a range of shards submits: the asset job, the range's tags."""
    (location,) = dev.graphql("{ workspaceOrError { ... on Workspace { locationEntries { name } } } }")["workspaceOrError"]["locationEntries"]
    params = {
        "selector": {
            "repositoryLocationName": location["name"], "repositoryName": "__repository__", "jobName": "__ASSET_JOB",
            "assetSelection": [{"path": ["hidden_states"]}],
        },
        "runConfigData": {"ops": {"hidden_states": {"config": {"cpu_threads": 1, "dtype": "float32"}}}},
        "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in range_tags(keys).items()]},
    }  # fmt: skip
    launched = dev.graphql(_LAUNCH, {"params": params})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return launched["run"]["runId"]


def metadata_value(page, key: str):
    """The value cell of metadata entry ``key`` in the asset page's table (the cell beside the key's)."""
    return page.locator("td", has=page.get_by_text(key, exact=True)).last.locator("xpath=following-sibling::td[1]")


@pytest.mark.ray
def test_a_run_on_the_ray_cluster_shows_its_engines_and_nodes_in_the_ui(ray_cluster, data_dir, tiny_target, tmp_path, browser):  # noqa: F811
    """The run page shows each engine's lines (``[engine i/2 on <ip>]``) and the shards per engine; the asset page
    shows ``gpu_host/ray_nodes`` (a row per node of the cluster, each fit), ``gpu_host/ray_engines`` and a
    ``gpu_host/ray_job_id`` that Ray's dashboard knows as a job that succeeded. The pages are read against the
    cluster (its dashboard's nodes and jobs), not against what the product recorded.

    Fails on: the pre-flight's Ray report not turned into metadata (``if report.get("ray")`` in
    ``preflight_metadata`` skipped: no node table on the asset page); the engines' queued lines not drained into the
    run's log (``drain`` a no-op in ray_engines.py: no ``[engine`` line on the run page).
    """
    from ray.job_submission import JobStatus, JobSubmissionClient

    ray_cluster.ensure_worker()
    node_ids = [n["raylet"]["nodeId"] for n in ray_cluster.alive_nodes()]
    keys = shard_keys(2)  # two engines, one per node: never more engines than shards
    write_shards(data_dir, tiny_target, keys, per_shard=2)
    env = {
        "EAGLE3_DATA_DIR": str(data_dir),
        "EAGLE3_TARGET_MODEL": str(tiny_target),
        "EAGLE3_GPU_HOST": "ray",
        **{f"EAGLE3_RAY_{name.upper()}": getattr(ray_host(ray_cluster), f"ray_{name}") for name in ("address", "runtime_env")},
    }
    started = time.monotonic()
    with DagsterDev(tmp_path / "dagster_home", env, tmp_path / "dagster-dev.log") as dev:
        ready = time.monotonic()
        instance = dev.instance()
        register_shards(instance, keys)
        assert dev.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True  # no community dialog over the pages
        run_id = launch_hidden_states(dev, keys)
        page = browser.new_page()
        page.set_default_timeout(UI_TIMEOUT_MS)
        expect.set_options(timeout=UI_TIMEOUT_MS)
        try:
            run = wait_for_run(dev, run_id, RUN_TIMEOUT_S)
            assert run.status == DagsterRunStatus.SUCCESS, f"run {run_id}: {run.status}\n{dev.log_tail(80)}"
            ran = time.monotonic()

            with evidence(page, dev, "ray-run-page"):
                page.goto(f"{dev.url}/runs/{run_id}")
                expect(page.get_by_text("Success", exact=True).first).to_be_visible()
                # The log is a virtualised list: filter it to the engines' lines as a user would.
                page.get_by_placeholder("Filter…").fill("[engine")
                for index in (1, 2):
                    expect(page.get_by_text(re.compile(rf"\[engine {index}/2 on [\d.]+\] extract_hidden_states: ")).first).to_be_visible()
                shot(page, "ray-01-run-engine-lines")
                page.get_by_placeholder("Filter…").fill("shards per engine")
                expect(page.get_by_text(re.compile(r"shards per engine: \[engine 1/2 on [\d.]+\] 1, \[engine 2/2 on [\d.]+\] 1"))).to_be_visible()
                shot(page, "ray-02-run-shards-per-engine")

            with evidence(page, dev, "ray-asset-page"):
                page.goto(f"{dev.url}/assets/hidden_states?view=events&partition={keys[-1]}")
                expect(metadata_value(page, "gpu_host/ray_engines")).to_have_text("2")
                job_id = metadata_value(page, "gpu_host/ray_job_id").inner_text().strip()
                # A short Markdown value is rendered in place: the node table itself, a row per node of the cluster.
                table = metadata_value(page, "gpu_host/ray_nodes").locator("table")
                table.scroll_into_view_if_needed()
                expect(table.locator("tbody tr")).to_have_count(len(node_ids))
                for node_id in node_ids:
                    expect(table.locator("tbody tr", has_text=f"({node_id[:12]})")).to_contain_text("yes")  # fits
                shot(page, "ray-03-asset-ray-nodes")
        finally:
            page.close()
        assert JobSubmissionClient(ray_cluster.dashboard).get_job_status(job_id) == JobStatus.SUCCEEDED, job_id
        assert instance.get_materialized_partitions(AssetKey("hidden_states")) == set(keys)
    print(f"\ndagster dev ready in {ready - started:.0f}s, run {ran - ready:.0f}s, pages {time.monotonic() - ran:.0f}s (ray job {job_id})")
