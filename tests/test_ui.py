"""The UI in a real browser: ``dagster dev`` over the tiny stack, driven by headless Chromium.

``dagster dev -w workspace.yaml`` (webserver and daemon) runs over a temporary
``DAGSTER_HOME``, its code location pointed at the session's real vLLM server
through the environment the resources read (``EAGLE3_VLLM_URLS``,
``EAGLE3_SERVED_MODEL``). Debian's Chromium, driven by Playwright, does what a
user does: filter the asset graph to the generation and validation groups,
open **Materialize**, pick a shard in the partition picker, give the server's
settings in the dialog's config editor, launch, follow the run to success,
read the checks on the asset page; then launch a backfill of three shards from
the same dialog. What the instance records on that home is the ground truth.

Screenshots go to ``$EAGLE3_TEST_ARTIFACTS/ui`` (default ``test-artifacts/ui``,
git-ignored); a failing step saves one and puts it, with the tail of the
``dagster dev`` log, in the assertion message.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from dagster import AssetCheckKey, AssetKey, DagsterRunStatus
from dagster._core.execution.backfill import BulkActionStatus
from playwright.sync_api import expect, sync_playwright

from eagle3_assets.demo import plugin as demo
from tests.dagster_dev import REPO, DagsterDev

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]

CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it); no browser is ever downloaded
# Headless, and nothing that phones home: without the background-networking flags Chromium
# keeps retrying Google services, which on a closed network is a flood of failing requests.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip

SHARD_SIZE = 64  # the demo's: 320 prompts, 5 shards
SHARD = "shard-00000"
BACKFILL_SHARDS = ["shard-00001", "shard-00002", "shard-00003"]
UI_ASSETS = ["prompts", "raw_responses", "validated_traces"]
SELECTION = "group:generation or group:validation"  # exactly UI_ASSETS
ALL_ASSETS = [*UI_ASSETS, "hidden_states", "vocab_mapping", "draft_checkpoint", "draft_evaluation"]
VALIDATION_CHECKS = [  # the blocking gates first
    "traces_present", "reasoning_present", "responses_accounted", "loss_mask_aligned", "request_errors_rare",
    "truncation_rate_low", "think_markers_absent", "prompts_fit_context",
]  # fmt: skip
BLOCKING_VALIDATION_CHECKS = 5
GROUPS = ["generation", "validation", "extraction", "training", "evaluation"]

RUN_TIMEOUT_S = 900  # one shard: a run worker loads the code, generates 64 answers on a CPU, validates
BACKFILL_TIMEOUT_S = 1800  # three shards, one generating at a time (the vllm_generation pool)
UI_TIMEOUT_MS = 60_000  # a loaded 2-core machine renders slowly

ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS") or REPO / "test-artifacts") / "ui"


@pytest.fixture(scope="module")
def stack(vllm_server, tmp_path_factory):
    """``dagster dev`` with the generation pool limited (as ``make dev``) and the demo's shards registered."""
    from eagle3_assets.glue.partitions import register_shards
    from eagle3_assets.demo.plugin import DemoPromptDataset
    from resources.vllm_server import ensure_generation_pool_limit

    root = tmp_path_factory.mktemp("ui")
    data = root / "data"
    env = {
        "EAGLE3_DATA_DIR": str(data),
        "EAGLE3_PROMPTS": "demo",
        "EAGLE3_SHARD_SIZE": str(SHARD_SIZE),
        "EAGLE3_TARGET_MODEL": "demo",
        "EAGLE3_VLLM_URLS": vllm_server.base_url,
        "EAGLE3_SERVED_MODEL": vllm_server.served_model_name,
    }
    with DagsterDev(root / "dagster_home", env, root / "dagster-dev.log") as dev:
        instance = dev.instance()
        ensure_generation_pool_limit(instance, 1)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("EAGLE3_DATA_DIR", str(data))  # where the demo prompt set is written
            keys = DemoPromptDataset(shard_size=SHARD_SIZE).shard_keys()
        register_shards(instance, keys)
        # A fresh instance greets the first visitor with a "Join the Dagster community" dialog that
        # can pop up mid-typing; record it as seen (what its Skip button does) before the browser comes.
        assert dev.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True
        dev.vllm_server = vllm_server
        yield dev


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if shutil.which(CHROMIUM) is None:  # a clear failure, never a skip: .ci/run installs it
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install chromium` (see .ci/run)")
    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh user data dir
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, viewport={"width": 1500, "height": 900}
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser, stack):
    page = browser.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    expect.set_options(timeout=UI_TIMEOUT_MS)
    # Should the community dialog show up all the same, skip it as a user would.
    page.add_locator_handler(
        page.get_by_text("Join the Dagster community"), lambda: page.get_by_role("button", name="Skip", exact=True).click()
    )
    yield page
    page.close()


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


@contextmanager
def evidence(page, dev: DagsterDev, step: str):
    """On failure: a screenshot and the ``dagster dev`` log tail in the assertion message."""
    try:
        yield
    except Exception as exc:
        try:
            path = shot(page, f"FAILED-{step}")
        except Exception as shot_error:  # the browser itself may be the problem
            path = f"(no screenshot: {shot_error})"
        raise AssertionError(f"UI step {step!r} failed: {exc}\nscreenshot: {path}\n--- dagster dev log (tail) ---\n{dev.log_tail(80)}") from exc


# ----------------------------------------------------------------- what a user does


def select_ui_assets(page, dev: DagsterDev) -> None:
    """Lineage page, then type the selection into the graph's filter box."""
    page.goto(dev.url + "/asset-groups")
    expect(page.get_by_text("Global asset lineage")).to_be_visible()
    # The filter is a CodeMirror editor; its textarea is the labelled element, the editor takes the click.
    page.locator(".CodeMirror", has=page.get_by_label("Search and filter assets")).click()
    page.keyboard.type(SELECTION)
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"group%3Ageneration%20or%20group%3Avalidation"))


def open_materialize_dialog(page, shards: list[str]):
    """**Materialize** on the selection, the shards ticked in the partition picker, the server's settings as config."""
    page.get_by_role("button", name="Materialize").first.click()
    dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize")
    expect(dialog.get_by_text(f"Launch runs to materialize {len(UI_ASSETS)} assets")).to_be_visible()
    dialog.get_by_text("Select a partition or create one").click()
    for shard in shards:
        page.get_by_role("menuitem").filter(has_text=shard).click()  # its name repeats the key (truncation helper)
    dialog.get_by_text("Launch runs to materialize").click()  # closes the picker's menu
    expect(dialog.get_by_text(f"{len(shards)} partition{'s' if len(shards) > 1 else ''}", exact=True)).to_be_visible()

    # Run config for a resource replaces the values the code location gave it (Dagster has no
    # partial resource config): the servers and model still come from the environment
    # (EAGLE3_VLLM_URLS above), so the dialog names only the demo's sampling.
    config = (
        f"resources: {{vllm_server: {{config: {{max_tokens: {demo.MAX_TOKENS}, "
        f"temperature: {demo.TEMPERATURE}, concurrency: 64}}}}}}"
    )
    dialog.get_by_text("Config", exact=True).click()
    dialog.get_by_role("button", name="Add config").click()
    editor = page.get_by_role("dialog").filter(has_text="Config Editor")
    editor.locator(".CodeMirror").first.click()
    page.keyboard.insert_text(config)  # as pasted: no auto-indent or bracket closing on the way
    expect(editor.get_by_text("No errors")).to_be_visible()
    editor.get_by_role("button", name="Save config").click()
    expect(editor).to_be_hidden()
    return dialog


def wait_for_run(dev: DagsterDev, run_id: str, timeout_s: float):
    instance = dev.instance()
    deadline = time.monotonic() + timeout_s
    while True:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.is_finished:
            return run
        status = run.status if run else "not recorded"
        assert time.monotonic() < deadline, f"run {run_id} not finished after {timeout_s}s: {status}\n{dev.log_tail(80)}"
        time.sleep(1)  # a read of the instance: a second's poll costs nothing, a longer one is waited after the run ends


def latest_check_passed(instance, asset: str, check: str) -> bool:
    key = AssetCheckKey(AssetKey(asset), check)
    record = instance.event_log_storage.get_latest_asset_check_execution_by_key([key])[key]
    return record.event.dagster_event.event_specific_data.passed


# ----------------------------------------------------------------- the tests


def test_materialise_one_shard_from_the_asset_graph_and_read_its_checks(stack, page):
    instance = stack.instance()
    with evidence(page, stack, "select-assets"):
        select_ui_assets(page, stack)
        shot(page, "01-selection")
    with evidence(page, stack, "launch-one-shard"):
        dialog = open_materialize_dialog(page, [SHARD])
        shot(page, "02-materialize-dialog")
        dialog.get_by_role("button", name="Launch 1 run").click()
        page.get_by_role("link", name="View", exact=True).click()  # the "Launched run" toast
        expect(page).to_have_url(re.compile(r"/runs/[0-9a-f-]{36}"))
        run_id = re.search(r"/runs/([0-9a-f-]{36})", page.url).group(1)

    run = wait_for_run(stack, run_id, RUN_TIMEOUT_S)
    assert run.status == DagsterRunStatus.SUCCESS, f"run {run_id}: {run.status}\n{stack.log_tail(80)}"
    assert run.tags["dagster/partition"] == SHARD
    for asset in UI_ASSETS:
        assert instance.get_materialized_partitions(AssetKey(asset)) == {SHARD}, asset

    with evidence(page, stack, "run-page"):
        expect(page.get_by_text("Success", exact=True).first).to_be_visible()
        expect(page.get_by_text(f"partition: {SHARD}")).to_be_visible()
        shot(page, "03-run-succeeded")

    with evidence(page, stack, "asset-checks"):
        page.goto(stack.url + "/assets/validated_traces")
        page.get_by_role("tab", name="Checks").click()
        expect(page.get_by_text(f"Checks ({len(VALIDATION_CHECKS)})")).to_be_visible()
        for check in VALIDATION_CHECKS:
            # Each check's row: its name and the latest result, as the instance recorded it.
            want = "Succeeded" if latest_check_passed(instance, "validated_traces", check) else "Failed"
            expect(page.locator(f'span:has(> div[title="{check}"])')).to_contain_text(want)
        expect(page.get_by_text("This is a blocking asset check.")).to_be_visible()
        shot(page, "04-validated-traces-checks")
    for check in VALIDATION_CHECKS[:BLOCKING_VALIDATION_CHECKS]:  # a run that succeeded passed them all
        assert latest_check_passed(instance, "validated_traces", check), check


def test_backfill_three_shards_from_the_partitions_dialog(stack, page):
    instance = stack.instance()
    before = {b.backfill_id for b in instance.get_backfills()}
    with evidence(page, stack, "launch-backfill"):
        select_ui_assets(page, stack)
        dialog = open_materialize_dialog(page, BACKFILL_SHARDS)
        shot(page, "05-backfill-dialog")
        dialog.get_by_role("button", name="Launch backfill").click()
        expect(dialog).to_be_hidden()
        page.get_by_role("link", name="View", exact=True).click()  # the "Created backfill" toast
        expect(page).to_have_url(re.compile(r"/runs/b/\w+"))
        backfill_id = re.search(r"/runs/b/(\w+)", page.url).group(1)
    assert backfill_id not in before

    deadline = time.monotonic() + BACKFILL_TIMEOUT_S
    while instance.get_backfill(backfill_id).status in (BulkActionStatus.REQUESTED, BulkActionStatus.CANCELING, BulkActionStatus.FAILING):
        assert time.monotonic() < deadline, f"backfill {backfill_id} not done after {BACKFILL_TIMEOUT_S}s\n{stack.log_tail(80)}"
        time.sleep(1)
    backfill = instance.get_backfill(backfill_id)
    assert backfill.status == BulkActionStatus.COMPLETED_SUCCESS, f"{backfill.status}\n{stack.log_tail(80)}"

    from eagle3_assets.definitions import defs

    target = backfill.get_asset_backfill_data(defs.resolve_asset_graph()).target_subset
    assert {k.to_user_string(): set(s.get_partition_keys()) for k, s in target.partitions_subsets_by_asset_key.items()} == {
        asset: set(BACKFILL_SHARDS) for asset in UI_ASSETS
    }
    for asset in UI_ASSETS:
        assert set(BACKFILL_SHARDS) <= instance.get_materialized_partitions(AssetKey(asset)), asset

    with evidence(page, stack, "backfill-page"):
        page.reload()
        for shard in BACKFILL_SHARDS:
            expect(page.get_by_text(shard, exact=True).first).to_be_visible()  # the partition selection
        expect(page.get_by_text("100% completed")).to_have_count(len(UI_ASSETS))
        shot(page, "06-backfill-completed")

    with evidence(page, stack, "asset-graph"):
        # The whole graph, every group unfolded: the screenshot in docs/ui.md (docs/ui-asset-graph.png).
        expanded = "%2C".join(f"global%40global%3A{group}" for group in GROUPS)
        page.goto(f"{stack.url}/asset-groups?expanded={expanded}")
        for asset in ALL_ASSETS:
            expect(page.get_by_text(asset, exact=True).first).to_be_visible()
        for _ in range(2):  # fold the navigation, then the group tree: the graph gets the width
            page.locator('[aria-label="panel_show_right"]').first.click()
        page.wait_for_timeout(2000)  # the layout animates
        print(f"\nUI screenshots: {shot(page, '07-asset-graph').parent}")

