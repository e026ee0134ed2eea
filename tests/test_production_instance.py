"""The shipped production instance, ``deploy/dagster.yaml``, end to end against a real PostgreSQL.

A throwaway PostgreSQL cluster is created (``initdb``) and started on a free
loopback port; ``$DAGSTER_HOME/dagster.yaml`` is the shipped file, unchanged,
filled in only through the environment variables it names. ``dagster-daemon
run`` serves the project's own workspace over that instance, and a 4-shard
asset backfill (``prompts`` + ``raw_responses``) goes in through the instance,
the same ``PartitionBackfill`` the UI's "Materialize" button records: the
daemon's backfill daemon turns it into runs, the QueuedRunCoordinator launches them, and the generation runs
talk to the session's real vLLM server under the ``vllm_generation`` pool.

What it proves: the file loads with Postgres storage from env vars alone; the
backfill puts ``raw_responses`` in runs over ranges of at most
``EAGLE3_SHARDS_PER_RUN`` (2 here) shards; with the generation pool held at
zero slots those runs wait in the queue, without a process (the instance's
pools are per run), while the ``prompts`` runs go on; once the pool gets its
limit (1), never more generation runs than that run at once (sampled, and the
steps' own start/end events); the backfill finishes with every shard
materialised; and the database password shows up in no run event and no
daemon log line.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest
from dagster import AssetKey, DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter, serialize_value

# Backfills as the daemon sees them: Dagster exports no public names for these.
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.utils import make_new_backfill_id

from eagle3_assets.core.serving.vllm_launcher import read_log_tail, stop_process_group
from tests.dagster_dev import with_daemon_tick

REPO = Path(__file__).resolve().parents[1]
SHIPPED_INSTANCE_YAML = REPO / "deploy" / "dagster.yaml"

GENERATION_POOL_LIMIT = 1  # below the ranges of the 4 shards, so the pool has something to hold back
SHARDS_PER_RUN = 2
SHARDS = 4
SHARD_SIZE = 16  # 4 x 16 demo prompts: quick on the CPU server, still a real backfill
BACKFILL_TIMEOUT_S = 1200  # generation runs one at a time (the pool), each paying a run start on a loaded CI machine

pytestmark = pytest.mark.vllm


# --------------------------------------------------------------------------- PostgreSQL


def postgres_bindir() -> Path:
    """The directory of ``initdb``/``pg_ctl``/``postgres``: Debian keeps them off PATH, under /usr/lib/postgresql/N/bin."""
    candidates: list[Path] = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))
    versions = Path("/usr/lib/postgresql").glob("*/bin")
    candidates += sorted(versions, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0, reverse=True)
    if shutil.which("initdb"):
        candidates.append(Path(shutil.which("initdb")).resolve().parent)
    for directory in candidates:
        if all((directory / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return directory
    raise RuntimeError(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found in pg_config --bindir, "
        "/usr/lib/postgresql/*/bin or PATH: install Debian's `postgresql` package (.ci/run does)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """A throwaway PostgreSQL cluster on a loopback port, password auth over TCP.

    PostgreSQL refuses to run as root, so as root the server's processes run as
    an unprivileged user (``postgres`` when the Debian package made it, else
    ``nobody``) in a directory under /tmp that user owns (pytest's own tmp dirs
    are private to root).
    """

    def __init__(self, user: str = "dagster", db_name: str = "dagster"):
        self.bindir = postgres_bindir()
        self.user = user
        self.db_name = db_name
        self.password = secrets.token_urlsafe(24)
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "sockets"
        self.log = self.root / "postgres.log"
        self.run_as: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                try:
                    self.run_as = pwd.getpwnam(name)
                    break
                except KeyError:
                    continue
            else:
                raise RuntimeError("running as root and neither a `postgres` nor a `nobody` user exists to run PostgreSQL as")

    def _run(self, args: list[str]) -> None:
        kwargs = {}
        if self.run_as is not None:
            kwargs = {"user": self.run_as.pw_uid, "group": self.run_as.pw_gid, "extra_groups": []}
        result = subprocess.run(args, cwd=self.root, capture_output=True, text=True, timeout=120, **kwargs)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return read_log_tail(self.log, lines, missing="")

    def start(self) -> "PostgresServer":
        self.socket_dir.mkdir()
        password_file = self.root / "pwfile"
        password_file.write_text(self.password + "\n")
        password_file.chmod(0o600)
        if self.run_as is not None:
            for path in (self.root, self.socket_dir, password_file):
                os.chown(path, self.run_as.pw_uid, self.run_as.pw_gid)
        self._run([
            str(self.bindir / "initdb"), "-D", str(self.data), "-U", self.user, f"--pwfile={password_file}",
            "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync",
        ])  # fmt: skip
        password_file.unlink()
        # A throwaway cluster: no fsync; TCP on loopback only; the unix socket in our own directory
        # (Debian's default, /var/run/postgresql, may not exist or not be writable for this user).
        options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start"])
        self.create_database()
        return self

    def create_database(self) -> None:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password, dbname="postgres")
        try:
            conn.autocommit = True  # CREATE DATABASE refuses to run inside a transaction
            with conn.cursor() as cursor:
                cursor.execute(f'CREATE DATABASE "{self.db_name}"')
        finally:
            conn.close()

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def env(self) -> dict[str, str]:
        """What deploy/dagster.yaml reads (see docs/production.md)."""
        return {
            "DAGSTER_PG_USERNAME": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_DB": self.db_name,
            "DAGSTER_PG_PORT": str(self.port),
        }


@pytest.fixture
def postgres():
    server = PostgresServer()
    try:
        yield server.start()
    finally:
        server.stop()


# --------------------------------------------------------------------------- the daemon


class DagsterDaemon:
    """``dagster-daemon run`` over the repo's workspace, in its own process group (it starts a code server and run workers)."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> "DagsterDaemon":
        daemon = Path(sys.executable).parent / "dagster-daemon"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(daemon), "run", "-w", str(REPO / "workspace.yaml")],
                cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        stop_process_group(self.process, grace_s)  # the daemon leads its group: its run workers go too


