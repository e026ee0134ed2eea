"""The suite's own layout under xdist workers (docs/testing.md#workers): what one start serves stays on one worker.

A session fixture is set up once per worker process, so a server or cluster used by files on two workers is started
twice. ``SHARED_WORKER`` in tests/conftest.py keeps the files that use each such fixture together; this holds it to
the files that use them now, so that a new file asking for one of them is not scheduled beside them unnoticed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import SHARED_WORKER

TESTS = Path(__file__).resolve().parent
# Each a vLLM start (30-45 CPU-s on 2 cores, docs/testing.md#workers) or a two-node Ray cluster (about 20 s).
STARTED_ONCE = ("kimi_vllm_server", "qwen3_vllm_server", "tiny_trained_draft_server", "ray_cluster")


def files_using(fixture: str) -> set[str]:
    """The test files that name ``fixture`` (this one aside: it names them all)."""
    files = (path for path in TESTS.glob("test_*.py") if path.stem != Path(__file__).stem)
    return {path.stem for path in files if re.search(rf"\b{fixture}\b", path.read_text())}


@pytest.mark.parametrize("fixture", STARTED_ONCE)
def test_the_files_using_a_started_fixture_share_one_worker(fixture):
    users = files_using(fixture)
    assert len(users) >= 2, f"{fixture}: used by {sorted(users)} only; drop it from STARTED_ONCE if it needs no grouping"
    groups = {SHARED_WORKER.get(stem) for stem in users}
    assert len(groups) == 1 and None not in groups, f"{fixture}: {sorted(users)} are scheduled as {groups}: join them in SHARED_WORKER"
