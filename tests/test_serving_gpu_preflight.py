"""The GPU pre-flight enforces what the serving profile needs: the story's near-miss is refused before any work.

The story: Kimi-K2.5 INT4, tensor parallel 8, on 8 cards of 96 GB, while the generation server (a systemd
unit) still holds 95.6 GB of each. Extraction must not start there. No GPU here: ``nvidia-smi`` is a stand-in
script that prints hand-written outputs in nvidia-smi's exact CSV form (``fixtures/README.md``), and the
target is a hand-written copy of Kimi-K2.5's config and weight index (no weights). The pre-flight itself is
the real one, sent to this machine's Python on stdin as to any GPU host.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance, RunConfig, materialize

from eagle3_assets.core.gpu_host.preflight import (
    evaluate_gpus,
    gpu_memory_holders_line,
    parse_compute_apps_csv,
    parse_gpu_uuids_csv,
    parse_nvidia_smi_csv,
)
from eagle3_assets.core.gpu_host.stage_requirements import StageRequirements, with_serving_need
from eagle3_assets.core.serving.profile import ServingProfile, gpu_need
from resources.gpu_host import GPUHost
from resources.target_model import TargetModel

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
GPUS = FIXTURES / "nvidia_smi_8gpu_96gb_generation_server.handwritten.csv"
UUIDS = FIXTURES / "nvidia_smi_8gpu_uuids.handwritten.csv"
APPS = FIXTURES / "nvidia_smi_compute_apps_generation_server.handwritten.csv"
KIMI_K25 = FIXTURES / "kimi_k25_int4.handwritten"
TP8 = ServingProfile(tensor_parallel_size=8, trust_remote_code=True, reasoning_parser="kimi_k2")
UNIT = "vllm-kimi.service"

STAND_IN = f"""#!{sys.executable}
# A stand-in for nvidia-smi on a host without GPUs: prints hand-written outputs of the three queries the pre-flight makes.
import sys
outputs = {{
    "--query-gpu=index,memory.used,memory.total": {str(GPUS)!r},
    "--query-gpu=index,uuid": {str(UUIDS)!r},
    "--query-compute-apps=gpu_uuid,pid,process_name,used_memory": {str(APPS)!r},
}}
if len(sys.argv) != 3 or sys.argv[2] != "--format=csv" or sys.argv[1] not in outputs:
    sys.exit(f"stand-in nvidia-smi: no recorded output for {{sys.argv[1:]}}")
