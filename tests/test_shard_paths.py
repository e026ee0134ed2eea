"""Where files live: one module names them, the lock directory is one setting, and the platform assumes no target."""

import subprocess
import sys
from pathlib import Path

from dagster import AssetExecutionContext, DagsterInstance, asset, materialize

from eagle3_assets.core.storage.shard_lease import ShardLease
from eagle3_assets.core.storage.shard_paths import LOCKS_DIR, DatasetPaths, ShardPaths, lock_dir
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.serving.vllm_launcher import VLLMServer
from eagle3_assets.demo.targets import TINY_SERVING
from resources.gpu_host import GPUHost

REPO = Path(__file__).resolve().parents[1]


def test_shard_paths_imports_without_storage():
    """No cycle storage <-> shard_paths: the paths module (which the GPU host's pre-flight imports) stands alone."""
    code = "import sys, eagle3_assets.core.storage.shard_paths; print('eagle3_assets.core.storage.files' in sys.modules, 'polars' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, env={"PYTHONPATH": str(REPO)})
    assert done.stdout.split() == ["False", "False"]


def test_a_shard_lease_takes_its_guard_in_the_one_lock_directory(tmp_path, monkeypatch):
    data, locks = tmp_path / "data", tmp_path / "local-locks"
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(data))
    paths = ShardPaths("prompts", "shard-00000")
    assert lock_dir() == data.resolve() / LOCKS_DIR
    monkeypatch.setenv("EAGLE3_LOCK_DIR", str(locks))
    paths.asset_dir.mkdir(parents=True)
    with ShardLease(paths.asset_dir, paths.shard, asset="prompts", run_id="r1", log=lambda _: None):
        assert paths.lease.is_file()
    assert [p.name for p in locks.iterdir()] == ["prompts.leases.guard"]
    assert not (data / LOCKS_DIR).exists()


def test_a_gpu_stage_gets_the_hosts_lock_directory(tmp_path, monkeypatch):
    """The stage process runs with EAGLE3_LOCK_DIR = gpu_host.lock_dir: its shard leases sit beside its stage lock."""
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(tmp_path / "data"))

    @asset(name="lock_dir_probe")
    def probe(context: AssetExecutionContext, gpu_host: GPUHost):
        return gpu_host.run_stage(context, "host_probe", {"modules": []}).get_materialize_result()

    host = GPUHost(mode="local", working_dir=str(REPO), lock_dir=str(tmp_path / "host-locks"))
    result = materialize([probe], resources={"gpu_host": host}, instance=DagsterInstance.ephemeral())
    assert result.success
    (materialization,) = result.asset_materializations_for_node("lock_dir_probe")
    assert materialization.metadata["lock_dir"].value == str(tmp_path / "host-locks")
    assert (tmp_path / "host-locks" / "host_probe.lock").exists()


def test_the_dataset_files_are_named_in_one_place(tmp_path):
    paths = DatasetPaths(tmp_path)
    assert paths.history == tmp_path / "draft_checkpoint" / "training" / "history.json"
    assert paths.vocab_mapping == tmp_path / "vocab_mapping" / "vocab_mapping.safetensors"
    assert paths.evaluation_report.parent == paths.eval_prompts.parent == tmp_path / "draft_evaluation"


def test_the_launcher_assumes_no_target():
    """Unless told, vLLM serves under the model path and splits no reasoning; the tiny target's name and parser are the demo's."""
    plain = VLLMServer("/models/any", profile=ServingProfile()).command()
    assert plain[plain.index("--served-model-name") + 1] == "/models/any" and "--reasoning-parser" not in plain
    demo = VLLMServer("/models/tiny", **TINY_SERVING).command()
    assert demo[demo.index("--served-model-name") + 1] == "tiny-reasoner"
    assert demo[demo.index("--reasoning-parser") + 1] == "deepseek_r1"
