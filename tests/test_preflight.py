"""The GPU host's pre-flight, on this machine as the host (local mode), each failure provoked for real.

The checks run the way they run in production: the pre-flight script is sent
to the host's Python on stdin and its JSON report read back
(``GPUHost.preflight``). No GPU here: the GPU memory logic is tested on a
hand-written 8-GPU ``nvidia-smi`` output (``fixtures/README.md`` says why).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_assets.core.gpu_host.preflight import (
    GPUMemory,
    evaluate_gpus,
    evaluate_unit,
    lock_holder,
    parse_nvidia_smi_csv,
    systemd_unit_state,
)
from eagle3_assets.core.gpu_host.stage_lock import StageLock
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements
from eagle3_assets.core.gpu_host.remote import SSHTarget, remote_shell_command
from resources.gpu_host import GPUHost

REPO = Path(__file__).resolve().parents[1]
HANDWRITTEN_8_GPU = Path(__file__).parent / "fixtures" / "nvidia_smi_8gpu.handwritten.csv"
STAGE = "host_probe"
GIB = 1 << 30


def local_host(**fields) -> GPUHost:
    return GPUHost(mode="local", working_dir=str(REPO), **fields)


def start_and_wait(argv: list[str], ready: Path, timeout_s: float = 30.0, env: dict | None = None) -> subprocess.Popen:
    """Start a helper process and wait until it has created ``ready``."""
    process = subprocess.Popen(argv, cwd=REPO, env=env)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"helper {argv[:3]} did not get ready (exit {process.poll()})")
        time.sleep(0.05)
    return process


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=10)


# --------------------------------------------------------------------------- GPU memory


def test_8_gpu_output_in_nvidia_smi_form_is_parsed_for_every_gpu():
    gpus = parse_nvidia_smi_csv(HANDWRITTEN_8_GPU.read_text())
    assert [g.index for g in gpus] == list(range(8))
    assert all(g.total_mib == 143771 for g in gpus)
    assert gpus[0].used_mib == 4 and gpus[7].used_mib == 129640
    assert gpus[2].free_mib == 143771 - 129512


def test_gpu_memory_is_checked_on_all_eight_gpus_not_the_first_two():
    gpus = parse_nvidia_smi_csv(HANDWRITTEN_8_GPU.read_text())
    need_mib = 100 * 1024
    failures = evaluate_gpus(gpus, None, stage="draft_training", cpu_allowed=False, min_gpus=8, min_free_mib=need_mib)
    assert len(failures) == 6
    for index, line in zip(range(2, 8), failures):
        assert line.startswith(f"GPU {index}: ") and "stage draft_training needs 102400 MiB free" in line
    # The story's hand check looked at GPUs 0 and 1 only: they are idle, and would have passed.
    assert evaluate_gpus(gpus, None, stage="x", cpu_allowed=False, min_gpus=1, min_free_mib=need_mib, gpu_indices=[0, 1]) == []
    assert evaluate_gpus(gpus, None, stage="x", cpu_allowed=False, min_gpus=16, min_free_mib=0) == [
        "GPU: 8 found on the host, stage x needs 16"
    ]


def test_nvidia_smi_output_that_cannot_be_read_is_an_error_not_skipped():
    header = "index, memory.used [MiB], memory.total [MiB]\n"
    with pytest.raises(ValueError, match="line 3"):
        parse_nvidia_smi_csv(header + "0, 1 MiB, 100 MiB\n1, 1 MiB\n")
    with pytest.raises(ValueError, match="header"):
        parse_nvidia_smi_csv("index, memory.used, memory.total\n0, 1, 100\n")
    unreported = parse_nvidia_smi_csv(header + "0, [N/A], [N/A]\n")
    assert unreported == [GPUMemory(0, None, None)]
    assert "memory not reported" in evaluate_gpus(unreported, None, stage="x", cpu_allowed=False, min_gpus=1, min_free_mib=1)[0]


def test_no_gpu_fails_unless_cpu_is_allowed(data_dir):
    # This machine has no GPU; naming a missing nvidia-smi keeps the test the same on one that has.
    spec_no_smi = {"nvidia_smi": "/nonexistent/nvidia-smi"}
    needs_gpu = StageRequirements(cpu_allowed=False)
    report = _preflight(local_host(allow_cpu=False), needs_gpu, **spec_no_smi)
    assert report["failures"] == [
        f"GPU: none found on the host (/nonexistent/nvidia-smi not found); stage {STAGE} does not allow CPU"
    ]
    assert _preflight(local_host(allow_cpu=False), StageRequirements(cpu_allowed=True), **spec_no_smi)["ok"]
    allowed_by_host = _preflight(local_host(allow_cpu=True), needs_gpu, **spec_no_smi)
    assert allowed_by_host["ok"] and allowed_by_host["cpu_allowed_by"] == "host"


# --------------------------------------------------------------------------- modules


def test_a_module_that_does_not_exist_fails_naming_it(data_dir):
    report = local_host().preflight(STAGE, StageRequirements(modules=["polars", "eagle3_no_such_module"], cpu_allowed=True))
    assert not report["ok"]
    assert report["failures"] == [
        f"module eagle3_no_such_module: does not import in {sys.executable}: "
        "ModuleNotFoundError: No module named 'eagle3_no_such_module'"
    ]
    assert report["modules"]["polars"] and report["modules"]["eagle3_no_such_module"] is None
    assert report["modules"][f"eagle3_assets.stages.{STAGE}"], "the stage's own module is imported too"


def test_a_stage_module_that_does_not_exist_fails_before_anything_runs(data_dir):
    report = local_host().preflight("no_such_stage", StageRequirements(cpu_allowed=True))
    assert any(f.startswith("module eagle3_assets.stages.no_such_stage: does not import") for f in report["failures"])


def test_a_host_python_that_does_not_exist_is_a_failure_line(data_dir):
    report = local_host(python="/nonexistent/bin/python").preflight(STAGE, StageRequirements(cpu_allowed=True))
    assert report["failures"] == ["local: cannot run /nonexistent/bin/python: not found"]


# --------------------------------------------------------------------------- the stage lock


def test_a_live_process_holding_the_stage_lock_is_reported_by_pid_and_command_line(data_dir, tmp_path):
    host = local_host()
    lock = Path(host.host_lock_dir()) / f"{STAGE}.lock"
    ready = tmp_path / "holding"
    holder = start_and_wait(
        [sys.executable, "-c", LOCK_HOLDER_SOURCE, str(lock), str(ready), "eagle3-lock-holder-marker"], ready
    )
    try:
        report = host.preflight(STAGE, StageRequirements(cpu_allowed=True))
        assert not report["ok"]
        (line,) = report["failures"]
        assert line.startswith(f"stage lock {lock}: held by PID {holder.pid} (")
        assert "eagle3-lock-holder-marker" in line, "the holder's live command line is shown"
        assert report["lock"]["holder"]["pid_alive"] is True
    finally:
        stop(holder)
    # The kernel drops the lock with its holder: no stale lock after a crash.
    assert host.preflight(STAGE, StageRequirements(cpu_allowed=True))["ok"]


def test_the_stage_runner_refuses_to_start_while_the_lock_is_held(data_dir, tmp_path):
    lock = tmp_path / "locks" / f"{STAGE}.lock"
    ready = tmp_path / "holding"
    holder = start_and_wait([sys.executable, "-c", LOCK_HOLDER_SOURCE, str(lock), str(ready), "x"], ready)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "eagle3_assets.stages", STAGE, "--lock", str(lock)],
            input=json.dumps({"env": {}}) + "\n", capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip
    finally:
        stop(holder)
    assert done.returncode == 75
    record = json.loads(done.stdout.splitlines()[0])["eagle3_runner"]
    assert f"held by PID {holder.pid}" in record["error"]


def test_a_stage_process_started_by_hand_outside_the_lock_is_reported(data_dir, tmp_path):
    # Stand-in for a stage someone started by hand: a process whose command line runs the stage module.
    ready = tmp_path / "started"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    stand_in = start_and_wait([sys.executable, "-c", code, "-m", f"eagle3_assets.stages.{STAGE}"], ready)
    try:
        report = local_host().preflight(STAGE, StageRequirements(cpu_allowed=True))
    finally:
        stop(stand_in)
    assert any(f"outside the lock: PID {stand_in.pid} (" in f for f in report["failures"]), report["failures"]


def test_the_same_stage_on_another_data_directory_is_not_a_stray_and_one_sharing_the_lock_directory_is(data_dir, tmp_path):
    """Two pipelines on one host each run their stage under their own lock: only a process whose locks are this data
    directory's (by ``EAGLE3_LOCK_DIR`` or by its data directory) is reported. Fails with the pre-flight's lock
    directory left out of the stray search (the other pipeline's stage is then reported), or with a process's
    ``EAGLE3_LOCK_DIR`` ignored (the one sharing the lock directory is then missed)."""
    code = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"
    other_pipeline = {**os.environ, "EAGLE3_DATA_DIR": str(tmp_path / "other-data")}
    same_locks = {**other_pipeline, "EAGLE3_LOCK_DIR": str(local_host().host_lock_dir())}
    stand_ins = [
        start_and_wait([sys.executable, "-c", code, str(tmp_path / name), "-m", f"eagle3_assets.stages.{STAGE}"], tmp_path / name, env=env)
        for name, env in (("other", other_pipeline), ("same", same_locks))
    ]  # fmt: skip
    try:
        report = local_host().preflight(STAGE, StageRequirements(cpu_allowed=True))
    finally:
        for stand_in in stand_ins:
            stop(stand_in)
    reported = {entry["pid"] for entry in report["lock"]["stray_processes"]}
    assert stand_ins[1].pid in reported and stand_ins[0].pid not in reported, report["failures"]


# --------------------------------------------------------------------------- disk and partial files


def test_a_disk_estimate_larger_than_the_free_space_fails(data_dir):
    free = shutil.disk_usage(data_dir).free
    report = local_host().preflight(STAGE, StageRequirements(cpu_allowed=True, disk_bytes=free + 1024 * GIB))
    (line,) = report["failures"]
    assert line.startswith(f"disk: {data_dir / STAGE} has ") and f"stage {STAGE} estimates" in line
    assert report["disk"]["needed_bytes"] > report["disk"]["free_bytes"]
    assert local_host().preflight(STAGE, StageRequirements(cpu_allowed=True, disk_bytes=1))["ok"]


def test_partial_files_of_an_aborted_run_are_reported_and_removed_only_when_configured(data_dir):
    out = data_dir / STAGE
    # A real aborted write: a process killed inside storage.atomic_path leaves its temporary file.
    code = (
        "import os, signal, sys; from pathlib import Path; from eagle3_assets.core.storage.files import atomic_path\n"
        "with atomic_path(Path(sys.argv[1])) as tmp:\n"
        "    tmp.write_bytes(b'half a file')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(out / "shard-00000" / "part-00000.safetensors")], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL
    (partial,) = [p for p in out.rglob("*") if p.is_file()]
    assert partial.name.endswith(".partial")

    report = local_host().preflight(STAGE, StageRequirements(cpu_allowed=True))
    (line,) = report["failures"]
    assert line.startswith(f"partial files: 1 left by an aborted run under {out} (e.g. {partial})")
    assert partial.exists(), "reported, not removed"

    cleaned = local_host(remove_partial_files=True).preflight(STAGE, StageRequirements(cpu_allowed=True))
    assert cleaned["ok"] and cleaned["partial_files"] == {"found": 1, "removed": 1, "examples": [str(partial)]}
    assert not partial.exists()


# --------------------------------------------------------------------------- systemd


def test_systemd_units_are_checked_against_the_state_the_stage_needs(data_dir):
    # This machine runs no systemd (a container): no unit can be active here.
    state = systemd_unit_state("vllm.service")
    assert state in {"no-systemd", "no-systemctl", "inactive", "unknown"}
    report = local_host().preflight(
        STAGE, StageRequirements(cpu_allowed=True, systemd_units={"vllm.service": "inactive", "eagle3-serve.service": "active"})
    )
    assert report["failures"] == [f"systemd unit eagle3-serve.service: {state}, stage needs it active"]
    assert report["systemd"]["vllm.service"] == {"state": state, "required": "inactive"}
    assert evaluate_unit("vllm.service", "inactive", "active") == "systemd unit vllm.service: active, stage needs it inactive"
    assert evaluate_unit("vllm.service", "inactive", "deactivating") is not None
    assert evaluate_unit("vllm.service", "inactive", "failed") is None
    assert evaluate_unit("vllm.service", "active", "active") is None


# --------------------------------------------------------------------------- building commands


def test_remote_commands_are_quoted_argument_by_argument():
    hostile = ["/opt/py/bin/python", "-m", "eagle3_assets.stages", "x", "--lock", "/d/x; touch /tmp/pwned/$(id)`id`'\"/a.lock"]
    command = remote_shell_command(hostile, cwd="/srv/eagle 3; rm -rf ~")
    words = shlex.split(command)
    assert words[:4] == ["cd", "--", "/srv/eagle 3; rm -rf ~", "&&"]
    assert words[4:] == ["exec", *hostile]


def test_ssh_arguments_carry_the_host_key_policy_and_identity():
    target = SSHTarget(host="gpu-1", port=2222, user="ml", identity_file="/keys/id", known_hosts="strict", known_hosts_file="/kh")
    argv = target.ssh_argv("exec true")
    assert argv[0] == "ssh" and argv[-3:] == ["--", "gpu-1", "exec true"]
    joined = " ".join(argv)
    for option in ("-p 2222", "-l ml", "-i /keys/id", "StrictHostKeyChecking=yes", "UserKnownHostsFile=/kh", "BatchMode=yes", "-T"):
        assert option in joined
    assert "StrictHostKeyChecking=accept-new" in SSHTarget(host="gpu-1", known_hosts="accept-new").ssh_argv("true")
    with pytest.raises(ValueError, match="not a host name"):
        SSHTarget(host="-oProxyCommand=touch /tmp/pwned")
    with pytest.raises(ValueError, match="known_hosts policy"):
        SSHTarget(host="gpu-1", known_hosts="trust-me")


def test_stage_requirements_reject_what_could_not_be_checked():
    with pytest.raises(ValueError, match="systemd_units"):
        StageRequirements(systemd_units={"vllm.service": "stopped"})
    with pytest.raises(ValueError, match="lock"):
        StageRequirements(lock="../../etc/passwd")
    with pytest.raises(ValueError, match="modules"):
        StageRequirements(modules=["os; rm -rf /"])
    with pytest.raises(ValueError, match="stage"):
        local_host().preflight("x; touch /tmp/pwned")


def test_a_lock_held_in_this_process_is_seen_and_released():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.lock")
        lock = StageLock(path)
        assert lock.try_acquire({"pid": os.getpid(), "cmdline": "me"}) is None
        # A second acquirer (same process, another open file) sees the holder.
        held = StageLock(path).try_acquire({"pid": -1}, attempts=1)
        assert held is not None and held["pid"] == os.getpid()
        lock.release()
        assert lock_holder(path) is None


LOCK_HOLDER_SOURCE = """
import os, sys, time, pathlib
from eagle3_assets.core.gpu_host.stage_lock import StageLock
from eagle3_assets.core.gpu_host.preflight import process_cmdline
lock = StageLock(sys.argv[1])
assert lock.try_acquire({"pid": os.getpid(), "cmdline": process_cmdline(os.getpid())}) is None
pathlib.Path(sys.argv[2]).touch()
time.sleep(120)
"""


def _preflight(host: GPUHost, requirements: StageRequirements, **spec_overrides) -> dict:
    """Run the host-side pre-flight with some spec fields replaced (e.g. a missing nvidia-smi)."""
    from eagle3_assets.core.gpu_host.preflight import run_preflight
    from eagle3_assets.core.gpu_host.stage_requirements import build_spec
    from eagle3_assets.core.storage.files import PARTIAL_SUFFIX

    spec = build_spec(
        STAGE,
        requirements,
        data_dir=host.host_data_dir(),
        lock_dir=host.host_lock_dir(),
        partial_suffix=PARTIAL_SUFFIX,
        remove_partial_files=False,
        cpu_allowed_by_host=host.allow_cpu,
    )
    return run_preflight({**spec, **spec_overrides})


# -- the target pre-flight: a remote-code tokenizer recognised from the model directory ------------------

OWN_VOCABULARY_TOKENIZER = '''
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast


class OwnVocabularyTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"vocab_file": "own_vocabulary.json"}

    def __init__(self, vocab_file=None, **kwargs):
        kwargs.pop("tokenizer_object", None)
        super().__init__(tokenizer_object=Tokenizer.from_file(vocab_file), **kwargs)
'''


def with_own_vocabulary_tokenizer(tiny_target: Path, where: Path) -> Path:
    """The tiny target with its tokenizer made remote code the way Kimi's is: a class of the directory's own
    (``auto_map``, ``tokenizer_class``) whose vocabulary is a file no transformers class reads, in a model
    directory of DeepSeek-V3's model type (for which transformers, not trusted, skips ``auto_map`` silently)."""
    shutil.copytree(tiny_target, where)
    model_config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**model_config, "model_type": "deepseek_v3"}))
    (where / "tokenizer.json").rename(where / "own_vocabulary.json")
    (where / "tokenization_own.py").write_text(OWN_VOCABULARY_TOKENIZER)
    config = json.loads((where / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="OwnVocabularyTokenizer", auto_map={"AutoTokenizer": ["tokenization_own.OwnVocabularyTokenizer", None]})
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


def test_a_remote_code_tokenizer_is_named_from_the_directory_not_from_the_error_text(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    from eagle3_assets.core.target.description import TargetError
    from eagle3_assets.core.target.preflight import TargetSettings, preflight_problems
    from eagle3_assets.core.target.tokenizer import load_tokenizer, remote_code_tokenizer

    remote = with_own_vocabulary_tokenizer(tiny_target, tmp_path / "own-vocabulary")
    # The case of the issue: transformers' own failure says nothing of remote code.
    with pytest.raises(Exception) as raw:
        AutoTokenizer.from_pretrained(str(remote))
    assert "Couldn't instantiate the backend tokenizer" in str(raw.value) and "remote" not in str(raw.value).lower(), raw.value

    assert remote_code_tokenizer(tiny_target) is None
    found = remote_code_tokenizer(remote)
    assert (found.tokenizer_class, found.code, found.declared_in) == ("OwnVocabularyTokenizer", ("tokenization_own.py",), "tokenizer_config.json")
    with pytest.raises(TargetError) as refused:
        load_tokenizer(remote)
    message = str(refused.value)
    assert "EAGLE3_TRUST_REMOTE_CODE=1" in message and str(remote / "tokenization_own.py") in message, message
    (problem,) = preflight_problems(TargetSettings(str(remote)), max_tokens=256, eval_max_tokens=128)
    assert "EAGLE3_TRUST_REMOTE_CODE=1" in problem and "tokenization_own.py" in problem, problem

    # Opted in, the directory's own class loads and the target passes its pre-flight.
    assert type(load_tokenizer(remote, trust_remote_code=True)).__name__ == "OwnVocabularyTokenizer"
    assert preflight_problems(TargetSettings(str(remote), trust_remote_code=True), max_tokens=256, eval_max_tokens=128) == []


def test_a_tokenizer_class_transformers_lacks_without_code_for_it_is_named(tiny_target, tmp_path):
    from eagle3_assets.core.target.description import TargetError
    from eagle3_assets.core.target.tokenizer import load_tokenizer, remote_code_tokenizer

    where = shutil.copytree(tiny_target, tmp_path / "unknown-class")
    config = json.loads((where / "tokenizer_config.json").read_text())
    (where / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizerAnywhere"}))
    assert remote_code_tokenizer(where).code == ()
    with pytest.raises(TargetError, match="NoSuchTokenizerAnywhere.*transformers does not ship.*no auto_map"):
        load_tokenizer(where, trust_remote_code=True)
