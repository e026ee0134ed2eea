"""Watching a deployed draft: windowed acceptance from vLLM's counters, which draft runs, when to alert.

Every server that speculates exports cumulative counters on ``/metrics``
(drafts, draft tokens, accepted tokens, accepted tokens per position). A
*window* is the difference between two scrapes. Three things make that less
simple than a subtraction:

- **restarts**: the counters start again from zero. A restart is seen as a new
  ``process_start_time_seconds``, a new draft alias, or any counter going
  down; the window is then what the new process counted since it started (all
  of it falls between the two scrapes), never a negative difference and never
  the old process's totals added again;
- **quiet servers**: a window with fewer than ``min_drafts`` drafts is recorded
  as too small and not judged; its counts are not thrown away but carried into
  the next window (the baseline stays where it was), so a quiet server is
  still measured, over a longer window;
- **which draft**: vLLM's production API does not say, so servers are started
  with an ``eagle3-draft-<hash12>`` alias (:mod:`eagle3_assets.core.serving.deployment`)
  that ``/v1/models`` lists.

Alerts are transitions, as in ``vllm_server_health``: a drop is alerted when
``windows_below`` judged windows in a row fall below the offline figure minus a
tolerance, once, and again only after a window back above it; a stale draft
once per (server, draft); a server that stops answering once, and once more
when it answers again. An alert the channel does not take is retried next tick.
Dagster-free: the sensor ``deployed_draft_watch`` only feeds it and records.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field, replace

from eagle3_assets.core.serving.alerts import Alert
from eagle3_assets.core.serving.deployment import served_draft_hashes
from eagle3_assets.core.serving.vllm_metrics import SpecDecodeCounters, parse_prometheus

START_TIME = "process_start_time_seconds"


def display_url(url: str) -> str:
    """The URL without user/password: what alerts, logs, metadata and the cursor may show."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))


@dataclass(frozen=True)
class Scrape:
    """What one server said at one moment; ``error`` when it did not answer."""

    url: str  # display form, no credentials
    at: float
    counters: SpecDecodeCounters | None = None  # None: /metrics has no spec-decode counters (not speculating)
    start_time: float | None = None
    model_ids: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def served_hash(self) -> str | None:
        hashes = served_draft_hashes(self.model_ids)
        return hashes[0] if hashes else None


def _get(url: str, api_key: str | None, timeout_s: float) -> bytes:
    parts = urllib.parse.urlsplit(url)
    headers = {}
    if parts.username:  # credentials in the URL: send them as basic auth, never show them
        token = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(token.encode()).decode()
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    clean = urllib.parse.urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, parts.query, ""))
    with urllib.request.urlopen(urllib.request.Request(clean, headers=headers), timeout=timeout_s) as response:
        return response.read()


def scrape(url: str, at: float, api_key: str | None = None, timeout_s: float = 10.0) -> Scrape:
    """Read ``/metrics`` and ``/v1/models`` of one server. Never raises: an unanswered server is a Scrape with an error."""
    base = url.rstrip("/")
    shown = display_url(url)
    try:
        text = _get(f"{base}/metrics", api_key, timeout_s).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return Scrape(shown, at, error=f"/metrics answered HTTP {exc.code}")
    except (urllib.error.URLError, OSError) as exc:
        return Scrape(shown, at, error=f"/metrics unreachable: {getattr(exc, 'reason', exc)}")
    try:
        models = json.loads(_get(f"{base}/v1/models", api_key, timeout_s))
        model_ids = [str(m.get("id")) for m in models.get("data", [])]
    except urllib.error.HTTPError as exc:
        return Scrape(shown, at, error=f"/v1/models answered HTTP {exc.code}")
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as exc:
        return Scrape(shown, at, error=f"/v1/models unreadable: {getattr(exc, 'reason', exc)}")
    return scrape_from_text(shown, at, text, model_ids)


def scrape_from_text(url: str, at: float, metrics_text: str, model_ids: list[str]) -> Scrape:
    """A Scrape from a ``/metrics`` page and the ids ``/v1/models`` listed."""
    totals = parse_prometheus(metrics_text)
    counters = SpecDecodeCounters.from_metrics(metrics_text) if any(k.startswith("vllm:spec_decode_") for k in totals) else None
    return Scrape(display_url(url), at, counters, totals.get(START_TIME), list(model_ids))