# --------------------------------------------------------------------------- helpers


POOL_BLOCKED = " is blocked by global concurrency limits: "


def pool_blocked(daemon_log: Path) -> dict[str, dict]:
    """The runs the daemon's run queue left queued for a pool, with what it said of each pool (``Run <id> is blocked by ...: {...}``)."""
    blocked = {}
    for line in daemon_log.read_text(errors="replace").splitlines():
        if POOL_BLOCKED in line:
            head, info = line.split(POOL_BLOCKED, 1)
            blocked[head.rsplit("Run ", 1)[1]] = json.loads(info)
    return blocked


def range_of(run) -> tuple[str, str]:
    """The shards a run materialises: its range (a ranged run), or its one partition."""
    tags = run.tags
    if "dagster/asset_partition_range_start" in tags:
        return tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]
    return tags["dagster/partition"], tags["dagster/partition"]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals open at one instant (an end before a start at the same time)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals], key=lambda e: (e[0], e[1]))
    open_now = peak = 0
    for _, delta in edges:
        open_now += delta
        peak = max(peak, open_now)
    return peak


def step_interval(instance: DagsterInstance, run_id: str, step_key: str) -> tuple[float, float]:
    """When ``step_key`` ran in ``run_id``: its STEP_START to its STEP_SUCCESS / STEP_FAILURE.

    A pool slot is claimed before the step starts and freed after it ends, so
    these intervals lie inside the slot's and cannot overlap more than the slots do.
    """
    kinds = {DagsterEventType.STEP_START, DagsterEventType.STEP_SUCCESS, DagsterEventType.STEP_FAILURE}
    events = [e for e in instance.all_logs(run_id, of_type=kinds) if e.step_key == step_key]
    starts = [e.timestamp for e in events if e.dagster_event.event_type == DagsterEventType.STEP_START]
    ends = [e.timestamp for e in events if e.dagster_event.event_type != DagsterEventType.STEP_START]
    assert len(starts) == 1 and len(ends) == 1, f"run {run_id}: {step_key} started {len(starts)}x, ended {len(ends)}x"
    return starts[0], ends[0]


# --------------------------------------------------------------------------- the test