sys.stdout.write(open(outputs[sys.argv[1]]).read())
"""


@pytest.fixture
def nvidia_smi(tmp_path) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return str(path)


def test_the_recorded_outputs_are_read_in_nvidia_smi_form():
    gpus = parse_nvidia_smi_csv(GPUS.read_text())
    assert [(g.index, g.used_mib, g.total_mib, g.free_mib) for g in gpus] == [(i, 97894, 98304, 410) for i in range(8)]
    uuids = parse_gpu_uuids_csv(UUIDS.read_text())
    processes = parse_compute_apps_csv(APPS.read_text(), uuids)
    assert [(p.gpu_index, p.name, p.used_mib) for p in processes] == [(i, f"VLLM::Worker_TP{i}", 97380) for i in range(8)]
    with pytest.raises(ValueError, match="line 2"):
        parse_compute_apps_csv("gpu_uuid, pid, process_name, used_gpu_memory [MiB]\nGPU-1, 12, python\n", uuids)
    with pytest.raises(ValueError, match="header"):
        parse_compute_apps_csv("pid, process_name, used_gpu_memory [MiB]\n12, python, 1 MiB\n", uuids)
    # A process name with a comma stays one name.
    (odd,) = parse_compute_apps_csv(f"gpu_uuid, pid, process_name, used_gpu_memory [MiB]\n{next(iter(uuids))}, 7, a, b, 10 MiB\n", uuids)
    assert (odd.gpu_index, odd.name, odd.used_mib) == (0, "a, b", 10)


def test_the_need_is_the_share_of_the_weights_and_a_kv_cache():
    need = gpu_need(TP8, KIMI_K25, 16384)
    per_gpu = 594_000_000_000 // 8
    kv = 61 * (512 + 64) * 2 * 16384  # MLA's latent, bf16, one 16k-token sequence on every rank
    assert (need.gpus, need.bytes_per_gpu) == (8, per_gpu + kv)
    assert "TP 8 x PP 1 x DP 1: weights 594.0 GB / 8 = 74.2 GB per GPU" in need.note
    requirements = with_serving_need(StageRequirements(modules=["vllm"]), need)
    assert requirements.min_gpus == 8 and requirements.min_free_gpu_memory == per_gpu + kv and requirements.gpu_memory_note == need.note
    # Twice the ranks: half the weights each, and sixteen GPUs the story's host does not have.
    gpus = parse_nvidia_smi_csv(GPUS.read_text())
    tp16 = gpu_need(TP8.model_copy(update={"tensor_parallel_size": 16}), KIMI_K25, 16384)
    failures = evaluate_gpus(gpus, None, stage="x", cpu_allowed=False, min_gpus=tp16.gpus, min_free_mib=tp16.bytes_per_gpu >> 20)
    assert failures[0] == "GPU: 8 found on the host, stage x needs 16"


def test_the_holders_are_named_with_the_unit_to_stop():
    processes = parse_compute_apps_csv(APPS.read_text(), parse_gpu_uuids_csv(UUIDS.read_text()))
    line = gpu_memory_holders_line(processes, [0, 1], UNIT)
    assert line.startswith("GPU memory on GPU(s) 0, 1 is held by PID 41873 VLLM::Worker_TP0 (97380 MiB on GPU 0); PID 41874 VLLM::Worker_TP1")
    assert "Worker_TP2" not in line and line.endswith(f"sudo systemctl stop {UNIT} (gpu_host.serving_unit), then run the stage again")
    assert "set gpu_host.serving_unit" in gpu_memory_holders_line(processes, [0], None)


def test_the_storys_gpu_state_is_refused_by_the_host_preflight(nvidia_smi):
    host = GPUHost(mode="local", working_dir=str(REPO), nvidia_smi=nvidia_smi, serving_unit=UNIT)
    need = TargetModel(path=str(KIMI_K25), **TP8.model_dump()).gpu_need()
    report = host.preflight("host_probe", with_serving_need(StageRequirements(cpu_allowed=False), need))
    assert not report["ok"]
    need_mib = -(-need.bytes_per_gpu // (1 << 20))
    for index in range(8):  # every card, not the first two
        assert f"GPU {index}: 410 MiB free (97894 of 98304 MiB used); stage host_probe needs {need_mib} MiB free" in report["failures"]
    assert f"GPU memory: stage host_probe needs {need_mib} MiB free on each GPU ({need.note})" in report["failures"]
    (holders,) = [f for f in report["failures"] if f.startswith("GPU memory on GPU(s)")]
    assert all(f"PID {41873 + i} VLLM::Worker_TP{i} (97380 MiB on GPU {i})" in holders for i in range(8))
    assert f"sudo systemctl stop {UNIT}" in holders
    assert [p["pid"] for p in report["gpu_processes"]] == list(range(41873, 41881))


def test_extraction_with_the_tp8_profile_is_refused_before_any_work(nvidia_smi, tmp_path, monkeypatch):
    """The real ``hidden_states`` asset, vLLM backend, the story's profile and host: the run fails at the pre-flight,
    naming the processes and the unit; no stage process ran, nothing was written."""
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(tmp_path / "data"))
    from eagle3_assets.core.storage.shard_paths import ShardPaths
    from eagle3_assets.defs.hidden_states import hidden_states
    from eagle3_assets.glue.partitions import SAMPLE_SHARDS
    from eagle3_assets.glue.stage_configs import HiddenStatesConfig

    shard = "shard-00000"
    traces = ShardPaths("validated_traces", shard).parquet
    traces.parent.mkdir(parents=True)
    pl.DataFrame({"id": ["a"], "num_tokens": [12]}).write_parquet(traces)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SAMPLE_SHARDS, [shard])
    result = materialize(
        [hidden_states],
        partition_key=shard,
        resources={
            "target_model": TargetModel(path=str(KIMI_K25), **TP8.model_dump()),
            "gpu_host": GPUHost(mode="local", working_dir=str(REPO), nvidia_smi=nvidia_smi, serving_unit=UNIT),
        },
        run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(backend="vllm")}),
        instance=instance,
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = json.dumps(failure.event_specific_data.error.to_string() if failure.event_specific_data.error else "")
    assert "is not ready for stage extract_hidden_states" in message and "GPU 7: 410 MiB free" in message
    assert f"sudo systemctl stop {UNIT}" in message and "VLLM::Worker_TP7" in message
    assert not any(e.event_type_value == "STEP_OUTPUT" for e in result.all_events)
    assert not ShardPaths("hidden_states", shard).directory.exists()


def test_gpu_host_ready_checks_what_each_stage_that_starts_the_target_needs(nvidia_smi):
    """The readiness job, run before a backfill is queued, refuses the story's host for the stages that start the
    target, each with its own need (extraction's engine the whole context, loads_in_vllm one short completion; the
    evaluation is declared like extraction, and not run here: each stage's pre-flight imports vLLM on the host);
    host_probe, which starts nothing, is not held to it."""
    from dagster import DagsterEventType

    import eagle3_assets.definitions  # noqa: F401  (every asset module registers its stage)
    from eagle3_assets.defs.gpu_host_ready import gpu_host_ready_job
    from resources.gpu_host import STAGE_REQUIREMENTS

    serving = sorted(stage for stage, requirements in STAGE_REQUIREMENTS.items() if requirements.serves_target)
    assert serving == ["evaluate_draft", "extract_hidden_states", "refine_draft", "train_draft"]  # refine_draft: a round serves it
    checked = ["extract_hidden_states", "train_draft"]
    target_model = TargetModel(path=str(KIMI_K25), **TP8.model_dump())
    result = gpu_host_ready_job.execute_in_process(
        resources={"gpu_host": GPUHost(mode="local", working_dir=str(REPO), nvidia_smi=nvidia_smi, serving_unit=UNIT), "target_model": target_model},
        run_config={"ops": {"gpu_host_preflight": {"config": {"stages": [*checked, "host_probe"], "run_probe": False}}}},
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    description = failure.step_failure_data.user_failure_data.description
    for stage in checked:
        context = STAGE_REQUIREMENTS[stage].serving_context
        need_mib = -(-target_model.gpu_need(context).bytes_per_gpu // (1 << 20))
        assert f"- {stage}: GPU 7: 410 MiB free (97894 of 98304 MiB used); stage {stage} needs {need_mib} MiB free" in description
        assert f"- {stage}: GPU memory on GPU(s) 0, 1, 2, 3, 4, 5, 6, 7 is held by PID 41873" in description
    assert f"sudo systemctl stop {UNIT}" in description
    # loads_in_vllm serves one short completion: a smaller KV cache than the stages that serve the whole context.
    assert target_model.gpu_need(STAGE_REQUIREMENTS["train_draft"].serving_context).bytes_per_gpu < target_model.gpu_need().bytes_per_gpu
    assert "- host_probe: GPU" not in description
