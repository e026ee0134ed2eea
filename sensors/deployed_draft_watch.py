"""``deployed_draft_watch``: the production servers' acceptance, draft and liveness, every few minutes.

Each tick scrapes every production server (``/metrics``, ``/v1/models``),
closes one window per server (:mod:`eagle3_assets.core.serving.production_watch` does
the arithmetic: restarts, quiet windows), records it as an observation of the
``deployed_draft`` asset, and alerts through the alert channel on a lasting
drop in acceptance, a stale draft, or a server that stops answering.

The cursor holds each server's counters at the start of its current window and
its alert state; servers are keyed by their URL without credentials. The
figures it is held to come from the latest materialisations: the weight hash
of ``draft_checkpoint`` (the draft that should run) and the acceptance curve
of ``draft_evaluation`` (the acceptance length at the k the server runs).
"""

from __future__ import annotations

import json

from dagster import AssetKey, AssetObservation, DefaultSensorStatus, MetadataValue, SensorEvaluationContext, SensorResult, SkipReason, sensor

from eagle3_assets.core.serving.alerts import AlertDeliveryError
from eagle3_assets.core.settings.environment import PRODUCTION_SCRAPE_S
from eagle3_assets.core.serving.production_watch import Expectation, ServerMemory, Verdict, judge, undelivered
from resources.alerts import AlertChannel
from resources.production_servers import URLS_ENV, ProductionServers



def latest_metadata(instance, asset: str) -> dict:
    event = instance.get_latest_materialization_event(AssetKey(asset))
    if event is None or event.asset_materialization is None:
        return {}
    return {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}


def expectation_from(instance, servers: ProductionServers) -> Expectation:
    checkpoint = latest_metadata(instance, "draft_checkpoint")
    evaluation = latest_metadata(instance, "draft_evaluation")
    curve = {int(p["k"]): float(p["acceptance_length"]) for p in evaluation.get("acceptance_by_k") or []}
    return Expectation(
        latest_hash=checkpoint.get("draft_weights_hash"),
        acceptance_by_k=curve,
        evaluated_hash=evaluation.get("draft_weights_hash"),
        tolerance=servers.tolerance,
        windows_below=servers.windows_below,
    )


def observation(verdict: Verdict) -> AssetObservation:
    """One server's window as an observation of ``deployed_draft``: the numbers plot over time in the UI."""
    window = verdict.window
    metadata: dict = {
        "server": verdict.notes["server"],
        "window_status": window.status,
        "restarted_in_window": window.restarted,
        "drafts": window.drafts,
        "draft_tokens": window.draft_tokens,
        "accepted_tokens": window.accepted,
        "num_speculative_tokens": window.k,
    }
    if window.start is not None and window.end is not None:
        metadata["window_s"] = round(window.end - window.start, 1)
    if window.acceptance_length is not None:
        metadata["acceptance_length"] = round(window.acceptance_length, 4)
        metadata["acceptance_rate_per_position"] = MetadataValue.json([round(r, 4) for r in window.rates_per_position])
    for key in ("served_draft_hash", "latest_draft_hash", "offline_acceptance_length", "threshold", "judged"):
        if key in verdict.notes:
            value = verdict.notes[key]
            metadata[key] = round(value, 4) if isinstance(value, float) else value
    if "served_draft_hash" in verdict.notes:
        metadata["serves_latest_draft"] = verdict.notes["served_draft_hash"] == verdict.notes["latest_draft_hash"] != "unknown"
    return AssetObservation(asset_key=AssetKey("deployed_draft"), metadata=metadata)


@sensor(
    name="deployed_draft_watch",
    minimum_interval_seconds=PRODUCTION_SCRAPE_S.get(),
    # On by default: without EAGLE3_PRODUCTION_URLS a tick is a skip and reads nothing.
    default_status=DefaultSensorStatus.RUNNING,
    description="Scrapes the production servers' /metrics: windowed acceptance, which draft runs; alerts on drops, stale drafts, silence.",
)
def deployed_draft_watch(context: SensorEvaluationContext, production_servers: ProductionServers, alert_channel: AlertChannel):
    if not production_servers.base_urls:
        return SkipReason(f"no production servers: set {URLS_ENV}")
    previous = json.loads(context.cursor) if context.cursor else {}
    expectation = expectation_from(context.instance, production_servers)
    state: dict = {}
    events, notes = [], []
    for scraped in production_servers.scrape_all():
        before = ServerMemory.from_json(previous.get(scraped.url))
        verdict = judge(scraped, before, expectation, production_servers.min_drafts_per_window)
        failed: set[str] = set()
        for kind, alert in verdict.alerts:
            if not alert_channel.configured:
                context.log.warning(f"{alert.title} (no alert destination configured)")
                continue
            try:
                alert_channel.send(alert)
            except AlertDeliveryError as exc:
                context.log.warning(f"{kind} alert for {scraped.url} not delivered, retrying next tick: {exc}")
                failed.add(kind)
        state[scraped.url] = undelivered(before, verdict, failed).to_json()
        events.append(observation(verdict))
        figure = f", acceptance {verdict.window.acceptance_length:.2f}" if verdict.window.acceptance_length is not None else ""
        notes.append(f"{scraped.url}: {verdict.window.status}{figure}" + (f" ({scraped.error})" if scraped.error else ""))
    context.log.info("; ".join(notes))
    return SensorResult(asset_events=events, cursor=json.dumps(state, sort_keys=True))