def test_backfill_through_the_production_instance(postgres, vllm_server, data_dir, tmp_path, monkeypatch):
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(SHIPPED_INSTANCE_YAML, home / "dagster.yaml")  # the shipped file, byte for byte

    env = {
        **postgres.env(),
        "DAGSTER_HOME": str(home),
        # The code location's resources read these (resources/vllm_server.py from_env, settings.py).
        "EAGLE3_VLLM_URLS": vllm_server.base_url,
        "EAGLE3_SERVED_MODEL": vllm_server.served_model_name,
        "EAGLE3_PROMPTS": "demo",
        "EAGLE3_SHARD_SIZE": str(SHARD_SIZE),
        "EAGLE3_DATA_DIR": str(data_dir),
        "EAGLE3_GENERATION_POOL_LIMIT": str(GENERATION_POOL_LIMIT),
        "EAGLE3_SHARDS_PER_RUN": str(SHARDS_PER_RUN),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    instance = DagsterInstance.from_config(str(home))
    try:
        # Postgres holds runs, events and schedules: the file was read, the env vars resolved.
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"

        # The deployment step docs/production.md prescribes: give the project's pools their limits.
        from resources.gpu_host import GPU_POOL, ensure_gpu_pool_limit
        from resources.vllm_server import GENERATION_POOL, ensure_generation_pool_limit

        assert ensure_generation_pool_limit(instance) == GENERATION_POOL_LIMIT
        assert ensure_gpu_pool_limit(instance) == 1
        limits = {pool.name: pool.limit for pool in instance.event_log_storage.get_pool_limits()}
        assert limits[GENERATION_POOL] == GENERATION_POOL_LIMIT and limits[GPU_POOL] == 1

        from eagle3_assets.definitions import defs
        from eagle3_assets.glue.partitions import register_shards
        from eagle3_assets.demo.plugin import DemoPromptDataset

        keys = DemoPromptDataset(shard_size=SHARD_SIZE).shard_keys()[:SHARDS]
        register_shards(instance, keys)

        # Hold generation: no slot in the pool until every generation run of the backfill is queued,
        # so that they then contend for the limit's one slot (whatever the machine's speed), and
        # nothing but the pool can keep them to one at a time.
        storage = instance.event_log_storage
        storage.set_concurrency_slots(GENERATION_POOL, 0)

        daemon = DagsterDaemon(with_daemon_tick(dict(os.environ)), tmp_path / "daemon.log").start()
        try:
            # The asset backfill the UI launches for "prompts + raw_responses, these 4 shards", with
            # short generations (the session server's max_model_len is below the 8192 default).
            # Run config for a resource replaces what the code location built from the env vars
            # (unset fields fall back to the class defaults), so the server is named here too.
            vllm_config = {
                "base_urls": [vllm_server.base_url],
                "served_model_name": {"env": "EAGLE3_SERVED_MODEL"},
                "max_tokens": 64,
                "concurrency": 16,
                "temperature": 0.7,
                "progress_interval_s": 2.0,
            }
            backfill_id = make_new_backfill_id()
            instance.add_backfill(
                PartitionBackfill.from_asset_partitions(
                    backfill_id=backfill_id,
                    asset_graph=defs.resolve_asset_graph(),
                    partition_names=keys,
                    asset_selection=[AssetKey("prompts"), AssetKey("raw_responses")],
                    backfill_timestamp=time.time(),
                    tags={},
                    dynamic_partitions_store=instance,
                    all_partitions=False,
                    title="production instance test",
                    description=None,
                    run_config={"resources": {"vllm_server": {"config": vllm_config}}},
                )
            )
            deadline = time.monotonic() + BACKFILL_TIMEOUT_S

            def backfill_runs() -> list:
                return instance.get_runs(RunsFilter(tags={"dagster/backfill": backfill_id}))

            def wait(what: str) -> None:
                assert daemon.alive(), f"dagster-daemon exited ({daemon.process.returncode}):\n{daemon.log_tail()}"
                failed = [r.run_id for r in backfill_runs() if r.status in (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)]
                assert not failed, f"runs {failed} ended before {what}:\n{daemon.log_tail()}"
                assert time.monotonic() < deadline, f"{what} not reached after {BACKFILL_TIMEOUT_S}s:\n{daemon.log_tail()}"
                time.sleep(1)

            def generation_runs() -> list:
                return [r for r in backfill_runs() if AssetKey("raw_responses") in (r.asset_selection or set())]

            def covered(runs) -> list[str]:
                return sorted(k for r in runs for k in keys if range_of(r)[0] <= k <= range_of(r)[1])

            # Every prompts run done, and the generation runs over all four shards requested: they wait
            # in the queue, not as processes, while the pool has no slot.
            while covered(generation_runs()) != sorted(keys) or any(
                r.status != DagsterRunStatus.SUCCESS for r in backfill_runs() if r not in generation_runs()
            ):
                wait("the generation runs of all four shards queued")
            # The run queue considered each of them and held it for the pool, in the daemon's own words (its
            # QueuedRunCoordinatorDaemon logs this once per run it leaves queued): none of them may have started.
            while set(pool_blocked(daemon.log_path)) != {r.run_id for r in generation_runs()}:
                # (NOT_STARTED: created by the backfill daemon, not yet submitted to the queue)
                assert {r.status for r in generation_runs()} <= {DagsterRunStatus.NOT_STARTED, DagsterRunStatus.QUEUED}, "a generation run left the queue"
                wait("the run queue holding every generation run for the pool")
            assert {r.status for r in generation_runs()} == {DagsterRunStatus.QUEUED}
            assert all(info[GENERATION_POOL]["slot_count"] == 0 for info in pool_blocked(daemon.log_path).values())

            # Open the pool (what `dagster instance concurrency set vllm_generation 1` does) and
            # count the generation runs alive until the backfill is over.
            storage.set_concurrency_slots(GENERATION_POOL, GENERATION_POOL_LIMIT)
            most_alive = 0
            while instance.get_backfill(backfill_id).status in (BulkActionStatus.REQUESTED, BulkActionStatus.CANCELING, BulkActionStatus.FAILING):
                alive = [r for r in generation_runs() if r.status in (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED)]
                most_alive = max(most_alive, len(alive))
                wait("the backfill's end")
        finally:
            daemon.stop()

        backfill = instance.get_backfill(backfill_id)
        runs = instance.get_run_records(RunsFilter(tags={"dagster/backfill": backfill_id}))
        statuses = {range_of(r.dagster_run): r.dagster_run.status for r in runs}
        assert backfill.status == BulkActionStatus.COMPLETED_SUCCESS, f"{backfill.status}: {statuses}\n{daemon.log_tail()}"
        assert set(statuses.values()) == {DagsterRunStatus.SUCCESS}
        # raw_responses in ranges of at most SHARDS_PER_RUN shards, each shard in exactly one of them.
        ranged = [r.dagster_run for r in runs if AssetKey("raw_responses") in (r.dagster_run.asset_selection or set())]
        assert covered(ranged) == sorted(keys)
        assert all(len([k for k in keys if range_of(r)[0] <= k <= range_of(r)[1]]) <= SHARDS_PER_RUN for r in ranged)

        # Every shard materialised, in the instance and on disk.
        for asset in ("prompts", "raw_responses"):
            assert set(instance.get_materialized_partitions(AssetKey(asset))) == set(keys), asset
        for key in keys:
            rows = pl.read_parquet(data_dir / "raw_responses" / f"{key}.parquet")
            assert rows.height == SHARD_SIZE and rows["id"].n_unique() == SHARD_SIZE
            assert rows["error"].is_null().all(), rows.filter(pl.col("error").is_not_null())["error"].to_list()

        # The pool held: never more claimed slots than the limit while sampled, and never more
        # generation steps running at once than the limit, by the steps' own start and end events.
        generation_spans = [step_interval(instance, r.run_id, "raw_responses") for r in ranged]
        assert most_alive <= GENERATION_POOL_LIMIT
        assert 1 <= max_overlap(generation_spans) <= GENERATION_POOL_LIMIT, generation_spans

        # The database password is a secret: in no event of the runs, nowhere in the daemon's log.
        for run in runs:
            for entry in instance.all_logs(run.dagster_run.run_id):
                assert postgres.password not in serialize_value(entry)
        assert postgres.password not in (tmp_path / "daemon.log").read_text(errors="replace")
    finally:
        instance.dispose()
