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
job id on the asset page. The instance on that home is the ground truth the
pages are read against.

Screenshots go to ``$EAGLE3_TEST_ARTIFACTS/ui`` (named ``ray-*``), as test_ui's.
"""

from __future__ import annotations

import json
import re

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
    shows ``gpu_host/ray_nodes`` (both nodes, fit) and the run's ``gpu_host/ray_job_id``.

    Fails on: the pre-flight's Ray report not turned into metadata (``if report.get("ray")`` in
    ``preflight_metadata`` skipped: no node table on the asset page); the engines' queued lines not drained into the
    run's log (``drain`` a no-op in ray_engines.py: no ``[engine`` line on the run page).
    """
    ray_cluster.ensure_worker()
    keys = shard_keys(2)
    write_shards(data_dir, tiny_target, keys, per_shard=2)
    env = {
        "EAGLE3_DATA_DIR": str(data_dir),
        "EAGLE3_TARGET_MODEL": str(tiny_target),
        "EAGLE3_GPU_HOST": "ray",
        **{f"EAGLE3_RAY_{name.upper()}": getattr(ray_host(ray_cluster), f"ray_{name}") for name in ("address", "runtime_env")},
    }
    with DagsterDev(tmp_path / "dagster_home", env, tmp_path / "dagster-dev.log") as dev:
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
            assert instance.get_materialized_partitions(AssetKey("hidden_states")) == set(keys)
            # The ground truth: what the instance recorded, that the pages must show.
            record = instance.get_latest_data_version_record(AssetKey("hidden_states"), partition_key=keys[-1])
            metadata = record.asset_materialization.metadata
            node_table, job_id = metadata["gpu_host/ray_nodes"].value, metadata["gpu_host/ray_job_id"].value
            assert metadata["gpu_host/ray_engines"].value == 2
            engine_lines = [m for m in (e.user_message for e in instance.all_logs(run_id)) if m.startswith("[engine ")]
            prefixes = sorted({re.match(r"\[engine \d/2 on [^\]]+\]", m).group(0) for m in engine_lines})
            assert len(prefixes) == 2, engine_lines[-10:]

            with evidence(page, dev, "ray-run-page"):
                page.goto(f"{dev.url}/runs/{run_id}")
                expect(page.get_by_text("Success", exact=True).first).to_be_visible()
                # The log is a virtualised list: filter it to the engines' lines as a user would.
                page.get_by_placeholder("Filter…").fill("[engine")
                for prefix in prefixes:
                    expect(page.get_by_text(prefix).first).to_be_visible()
                shot(page, "ray-01-run-engine-lines")
                page.get_by_placeholder("Filter…").fill("shards per engine")
                expect(page.get_by_text(re.compile(r"shards per engine: \[engine 1/2"))).to_be_visible()
                shot(page, "ray-02-run-shards-per-engine")

            with evidence(page, dev, "ray-asset-page"):
                page.goto(f"{dev.url}/assets/hidden_states?view=events&partition={keys[-1]}")
                expect(metadata_value(page, "gpu_host/ray_job_id")).to_have_text(job_id)
                expect(metadata_value(page, "gpu_host/ray_engines")).to_have_text("2")
                # A short Markdown value is rendered in place: the node table itself.
                table = metadata_value(page, "gpu_host/ray_nodes").locator("table")
                table.scroll_into_view_if_needed()
                nodes = node_table.splitlines()[2:]
                expect(table.locator("tbody tr")).to_have_count(len(nodes))
                for line in nodes:  # each node's row as the instance has it: address and id, then whether it fits
                    cells = [c.strip() for c in line.strip("|").split("|")]
                    expect(table.locator("tbody tr", has_text=cells[0])).to_contain_text(cells[3])
                assert all("| yes |" in line for line in nodes), node_table
                shot(page, "ray-03-asset-ray-nodes")
        finally:
            page.close()
    print(f"\nengine lines: {len(engine_lines)}; ray job {job_id}; node table:\n{node_table}\n{json.dumps(prefixes)}")
