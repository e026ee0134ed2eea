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

import itertools
import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_assets.core.draft.forms import DEEPSEEK_MLA, LLAMA, draft_config_for_target, new_draft
from eagle3_assets.core.draft.model import DraftConfig, Eagle3Draft
from eagle3_assets.core.draft.model_mla import MLADraftConfig
from eagle3_assets.core.draft.export import ARCHITECTURES, export_draft
from eagle3_assets.core.target.head import load_head_weights
from eagle3_assets.core.training.loss import shift_left
from eagle3_assets.core.draft.vocab import build_vocab_mapping, count_supervised_tokens, coverage, load_vocab_mapping, save_vocab_mapping

REFERENCE = Path(__file__).with_name("vllm_eagle3_reference.py")


def random_draft(target_dir: Path, draft_vocab_size: int, seed: int, form: str = LLAMA, **norm_flags: bool) -> Eagle3Draft:
    """A draft of ``form`` (with ``norm_flags``) with random weights everywhere (norms too) and a non-trivial vocabulary map."""
    generator = torch.Generator().manual_seed(seed)
    target_config = json.loads((target_dir / "config.json").read_text())
    counts = torch.randint(0, 1000, (target_config["vocab_size"],), generator=generator)
    mapping = build_vocab_mapping(counts, draft_vocab_size)
    torch.manual_seed(seed)
    draft = new_draft(draft_config_for_target(form, target_config, draft_vocab_size, [2, 3, 4], **norm_flags))
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=generator)
        draft.embed_tokens.weight.copy_(load_head_weights(target_dir)["embed"])
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    return draft


def norm_combinations(form: str) -> list[dict[str, bool]]:
    """Every combination of the norm flags the form's vLLM class reads that vLLM builds (not fc_norm with norm_before_fc)."""
    flags = (MLADraftConfig if form == DEEPSEEK_MLA else DraftConfig).norm_flags
    combos = [dict(zip(flags, values)) for values in itertools.product([False, True], repeat=len(flags))]
    return [c for c in combos if not (c.get("fc_norm") and c.get("norm_before_fc"))]


@pytest.mark.parametrize(
    ("form", "target_fixture", "vllm_class"),
    [(LLAMA, "tiny_target", "Eagle3LlamaForCausalLM"), (DEEPSEEK_MLA, "kimi_target", "Eagle3DeepseekV2ForCausalLM")],
)
def test_unrolled_forward_matches_vllm_eagle3_module_step_by_step(form, target_fixture, vllm_class, request, tmp_path):
    """Plain EAGLE-3 and every norm combination of the form (EAGLE 3.1: fc_norm + norm_output), one vLLM process for all."""
    target = request.getfixturevalue(target_fixture)
    combos = norm_combinations(form)
    assert len(combos) == (12 if form == LLAMA else 8)
    length, steps = 18, 3
    generator = torch.Generator().manual_seed(0)
    drafts, runs = [], []
    for i, flags in enumerate(combos):
        draft = random_draft(target, draft_vocab_size=300, seed=3, form=form, **flags)
        assert draft.form == form
        draft_dir = export_draft(draft, tmp_path / f"draft-{i}", dtype="float32", target_embedding=draft.embed_tokens.weight)
        config = json.loads((draft_dir / "config.json").read_text())
        assert config["architectures"] == [ARCHITECTURES[form]] and {f: config[f] for f in flags} == flags
        weights = load_file(str(draft_dir / "model.safetensors"))
        assert "embed_tokens.weight" not in weights  # vLLM shares the target's
        assert ("fc_norm.2.weight" in weights, "input_norm.weight" in weights) == (flags["fc_norm"], flags.get("norm_before_fc", False))
        drafts.append(draft)
        runs += [str(draft_dir), str(tmp_path / f"out-{i}.safetensors")]
    input_ids = torch.randint(0, drafts[0].config.vocab_size, (length,), generator=generator)
    aux = torch.randn(length, 3 * drafts[0].config.target_hidden_size, generator=generator)
    save_file({"aux": aux, "input_ids": input_ids}, str(tmp_path / "inputs.safetensors"))
    done = subprocess.run(
        [sys.executable, str(REFERENCE), str(target), str(tmp_path / "inputs.safetensors"), str(steps), *runs],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    for i, (flags, draft) in enumerate(zip(combos, drafts)):
        # The form's own vLLM class ran, and read from config.json exactly the flags the draft has.
        read = {f: flags.get(f, False) for f in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")}
        assert f"reference module: {vllm_class} {json.dumps(read)}" in done.stdout, (flags, done.stdout[-2000:])
        reference = load_file(str(tmp_path / f"out-{i}.safetensors"))["logits"]  # [chains, steps, target vocab]
        with torch.no_grad():
            hidden, cache = draft.fuse(aux[None]), []
            positions = torch.arange(length)[None]
            for k in range(steps):
                logits, hidden = draft.step(shift_left(input_ids[None], 1 + k), hidden, positions + k, cache)
                ours = draft.target_vocab_logits(logits)[0, : reference.shape[0]]
                theirs = reference[:, k]
                assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), f"{flags} step {k}: draft vocabulary scattered differently"
                finite = torch.isfinite(theirs)
                assert finite.sum() == reference.shape[0] * 300
                torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-4, atol=1e-4, msg=f"{flags} step {k}")


def test_each_norm_flag_changes_the_drafts_logits(tiny_target):
    """The comparison above can fail: every flag alone changes what the draft computes from the same weights."""
    generator = torch.Generator().manual_seed(0)
    aux, ids = torch.randn(1, 12, 192, generator=generator) * 5, torch.randint(0, 640, (1, 12), generator=generator)

    def unrolled(**flags) -> torch.Tensor:
        draft, cache, out = random_draft(tiny_target, 300, seed=3, **flags), [], []
        with torch.no_grad():
            hidden = draft.fuse(aux)
            for k in range(3):
                logits, hidden = draft.step(shift_left(ids, 1 + k), hidden, torch.arange(12)[None] + k, cache)
                out.append(logits)
        return torch.stack(out)

    plain = unrolled()
    for flag in DraftConfig.norm_flags:
        changed = unrolled(**{flag: True})
        assert not torch.allclose(changed, plain, rtol=1e-3, atol=1e-3), flag
    # norm_output acts from the second step on: the first step's logits are plain EAGLE-3's.
    torch.testing.assert_close(unrolled(norm_output=True)[0], plain[0])
    with pytest.raises(ValueError, match="fc_norm and norm_before_fc exclude each other"):
        random_draft(tiny_target, 300, seed=3, fc_norm=True, norm_before_fc=True)


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

    from eagle3_assets.glue.partitions import register_shards
    from eagle3_assets.defs.vocab_mapping import VocabMappingConfig, vocab_mapping
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

    # Registered, but validated_traces never ran for it: left out and said why, never waited for.
    register_shards(instance, ["shard-00002"])
    result = run(400)
    assert result.success
    metadata = next(e.materialization.metadata for e in result.get_asset_materialization_events())
    assert metadata["shards_used"].value == ["shard-00000", "shard-00001"]
    assert list(metadata["shards_left_out"].value) == ["shard-00002"] and "no output" in str(metadata["shards_left_out"].value["shard-00002"])
