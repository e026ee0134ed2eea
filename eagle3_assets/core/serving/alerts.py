"""Alerts as Slack-compatible webhook posts, and the parsing of vLLM's health endpoints.

Dagster-free so the formatting and delivery are testable on their own; the
sensors in ``sensors/`` decide *when* to alert.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from eagle3_assets.core.generation.redaction import redact_url
from eagle3_assets.core.serving.vllm_metrics import parse_prometheus


class AlertDeliveryError(RuntimeError):
    """The webhook did not take the alert; the caller keeps it and retries on the next tick."""


@dataclass(frozen=True)
class Alert:
    title: str
    lines: list[str] = field(default_factory=list)
    link: str | None = None

    def slack_payload(self) -> dict:
        text = "\n".join([f"*{self.title}*", *self.lines] + ([f"<{self.link}|Open in Dagster>"] if self.link else []))
        return {"text": text}


def post_webhook(url: str, alert: Alert, timeout_s: float = 10.0) -> None:
    """POST the alert as Slack-compatible JSON; raise :class:`AlertDeliveryError` on any failure.

    The URL itself is a secret (Slack webhook URLs carry their token), so it
    never appears in the error message.
    """
    request = urllib.request.Request(
        url, data=json.dumps(alert.slack_payload()).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if not 200 <= response.status < 300:
                raise AlertDeliveryError(f"alert webhook answered HTTP {response.status}")
    except urllib.error.HTTPError as exc:
        raise AlertDeliveryError(f"alert webhook answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AlertDeliveryError(f"alert webhook unreachable ({type(reason).__name__})") from None


def figures_of(metadata: dict) -> list[str]:
    """The numeric metadata of a check evaluation, e.g. ``share_with_reasoning=0.41``, ``threshold=0.98``."""
    figures = []
    for key, value in metadata.items():
        raw = getattr(value, "value", value)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            continue
        figures.append(f"{key}={raw:.4g}" if isinstance(raw, float) else f"{key}={raw}")
    return figures


@dataclass(frozen=True)
class ServerHealth:
    url: str
    up: bool
    running: float | None = None
    waiting: float | None = None
    error: str | None = None


def probe_server(url: str, timeout_s: float = 5.0) -> ServerHealth:
    """``/health`` decides up or down; ``/metrics`` adds running and waiting requests when it answers.

    Credentials in ``url`` are sent as basic auth (as the generation client's
    aiohttp does); the result names the server without them.
    """
    shown = redact_url(url)
    base = shown.rstrip("/")
    headers = _basic_auth(url)
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base}/health", headers=headers), timeout=timeout_s) as response:
            if response.status != 200:
                return ServerHealth(shown, False, error=f"/health answered HTTP {response.status}")
    except urllib.error.HTTPError as exc:
        return ServerHealth(shown, False, error=f"/health answered HTTP {exc.code}")
    except (urllib.error.URLError, OSError) as exc:
        return ServerHealth(shown, False, error=f"/health unreachable: {getattr(exc, 'reason', exc)}")
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers=headers), timeout=timeout_s) as response:
            metrics = parse_prometheus(response.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError):
        return ServerHealth(shown, True)
    return ServerHealth(shown, True, metrics.get("vllm:num_requests_running"), metrics.get("vllm:num_requests_waiting"))


def _basic_auth(url: str) -> dict[str, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return {}
    user_pass = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    return {"Authorization": "Basic " + base64.b64encode(user_pass.encode()).decode()}
