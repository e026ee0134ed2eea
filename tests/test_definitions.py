"""The one Definitions object loads, and every asset, partition and check is there."""

from __future__ import annotations

from dagster import AssetCheckKey, AssetKey, DynamicPartitionsDefinition

from eagle3_assets.definitions import defs
from eagle3_assets.glue.partitions import SAMPLE_SHARDS

PER_SHARD = {"prompts", "raw_responses", "validated_traces", "hidden_states"}
CHECKS = {
    ("hidden_states", "states_finite"),
    ("hidden_states", "states_match_traces"),
    ("hidden_states", "final_state_reproduces_logits"),
    ("hidden_states", "aux_states_match_layer_ids"),
    ("prompts", "prompts_present"),
    ("prompts", "rejected_rows_rare"),
    ("raw_responses", "one_row_per_prompt"),
    ("raw_responses", "reasoning_present"),
    ("validated_traces", "traces_present"),
    ("validated_traces", "reasoning_present"),
    ("validated_traces", "responses_accounted"),
    ("validated_traces", "loss_mask_aligned"),
    ("validated_traces", "truncation_rate_low"),
    ("validated_traces", "think_markers_absent"),
    ("validated_traces", "request_errors_rare"),
    ("validated_traces", "prompts_fit_context"),
    ("vocab_mapping", "draft_vocab_covers_targets"),
    ("draft_checkpoint", "config_complete"),
    ("draft_checkpoint", "loads_in_vllm"),
    ("draft_checkpoint", "loss_decreased"),
    ("draft_evaluation", "acceptance_above_floor"),
    ("refinement_round", "refined_not_worse"),
}
WHOLE_DATASET = {"vocab_mapping", "draft_checkpoint", "draft_evaluation"}


def test_definitions_load_with_assets_partitions_and_checks():
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert PER_SHARD <= keys
    for name in PER_SHARD:
        partitions = graph.get(AssetKey(name)).partitions_def
        assert isinstance(partitions, DynamicPartitionsDefinition) and partitions.name == SAMPLE_SHARDS
    checks = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert CHECKS <= checks
    assert AssetCheckKey(AssetKey("prompts"), "prompts_present") in graph.asset_check_keys
    assert WHOLE_DATASET <= keys
    for name in WHOLE_DATASET:
        assert graph.get(AssetKey(name)).partitions_def is None


def test_definitions_are_loadable_with_every_resource_sensors_need():
    from dagster import Definitions

    Definitions.validate_loadable(defs)
    sensors = {s.name for s in defs.sensors}
    assert {"gate_failure_alert", "run_failure_alert", "vllm_server_health", "new_prompt_shards", "deployed_draft_watch"} <= sensors


def test_the_deployed_draft_follows_evaluation_and_its_servers_come_from_the_environment(monkeypatch):
    from eagle3_assets.definitions import default_resources

    node = defs.resolve_asset_graph().get(AssetKey("deployed_draft"))
    assert node.group_name == "production" and {AssetKey("draft_checkpoint"), AssetKey("draft_evaluation")} <= set(node.parent_keys)
    monkeypatch.setenv("EAGLE3_PRODUCTION_URLS", "http://serve-a:8000, http://serve-b:8000")
    monkeypatch.setenv("EAGLE3_PRODUCTION_API_KEY", "not-in-any-log")
    servers = default_resources()["production_servers"]
    assert servers.base_urls == ["http://serve-a:8000", "http://serve-b:8000"]
    assert "not-in-any-log" not in repr(servers.model_dump())  # an EnvVar until the sensor runs


def test_every_asset_has_a_stage_group_and_description():
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.group_name in {"planning", "generation", "validation", "extraction", "training", "evaluation", "production"}, key
        assert node.description, f"{key} has no description"


def test_validation_gates_that_protect_downstream_are_blocking():
    from eagle3_assets.definitions import default_resources

    assert "target_model" in default_resources()
    node = defs.resolve_asset_graph().get(AssetKey("validated_traces"))
    assert node.group_name == "validation"
    assert {AssetKey("prompts"), AssetKey("raw_responses")} <= set(node.parent_keys)
    specs = {spec.name: spec for spec in defs.resolve_assets_def(AssetKey("validated_traces")).check_specs}
    assert {n for n, s in specs.items() if s.blocking} == {
        "traces_present", "reasoning_present", "responses_accounted", "loss_mask_aligned", "request_errors_rare",
    }  # fmt: skip
    assert not specs["prompts_fit_context"].blocking  # a prompt that can never fit does not block the shard by itself