@dataclass(frozen=True)
class Window:
    """The counts between the baseline and a scrape, and what they say."""

    status: str  # "ok", "too few drafts", "first scrape", "not speculating", "no answer"
    start: float | None = None
    end: float | None = None
    restarted: bool = False
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    rates_per_position: list[float] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.rates_per_position)

    @property
    def acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.status == "ok" and self.drafts else None


@dataclass(frozen=True)
class ServerMemory:
    """What the cursor keeps per server between ticks."""

    base: dict | None = None  # SpecDecodeCounters as a dict: the start of the current window
    base_at: float | None = None
    start_time: float | None = None
    served_hash: str | None = None
    low_streak: int = 0
    drop_alerted: bool = False
    stale_alerted_for: str | None = None
    down: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict | None) -> ServerMemory:
        return cls(**data) if data else cls()


def _went_down(now: SpecDecodeCounters, before: SpecDecodeCounters) -> bool:
    pairs = [(now.drafts, before.drafts), (now.draft_tokens, before.draft_tokens), (now.accepted, before.accepted)]
    pairs += list(zip(now.accepted_per_position, before.accepted_per_position))
    return any(a < b for a, b in pairs) or len(now.accepted_per_position) != len(before.accepted_per_position)


def next_window(memory: ServerMemory, scrape: Scrape, min_drafts: int) -> tuple[Window, ServerMemory]:
    """The window this scrape closes, and the memory for the next one (counts of a too-small window carry over)."""
    if scrape.error is not None:
        return Window("no answer", end=scrape.at), memory  # the baseline waits for the server to come back
    if scrape.counters is None:
        return Window("not speculating", end=scrape.at), replace(memory, base=None, base_at=None, start_time=scrape.start_time, served_hash=scrape.served_hash)
    now = scrape.counters
    if memory.base is None:
        return Window("first scrape", end=scrape.at), replace(
            memory, base=asdict(now), base_at=scrape.at, start_time=scrape.start_time, served_hash=scrape.served_hash
        )
    before = SpecDecodeCounters(**memory.base)
    restarted = (
        (scrape.start_time is not None and memory.start_time is not None and scrape.start_time != memory.start_time)
        or scrape.served_hash != memory.served_hash
        or _went_down(now, before)
    )
    if restarted:
        # Everything the new process counted happened after it started, so within this window.
        before = SpecDecodeCounters(0.0, 0.0, 0.0, [0.0] * len(now.accepted_per_position))
    delta = now.minus(before)
    start = max(memory.base_at or scrape.at, scrape.start_time or 0.0) if restarted else memory.base_at
    rates = [a / delta.drafts if delta.drafts else 0.0 for a in delta.accepted_per_position]
    counts = dict(drafts=delta.drafts, draft_tokens=delta.draft_tokens, accepted=delta.accepted, rates_per_position=rates)
    if delta.drafts < min_drafts:
        carried = replace(memory, base=asdict(before), base_at=start, start_time=scrape.start_time, served_hash=scrape.served_hash)
        return Window("too few drafts", start, scrape.at, restarted, **counts), carried
    advanced = replace(memory, base=asdict(now), base_at=scrape.at, start_time=scrape.start_time, served_hash=scrape.served_hash)
    return Window("ok", start, scrape.at, restarted, **counts), advanced


@dataclass(frozen=True)
class Expectation:
    """What the deployed draft should do: the latest draft and its offline figures."""

    latest_hash: str | None  # the latest materialised draft_checkpoint's weight hash
    acceptance_by_k: dict[int, float]  # draft_evaluation's curve
    evaluated_hash: str | None  # the draft that curve was measured on
    tolerance: float
    windows_below: int

    def threshold(self, k: int) -> tuple[float, float] | None:
        """(offline figure, threshold) at k, or None when draft_evaluation has no figure at k."""
        offline = self.acceptance_by_k.get(k)
        return None if offline is None else (offline, offline - self.tolerance)


