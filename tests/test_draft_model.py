"""The draft model, in each of its forms, against vLLM's own EAGLE-3 module, and the draft vocabulary map.

The forward test runs vLLM's ``Eagle3LlamaForCausalLM`` (Llama form, beside
the tiny Llama target) and ``Eagle3DeepseekV2ForCausalLM`` (MLA form, beside
the Kimi-family target) in a subprocess (tests/vllm_eagle3_reference.py:
vLLM's code end to end except its paged attention kernel, replaced there by
plain causal attention over a KV cache) on the very files our exporter wrote,
replaying vLLM's drafting chain by chain, and compares its logits with our
training-time-test unroll, which computes every chain at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.core.draft.forms import DEEPSEEK_MLA, LLAMA, draft_config_for_target, new_draft
from eagle3_assets.core.draft.model import Eagle3Draft
from eagle3_assets.core.draft.export import ARCHITECTURES, export_draft
from eagle3_assets.core.target.head import load_head_weights
from eagle3_assets.core.training.loss import shift_left
from eagle3_assets.core.draft.vocab import build_vocab_mapping, count_supervised_tokens, coverage, load_vocab_mapping, save_vocab_mapping

REFERENCE = Path(__file__).with_name("vllm_eagle3_reference.py")


def random_draft(target_dir: Path, draft_vocab_size: int, seed: int, form: str = LLAMA) -> Eagle3Draft:
    """A draft of ``form`` with random weights everywhere (norms too) and a non-trivial vocabulary map."""
    generator = torch.Generator().manual_seed(seed)
    target_config = json.loads((target_dir / "config.json").read_text())
    counts = torch.randint(0, 1000, (target_config["vocab_size"],), generator=generator)
    mapping = build_vocab_mapping(counts, draft_vocab_size)
    torch.manual_seed(seed)
    draft = new_draft(draft_config_for_target(form, target_config, draft_vocab_size, [2, 3, 4]))
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=generator)
        draft.embed_tokens.weight.copy_(load_head_weights(target_dir)["embed"])
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    return draft


@pytest.mark.parametrize(
    ("form", "target_fixture", "vllm_class"),
    [(LLAMA, "tiny_target", "Eagle3LlamaForCausalLM"), (DEEPSEEK_MLA, "kimi_target", "Eagle3DeepseekV2ForCausalLM")],
)
def test_unrolled_forward_matches_vllm_eagle3_module_step_by_step(form, target_fixture, vllm_class, request, tmp_path):
    target = request.getfixturevalue(target_fixture)
    draft = random_draft(target, draft_vocab_size=300, seed=3, form=form)
    assert draft.form == form
    draft_dir = export_draft(draft, tmp_path / "draft", dtype="float32", target_embedding=draft.embed_tokens.weight)
    assert json.loads((draft_dir / "config.json").read_text())["architectures"] == [ARCHITECTURES[form]]
    assert "embed_tokens.weight" not in load_file(str(draft_dir / "model.safetensors"))  # vLLM shares the target's

    length, steps = 18, 3
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, draft.config.vocab_size, (length,), generator=generator)
    aux = torch.randn(length, 3 * draft.config.target_hidden_size, generator=generator)
    save_file({"aux": aux, "input_ids": input_ids}, str(tmp_path / "inputs.safetensors"))
    done = subprocess.run(
        [sys.executable, str(REFERENCE), str(target), str(draft_dir), str(tmp_path / "inputs.safetensors"), str(steps), str(tmp_path / "out.safetensors")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"reference module: {vllm_class}" in done.stdout  # the form's own vLLM class ran
    reference = load_file(str(tmp_path / "out.safetensors"))["logits"]  # [chains, steps, target vocab]

    with torch.no_grad():
        hidden, cache = draft.fuse(aux[None]), []
        positions = torch.arange(length)[None]
        for k in range(steps):
            logits, hidden = draft.step(shift_left(input_ids[None], 1 + k), hidden, positions + k, cache)
            ours = draft.target_vocab_logits(logits)[0, : reference.shape[0]]
            theirs = reference[:, k]
            assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), f"step {k}: draft vocabulary scattered differently"
            finite = torch.isfinite(theirs)
            assert finite.sum() == reference.shape[0] * 300
            torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-4, atol=1e-4, msg=f"step {k}")


def test_d2t_and_t2d_from_a_hand_made_frequency_table(tmp_path):
    #                      id: 0  1  2  3  4  5  6  7  8  9
    counts = torch.tensor([5, 0, 7, 7, 1, 0, 3, 7, 2, 0])
    mapping = build_vocab_mapping(counts, 4)
    # The four most frequent: 2, 3, 7 (7 each), then 0 (5); sorted by id.
    assert mapping.draft_to_target.tolist() == [0, 2, 3, 7]
    assert mapping.d2t.tolist() == [0, 1, 1, 4] and mapping.d2t.dtype == torch.int64
    assert mapping.t2d.tolist() == [True, False, True, True, False, False, False, True, False, False]
    assert coverage(counts, mapping) == pytest.approx(26 / 32)
    target_to_draft = [-1] * mapping.target_vocab_size  # draft id of every target id, -1 where it has none
    for draft_id, target_id in enumerate(mapping.draft_to_target.tolist()):
        target_to_draft[target_id] = draft_id
    assert target_to_draft == [0, -1, 1, 2, -1, -1, -1, 3, -1, -1]

    # Ties go to the smaller id: of 2, 3 and 7 (7 each) two are kept.
    assert build_vocab_mapping(counts, 2).draft_to_target.tolist() == [2, 3]
    # Unseen ids fill up by id once the seen ones run out.
    assert build_vocab_mapping(counts, 8).draft_to_target.tolist() == [0, 1, 2, 3, 4, 6, 7, 8]
    with pytest.raises(ValueError, match="draft_vocab_size 11"):
        build_vocab_mapping(counts, 11)

    path = save_vocab_mapping(tmp_path, mapping, {"coverage": 26 / 32})
    again = load_vocab_mapping(path)
    assert torch.equal(again.d2t, mapping.d2t) and torch.equal(again.t2d, mapping.t2d)
    assert json.loads((tmp_path / "vocab_mapping.json").read_text())["draft_vocab_size"] == 4
    save_file({"d2t": mapping.d2t, "t2d": torch.zeros(10, dtype=torch.bool)}, str(path))
    with pytest.raises(ValueError, match="do not describe the same"):
        load_vocab_mapping(path)


def test_supervised_token_counts_use_only_the_loss_mask():
    traces = pl.DataFrame(
        {"id": ["a", "b"], "input_ids": [[1, 2, 3, 3], [3, 4, 5]], "loss_mask": [[0, 1, 1, 1], [1, 0, 1]]},
        schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)},
    )
    assert count_supervised_tokens(traces, 6).tolist() == [0, 0, 1, 3, 0, 1]
    broken = traces.with_columns(pl.Series("loss_mask", [[0, 1], [1, 0, 1]], dtype=pl.List(pl.Int8)))
    with pytest.raises(ValueError, match="different lengths .*'a'"):
        count_supervised_tokens(broken, 6)
    with pytest.raises(ValueError, match="outside the target vocabulary of 5"):
        count_supervised_tokens(traces, 5)


def test_vocab_mapping_asset_counts_every_shard_and_warns_on_low_coverage(tiny_target, data_dir):
    from dagster import AssetCheckSeverity, DagsterInstance, RunConfig, materialize

    from eagle3_assets.partitions import register_shards
    from eagle3_assets.vocab_mapping import VocabMappingConfig, vocab_mapping
    from resources.target_model import TargetModel
    from tests.demo_hidden_states import write_validated_traces

    write_validated_traces(tiny_target, data_dir, ["shard-00000", "shard-00001"], count=12)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, ["shard-00000", "shard-00001"])
    resources = {"target_model": TargetModel(path=str(tiny_target))}

    def run(size: int):
        config = RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=size)})
        return materialize([vocab_mapping], resources=resources, instance=instance, run_config=config, raise_on_error=False)

    result = run(40)  # fewer ids than the traces use: coverage falls below 95 %, a warning, not a failure
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "draft_vocab_covers_targets" and not check.passed and check.severity == AssetCheckSeverity.WARN
    assert check.metadata["coverage"].value < 0.95 and check.metadata["most_frequent_uncovered_ids"].value
    summary = json.loads((data_dir / "vocab_mapping" / "vocab_mapping.json").read_text())
    assert summary["draft_vocab_size"] == 40 and summary["samples"] == 24 and summary["coverage"] == check.metadata["coverage"].value
    assert load_vocab_mapping(data_dir / "vocab_mapping").draft_vocab_size == 40

    result = run(400)
    assert result.get_asset_check_evaluations()[0].passed

    register_shards(instance, ["shard-00002"])  # registered, but validated_traces never ran for it
    result = run(400)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    assert "validated_traces has no output for shards ['shard-00002']" in failure.step_failure_data.error.to_string()