def test_generation_runs_in_its_pool_against_the_servers_named_in_the_environment(monkeypatch):
    from eagle3_assets.definitions import default_resources
    from resources.vllm_server import GENERATION_POOL

    monkeypatch.setenv("EAGLE3_VLLM_URLS", "http://gpu-a:8000, http://gpu-b:8000")
    monkeypatch.setenv("EAGLE3_SERVED_MODEL", "kimi-k2")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("EAGLE3_TARGET_MODEL", "/models/kimi-k2")
    server = default_resources()["vllm_server"]
    assert server.base_urls == ["http://gpu-a:8000", "http://gpu-b:8000"] and server.served_model_name == "kimi-k2"
    # max_tokens unset: each shard's run takes what the target's context leaves, up to 8,192 (raw_responses.default_max_tokens).
    assert (server.concurrency, server.max_tokens, server.read_timeout_s, server.api_key) == (128, None, 1800.0, None)
    # The demo's target (`make dev` beside `make serve-demo`): its sampling, within its 4,096-token context.
    monkeypatch.setenv("EAGLE3_TARGET_MODEL", "demo")
    demo = default_resources()["vllm_server"]
    assert (demo.concurrency, demo.max_tokens, demo.base_urls) == (64, 256, server.base_urls)
    raw = defs.resolve_assets_def(AssetKey("raw_responses"))
    assert raw.op.pool == GENERATION_POOL
    assert {s.name for s in raw.check_specs if s.blocking} == {"one_row_per_prompt", "reasoning_present"}
    assert defs.resolve_asset_graph().get(AssetKey("raw_responses")).parent_keys == {AssetKey("prompts")}


def test_the_gpu_host_and_its_readiness_job_are_defined():
    from eagle3_assets.definitions import default_resources
    from resources.gpu_host import GPUHost

    assert isinstance(default_resources()["gpu_host"], GPUHost)
    job = defs.resolve_job_def("gpu_host_ready")
    assert {node.name for node in job.nodes} == {"gpu_host_preflight"}


def test_hidden_states_gates_block_training_and_the_stage_runs_in_the_gpu_pool():
    from resources.gpu_host import GPU_POOL, STAGE_REQUIREMENTS

    graph = defs.resolve_asset_graph()
    node = graph.get(AssetKey("hidden_states"))
    assert node.group_name == "extraction" and AssetKey("validated_traces") in node.parent_keys
    assert AssetKey("hidden_states") in graph.get(AssetKey("draft_checkpoint")).parent_keys
    assets_def = defs.resolve_assets_def(AssetKey("hidden_states"))
    assert assets_def.op.pool == GPU_POOL
    assert {s.name for s in assets_def.check_specs if s.blocking} == {
        "target_matches_traces",
        "states_finite",
        "states_match_traces",
        "final_state_reproduces_logits",
        "aux_states_match_layer_ids",
    }
    assert "extract_hidden_states" in STAGE_REQUIREMENTS


def test_training_assets_cover_every_shard_and_gate_the_export_with_vllm():
    from eagle3_assets.definitions import default_resources
    from eagle3_assets.graph import WHOLE_DATASET_ASSETS
    from resources.gpu_host import GPU_POOL, STAGE_REQUIREMENTS

    assert {k.to_user_string() for a in WHOLE_DATASET_ASSETS for k in a.keys} == WHOLE_DATASET
    assert {"target_model", "gpu_host"} <= set(default_resources())
    graph = defs.resolve_asset_graph()
    for name in WHOLE_DATASET:
        node = graph.get(AssetKey(name))
        assert node.partitions_def is None
        assert node.group_name == ("evaluation" if name == "draft_evaluation" else "training")
    assert AssetKey("validated_traces") in graph.get(AssetKey("vocab_mapping")).parent_keys
    # validated_traces: what bounded-disk mode reads instead of stored hidden_states (draft_checkpoint.streamed_states).
    assert graph.get(AssetKey("draft_checkpoint")).parent_keys == {AssetKey("hidden_states"), AssetKey("validated_traces"), AssetKey("vocab_mapping")}
    specs = {s.name: s for s in defs.resolve_assets_def(AssetKey("draft_checkpoint")).check_specs}
    assert {n for n, s in specs.items() if s.blocking} == {"config_complete", "loads_in_vllm"}
    assert not any(s.blocking for s in defs.resolve_assets_def(AssetKey("vocab_mapping")).check_specs)
    assert defs.resolve_assets_def(AssetKey("draft_checkpoint")).op.pool == GPU_POOL
    assert "train_draft" in STAGE_REQUIREMENTS and "train_draft_bounded" not in STAGE_REQUIREMENTS  # one training stage, both modes


def test_evaluation_runs_on_the_gpu_host_after_the_draft_and_gates_on_acceptance():
    from resources.gpu_host import GPU_POOL, STAGE_REQUIREMENTS

    graph = defs.resolve_asset_graph()
    assert graph.get(AssetKey("draft_evaluation")).parent_keys == {AssetKey("draft_checkpoint")}
    assets_def = defs.resolve_assets_def(AssetKey("draft_evaluation"))
    assert assets_def.op.pool == GPU_POOL
    assert "evaluate_draft" in STAGE_REQUIREMENTS
    (spec,) = assets_def.check_specs
    assert spec.name == "acceptance_above_floor" and not spec.blocking  # nothing is downstream; the UI and alerts show it