@dataclass(frozen=True)
class Verdict:
    window: Window
    memory: ServerMemory  # as it should be saved once every alert below is delivered
    alerts: list[tuple[str, Alert]]  # (kind, alert): kind in "drop", "stale", "down", "recovered"
    notes: dict


def judge(scrape: Scrape, memory: ServerMemory, expectation: Expectation, min_drafts: int) -> Verdict:
    """One server, one tick: the window, the memory after it, and the alerts it calls for."""
    window, memory = next_window(memory, scrape, min_drafts)
    server = scrape.url
    alerts: list[tuple[str, Alert]] = []
    notes: dict = {"server": server, "window_status": window.status}

    if window.status == "no answer":
        if not memory.down:
            alerts.append(("down", Alert(
                f"Deployed draft: server not answering: {server}",
                [f"figure: {scrape.error}", "threshold: an answer from /metrics and /v1/models", f"server: {server}"],
            )))  # fmt: skip
        return Verdict(window, replace(memory, down=True), alerts, notes)
    if memory.down:
        alerts.append(("recovered", Alert(f"Deployed draft: server answers again: {server}", [f"server: {server}"])))
        memory = replace(memory, down=False)

    served = scrape.served_hash
    notes.update(served_draft_hash=served or "unknown", latest_draft_hash=expectation.latest_hash or "unknown")
    if served and expectation.latest_hash and served != expectation.latest_hash:
        if memory.stale_alerted_for != served:
            alerts.append(("stale", Alert(
                f"Deployed draft: {server} serves draft {served}, not the latest {expectation.latest_hash}",
                [
                    f"figure: served draft {served} (alias eagle3-draft-{served} in /v1/models)",
                    f"threshold: the latest materialised draft_checkpoint, draft {expectation.latest_hash}",
                    f"server: {server}",
                ],
            )))  # fmt: skip
            memory = replace(memory, stale_alerted_for=served)
    elif served and served == expectation.latest_hash:
        memory = replace(memory, stale_alerted_for=None)

    if window.status != "ok":
        return Verdict(window, memory, alerts, notes)
    figures = expectation.threshold(window.k)
    if figures is None:
        notes["judged"] = f"no offline figure at k={window.k} in draft_evaluation"
        return Verdict(window, memory, alerts, notes)
    offline, threshold = figures
    notes.update(offline_acceptance_length=offline, threshold=threshold)
    if window.acceptance_length >= threshold:
        return Verdict(window, replace(memory, low_streak=0, drop_alerted=False), alerts, notes)
    memory = replace(memory, low_streak=memory.low_streak + 1)
    if memory.low_streak >= expectation.windows_below and not memory.drop_alerted:
        evaluated = f"draft {expectation.evaluated_hash}" if expectation.evaluated_hash else "the evaluated draft"
        alerts.append(("drop", Alert(
            f"Deployed draft: acceptance below threshold on {server}",
            [
                f"figure: windowed acceptance length {window.acceptance_length:.2f} at k={window.k} "
                f"({window.drafts:.0f} drafts), below for {memory.low_streak} windows in a row",
                f"threshold: {threshold:.2f} = offline {offline:.2f} (draft_evaluation, {evaluated}, k={window.k}) "
                f"- tolerance {expectation.tolerance:.2f}",
                f"server: {server} (serves draft {served or 'unknown'})",
                "if the traffic moved, retrain on new prompt shards",
            ],
        )))  # fmt: skip
        memory = replace(memory, drop_alerted=True)
    return Verdict(window, memory, alerts, notes)


def undelivered(memory_before: ServerMemory, verdict: Verdict, failed_kinds: set[str]) -> ServerMemory:
    """The memory to keep when some alerts were not delivered: those transitions must be seen again next tick."""
    memory = verdict.memory
    if "down" in failed_kinds:
        memory = replace(memory, down=memory_before.down)
    if "recovered" in failed_kinds:
        memory = replace(memory, down=True)
    if "stale" in failed_kinds:
        memory = replace(memory, stale_alerted_for=memory_before.stale_alerted_for)
    if "drop" in failed_kinds:
        memory = replace(memory, drop_alerted=False)
    return memory
