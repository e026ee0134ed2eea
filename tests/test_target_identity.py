"""The target's identity holds across machines: an orchestrator with only the tokenizer, template and config
of a model and a GPU host with its weights compute the same identity; another model still differs.

The two sides are two real directories of the tiny target: one without its weights (what an orchestrator
holds), one complete (the GPU host's); the GPU side runs the real extraction stage.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dagster import DagsterInstance, RunConfig, materialize

from eagle3_assets.core.target.identity import target_identity
from eagle3_assets.glue.partitions import register_shards
from tests.extraction_helpers import recorded_checks

SHARD = "shard-00000"
WEIGHTS = ("*.safetensors", "*.bin")


def orchestrator_copy(model: Path, where: Path) -> Path:
    """What an operator copies to the orchestrator: every file of the model but its weights."""
    shutil.copytree(model, where, ignore=shutil.ignore_patterns(*WEIGHTS, "build_info.json", "generation_config.json"))
    assert not list(where.glob("*.safetensors")) and (where / "config.json").is_file()
    return where


def test_a_model_without_its_weights_has_the_identity_of_the_model_with_them(tiny_target, tmp_path):
    orchestrator = orchestrator_copy(tiny_target, tmp_path / "tokenizer-and-config")
    here, there = target_identity(orchestrator), target_identity(tiny_target)
    assert here.config_hash == there.config_hash and here.mismatch(there) is None
    assert here.parts["tokenizer"] and here.parts["chat_template"] and here.parts["weights_index"] is None


def test_another_model_and_another_template_are_other_identities(tiny_target, qwen3_target, tmp_path):
    tiny = target_identity(tiny_target)
    # Same vocabulary size, another model: differs in config, tokenizer and template.
    assert "config" in tiny.mismatch(target_identity(qwen3_target))
    # The same weights under another chat template render other traces: another identity.
    template = shutil.copytree(tiny_target, tmp_path / "template")
    (template / "chat_template.jinja").write_text((template / "chat_template.jinja").read_text() + "\n")
    why = tiny.mismatch(target_identity(template))
    assert why and "chat_template" in why and "config" not in why
    # A tokenizer changed in one file (one merge more, say) is another tokenizer.
    tokenizer = shutil.copytree(tiny_target, tmp_path / "tokenizer")
    spec = json.loads((tokenizer / "tokenizer.json").read_text())
    spec["added_tokens"] = spec["added_tokens"][:-1]
    (tokenizer / "tokenizer.json").write_text(json.dumps(spec))
    assert "tokenizer" in tiny.mismatch(target_identity(tokenizer))


def test_the_weights_index_counts_and_a_missing_copy_is_named(tiny_target, tmp_path):
    sharded = shutil.copytree(tiny_target, tmp_path / "sharded")
    index = {"metadata": {"total_size": 1_829_000}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    without_index = orchestrator_copy(sharded, tmp_path / "no-index")
    (without_index / "model.safetensors.index.json").unlink()
    with_index = orchestrator_copy(sharded, tmp_path / "with-index")
    assert target_identity(with_index).mismatch(target_identity(sharded)) is None
    why = target_identity(without_index).mismatch(target_identity(sharded))
    assert why and "weights_index" in why and "present in one directory only" in why
    # Other weights (another index) are another model, whatever the config and tokenizer say.
    index["weight_map"]["lm_head.weight"] = "model-00002.safetensors"
    (with_index / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "weights_index" in target_identity(with_index).mismatch(target_identity(sharded))


def extract(data_dir: Path, orchestrator: Path, gpu_host: Path):
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    result = materialize(
        [hidden_states],
        partition_key=SHARD,
        resources={"target_model": TargetModel(path=str(orchestrator), gpu_host_path=str(gpu_host)), "gpu_host": GPUHost()},
        instance=instance,
        run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1, part_size_bytes=200_000)}),
        raise_on_error=False,
    )
    # The gates as the instance recorded them: a run that fails keeps its shards' results there, not in its result.
    return result, recorded_checks(instance, result.run_id)


def test_traces_rendered_without_weights_are_extracted_by_the_host_with_them_and_not_by_another_model(tiny_target, tmp_path, data_dir):
    from tests.extraction_helpers import write_validated_traces
    from tests.test_target import variant

    orchestrator = orchestrator_copy(tiny_target, tmp_path / "orchestrator")
    write_validated_traces(data_dir, SHARD, orchestrator, count=4)  # rendered where there are no weights

    result, checks = extract(data_dir, orchestrator, tiny_target)
    assert result.success and checks["target_matches_traces"].passed, checks["target_matches_traces"].description
    assert all(c.passed for c in checks.values())
    assert list((data_dir / "hidden_states" / SHARD).glob("part-*.safetensors"))

    # The GPU host's directory holds another model (one config value differs): refused before any state is computed.
    shutil.rmtree(data_dir / "hidden_states")
    other = variant(tiny_target, tmp_path / "other", rms_norm_eps=1e-6)
    refused, checks = extract(data_dir, orchestrator, other)
    assert not refused.success and not checks["target_matches_traces"].passed
    assert "differ in config" in checks["target_matches_traces"].description
    assert not list((data_dir / "hidden_states" / SHARD).glob("part-*.safetensors"))