def test_a_refinement_round_runs_on_the_gpu_host_after_the_draft_and_blocks_a_worse_draft():
    from eagle3_assets.graph import WHOLE_DATASET_ASSETS
    from resources.gpu_host import GPU_POOL, STAGE_REQUIREMENTS

    graph = defs.resolve_asset_graph()
    assert graph.get(AssetKey("refinement_round")).parent_keys == {AssetKey("draft_checkpoint")}
    assert graph.get(AssetKey("refinement_round")).group_name == "training"
    assets_def = defs.resolve_assets_def(AssetKey("refinement_round"))
    assert assets_def.op.pool == GPU_POOL and STAGE_REQUIREMENTS["refine_draft"].serves_target
    (spec,) = assets_def.check_specs
    assert spec.name == "refined_not_worse" and spec.blocking
    # Materialised once per round by hand, never by a whole-dataset run (the demo's included).
    assert AssetKey("refinement_round") not in {k for a in WHOLE_DATASET_ASSETS for k in a.keys}


PARTIAL_OVERRIDE = """
from dagster import asset, materialize
from eagle3_assets.definitions import default_resources
from resources.vllm_server import VLLMServerResource

seen = {}

@asset
def probe(vllm_server: VLLMServerResource):
    seen.update(urls=vllm_server.base_urls, model=vllm_server.served_model_name, max_tokens=vllm_server.max_tokens,
                key=vllm_server.generation_config().api_key)

materialize([probe], resources={"vllm_server": default_resources()["vllm_server"]},
            run_config={"resources": {"vllm_server": {"config": {"max_tokens": 64}}}})
print(seen)
"""


def test_a_launchpad_override_of_one_field_keeps_the_servers_and_key_from_the_environment(tmp_path):
    """Run config replaces the resource's Python values as a whole: the environment must be the schema's default."""
    import ast
    import os
    import subprocess
    import sys

    env = {**os.environ, "EAGLE3_VLLM_URLS": "http://gpu-a:8000,http://gpu-b:8000", "EAGLE3_SERVED_MODEL": "kimi-k2",
           "VLLM_API_KEY": "sk-test-only", "DAGSTER_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", PARTIAL_OVERRIDE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert seen == {"urls": ["http://gpu-a:8000", "http://gpu-b:8000"], "model": "kimi-k2", "max_tokens": 64, "key": "sk-test-only"}
    assert "sk-test-only" not in out.stderr


def test_the_embedded_default_is_a_plug_in_selected_here_only(monkeypatch):
    """Where the environment names no target or prompts the demo plug-in serves; a user's own gets the platform's classes."""
    import re
    from pathlib import Path

    from eagle3_assets.definitions import default_resources
    from eagle3_assets.demo.plugin import DemoPromptDataset, DemoTargetModel
    from resources.prompt_dataset import PromptDataset
    from resources.target_model import TargetModel

    monkeypatch.delenv("EAGLE3_TARGET_MODEL", raising=False)
    monkeypatch.delenv("EAGLE3_PROMPTS", raising=False)
    monkeypatch.delenv("EAGLE3_SHARD_SIZE", raising=False)
    resources = default_resources()
    assert isinstance(resources["target_model"], DemoTargetModel) and isinstance(resources["prompt_dataset"], DemoPromptDataset)
    assert (resources["prompt_dataset"].shard_size, resources["prompt_dataset"].holdout_share) == (64, 0.0)
    monkeypatch.setenv("EAGLE3_TARGET_MODEL", "/models/kimi-k2")
    monkeypatch.setenv("EAGLE3_PROMPTS", "/data/prompts.jsonl")
    resources = default_resources()
    assert type(resources["target_model"]) is TargetModel and resources["target_model"].path == "/models/kimi-k2"
    assert type(resources["prompt_dataset"]) is PromptDataset and resources["prompt_dataset"].source == "/data/prompts.jsonl"
    assert (resources["prompt_dataset"].shard_size, resources["prompt_dataset"].holdout_share) == (128, 0.01)

    root = Path(__file__).resolve().parents[1]
    knowing = []
    for path in sorted(p for d in ("eagle3_assets", "resources", "sensors") for p in (root / d).rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("eagle3_assets/demo/") or relative == "eagle3_assets/definitions.py":
            continue
        if re.search("demo", path.read_text(), re.IGNORECASE):
            knowing.append(relative)
    assert knowing == [], f"outside demo/, only definitions.py may know of the embedded default: {knowing}"
