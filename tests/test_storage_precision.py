"""Storage precision of ``hidden_states``: bf16 and the 8-bit format, end to end.

Each precision goes through the shared part writer (transformers backend
here; the vLLM backend's 8-bit test is in test_extraction.py, beside its
engine), the gates, training and export. The 8-bit format stores e4m3 codes
with a float32 scale per token and state; its rounding is bounded by
:func:`storage_unit_roundoff`, which the logits gate's tie rule uses, so that
bound is checked here against real rounding, not assumed.
"""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from dagster import DagsterInstance, RunConfig, materialize
from safetensors import safe_open

from eagle3_assets.core.draft.export import read_draft_dir
from eagle3_assets.core.extraction.part_files import HiddenStateFileError, dequantise_rows, quantise_rows, verify_part
from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
from eagle3_assets.core.extraction.shard_reading import iter_samples, read_sidecar
from eagle3_assets.core.extraction.traces import TargetFacts, read_traces
from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
from eagle3_assets.core.storage.shard_paths import SIDECAR
from eagle3_assets.core.extraction.hidden_state_checks import (
    rounding_margin,
    check_aux_states_match_layer_ids,
    check_final_state_reproduces_logits,
    check_states_finite,
    check_states_match_traces,
    storage_unit_roundoff,
)
from eagle3_assets.core.extraction.job import ExtractionRecipe
from eagle3_assets.core.extraction.state_layout import FP8_DTYPE, bytes_per_token, state_bytes_per_token
from eagle3_assets.core.target.head import TargetHead
from eagle3_assets.core.training.checkpoints import export_trained_draft
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import index_hidden_states
from eagle3_assets.core.training.launch import run_training
from tests.extraction_helpers import write_validated_traces
from tests.test_extraction import one_torch_thread  # noqa: F401  the same autouse fixture: one torch thread for this module
from tests.test_training import mapping_from_hidden_states

LAYER_IDS = (2, 3, 4)  # vLLM's default for the tiny target: the exported draft then needs no override
HIDDEN = 64
SHARD = "shard-00000"
PRECISIONS = ("bfloat16", FP8_DTYPE)


@pytest.fixture(scope="module")
def traces(tiny_target, tmp_path_factory):
    path = write_validated_traces(tmp_path_factory.mktemp("traces"), SHARD, tiny_target, count=12)
    return read_traces(path, TargetFacts.from_path(tiny_target).vocab_size)


@pytest.fixture(scope="module")
def backend(tiny_target):
    return TransformersBackend(tiny_target, LAYER_IDS, ExtractionRecipe(max_batch_size=8))


def settings(tiny_target, dtype: str, part_bytes: int = 60_000) -> ExtractionSettings:
    return ExtractionSettings(str(tiny_target), "tiny-target", LAYER_IDS, dtype=dtype, part_bytes=part_bytes)


def row_relative_errors(stored: torch.Tensor, reference: torch.Tensor, width: int) -> torch.Tensor:
    """|stored - reference| / |reference| per token and per state (rows of ``width``)."""
    stored = stored.float().reshape(stored.shape[0], -1, width)
    reference = reference.float().reshape(reference.shape[0], -1, width)
    return (stored - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)


@pytest.mark.parametrize("dtype", PRECISIONS)
def test_each_precision_round_trips_through_extraction_gates_training_and_export(dtype, tmp_path, tiny_target, traces, backend):
    shard = tmp_path / "hidden_states" / SHARD
    report = extract_shard(traces, shard, settings(tiny_target, dtype), backend)
    assert report.parts > 1  # the checksums and the reader cover every part, not just one

    # The sidecar records the precision; the part files say it themselves.
    sidecar = read_sidecar(shard, expected_layer_ids=LAYER_IDS)
    assert sidecar["dtype"] == dtype and all(len(f["sha256"]) == 64 for f in sidecar["files"])
    with safe_open(str(shard / "part-00000.safetensors"), framework="pt") as part:
        names = set(part.keys())
        assert part.get_slice("aux_hidden_states").get_dtype() == ("F8_E4M3" if dtype == FP8_DTYPE else "BF16")
        if dtype == FP8_DTYPE:
            assert {"aux_scales", "final_scales"} <= names and "scales" in sidecar
            assert part.get_tensor("aux_scales").shape[1] == 3 and part.get_tensor("final_scales").shape[1] == 1
        else:
            assert not {"aux_scales", "final_scales"} & names and "scales" not in sidecar
    # Bytes per token as planned: 8-bit states are half of bf16's, plus 16 bytes of scales.
    assert state_bytes_per_token(HIDDEN, dtype) == (8 * HIDDEN if dtype == "bfloat16" else 4 * HIDDEN + 16)
    header_bytes = report.bytes_on_disk - report.tokens * bytes_per_token(HIDDEN, dtype)
    assert 0 < header_bytes < 4096 * report.parts

    # What readers get is within the format's rounding of the target's own states (an fp32 forward).
    unit = storage_unit_roundoff(dtype, HIDDEN)
    worst = 0.0
    for sample in iter_samples(shard):
        _, hidden = backend.reference_forward(sample.input_ids)
        reference = torch.cat([hidden[k] for k in LAYER_IDS], dim=-1)
        worst = max(worst, float(row_relative_errors(sample.aux, reference, HIDDEN).max()))
        worst = max(worst, float(row_relative_errors(sample.final, hidden[-1], HIDDEN).max()))
    assert 0 < worst <= unit, (worst, unit)

    # The gates pass, at full agreement once ties within the format's rounding are forgiven.
    head = TargetHead.from_checkpoint(tiny_target)
    assert check_states_finite(shard).passed
    assert check_states_match_traces(shard, traces).passed
    logits = check_final_state_reproduces_logits(shard, head, backend.reference_argmax, samples=12)
    assert logits.passed and logits.metadata["argmax_agreement"] == 1.0, logits.description
    layers = check_aux_states_match_layer_ids(
        shard, LAYER_IDS, TargetFacts.from_path(tiny_target), lambda ids: backend.reference_forward(ids)[1], samples=4
    )
    assert layers.passed, layers.description

    # Training reads it (dequantised to float32) and the export is a vLLM draft at the same layer ids.
    mapping = mapping_from_hidden_states([shard], 200, tmp_path)
    index = index_hidden_states([shard])
    assert len(index.samples) == len(traces)
    config = TrainConfig(
        hidden_state_dirs=[str(shard)], vocab_mapping=str(mapping), target_path=str(tiny_target),
        training_dir=str(tmp_path / "training"), epochs=1, learning_rate=2e-3, ttt_steps=2, batch_tokens=256,
        max_seq_len=40, seed=7, log_every=1,
    )  # fmt: skip
    result = run_training(config)
    history = json.loads((tmp_path / "training" / "history.json").read_text())["history"]
    assert result["epochs_done"] == 1 and history and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    exported = export_trained_draft(result["checkpoint"], tiny_target, tmp_path / "draft")
    config_json, tensors = read_draft_dir(exported)
    assert config_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(LAYER_IDS)
    assert tensors["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)


def test_the_8bit_bound_holds_for_real_rounding_and_covers_every_logit_gap_it_moves(tiny_target):
    """The tie rule forgives flips only within the bound, so the bound must hold: post- and pre-norm, over magnitudes."""
    head = TargetHead.from_checkpoint(tiny_target)
    generator = torch.Generator().manual_seed(0)
    # Rows spanning orders of magnitude, with heavy-tailed elements (many far below the row's max: e4m3 subnormals).
    states = torch.randn(4096, HIDDEN, generator=generator) ** 3 * 10 ** (torch.rand(4096, 1, generator=generator) * 6 - 3)
    codes, scales = quantise_rows(states, HIDDEN)
    rounded = dequantise_rows(codes, scales)
    unit = storage_unit_roundoff(FP8_DTYPE, HIDDEN)
    errors = row_relative_errors(rounded, states, HIDDEN)
    assert float(errors.max()) <= unit and float(errors.max()) > unit / 4  # sharp enough to matter

    first, second = torch.randint(0, 640, (2, 4096), generator=generator)
    gap = lambda h: ((head.lm_head[first] - head.lm_head[second]) * h).sum(-1)  # noqa: E731
    for final_state in ("post_norm", "pre_norm"):
        normed_true = head.normed(states, final_state)
        normed_stored = head.normed(rounded, final_state)  # what the gate sees: the stored state, normed
        moved = (gap(normed_stored) - gap(normed_true)).abs()
        margin = rounding_margin(head, normed_stored, first, second, FP8_DTYPE)
        assert bool((moved <= margin).all()), final_state
        assert bool((rounding_margin(head, normed_stored, first, second, "bfloat16") <= margin / 15).all())  # 2^-9 against 2^-4


def test_non_finite_states_stay_non_finite_in_8bit_storage():
    """An 8-bit code has no Inf: a row holding NaN or Inf must still read back non-finite, or states_finite would miss it."""
    states = torch.ones(4, 2 * HIDDEN)
    states[1, 3] = float("nan")
    states[2, HIDDEN + 5] = float("inf")
    states[3] = 0.0
    restored = dequantise_rows(*quantise_rows(states, HIDDEN))
    finite = torch.isfinite(restored).reshape(4, 2, HIDDEN).all(-1)
    assert finite.tolist() == [[True, True], [False, True], [True, False], [True, True]]
    assert torch.equal(restored[0], states[0]) and torch.equal(restored[3], states[3])


class NonFiniteTargetBackend_fault(TransformersBackend):
    """Fault injection: the target overflows (Inf) in one token's final state, as a bf16 target can."""

    def capture(self, sequences, dtype):
        captured = super().capture(sequences, dtype)
        aux, final = captured[0]
        final = final.clone()
        final[0, 0] = float("inf")
        return [(aux, final), *captured[1:]]


def test_an_overflow_in_the_target_fails_states_finite_in_8bit_storage(tmp_path, tiny_target, traces, backend):
    faulty = NonFiniteTargetBackend_fault(tiny_target, LAYER_IDS, ExtractionRecipe(max_batch_size=64), model=backend.model)
    extract_shard(traces, tmp_path / SHARD, settings(tiny_target, FP8_DTYPE, part_bytes=10**9), faulty)
    outcome = check_states_finite(tmp_path / SHARD)
    assert not outcome.passed and outcome.metadata["samples_with_non_finite"] == 1, outcome.description
    assert outcome.metadata["non_finite_values"] >= 1


def test_a_corrupted_8bit_part_fails_its_checksum_and_one_rerun_repairs_it(tmp_path, tiny_target, traces, backend):
    shard = tmp_path / SHARD
    fp8 = settings(tiny_target, FP8_DTYPE)
    extract_shard(traces, shard, fp8, backend)
    recorded = {f["name"]: f["sha256"] for f in read_sidecar(shard)["files"]}
    part = shard / "part-00001.safetensors"
    raw = part.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    codes_start = 8 + header_len + json.loads(raw[8 : 8 + header_len])["aux_hidden_states"]["data_offsets"][0]
    with open(part, "r+b") as fh:  # one 8-bit code flipped: still a valid e4m3 value, silently wrong without the checksum
        fh.seek(codes_start + 10)
        fh.write(bytes([raw[codes_start + 10] ^ 0x08]))

    with pytest.raises(HiddenStateFileError, match=rf"part {part} has sha256 .* but {SIDECAR} recorded .*rerun hidden_states for {SHARD}"):
        verify_part(part, recorded[part.name])
    with pytest.raises(HiddenStateFileError, match=r"part-00001.safetensors has sha256"):
        index_hidden_states([shard])  # training refuses before its first step

    report = extract_shard(traces, shard, fp8, backend)  # one rerun: the damaged part is set aside and extracted again
    assert report.parts_quarantined == 1 and report.parts_written == 1 and report.parts_reused == report.parts - 1
    assert {f["name"]: f["sha256"] for f in read_sidecar(shard)["files"]} == recorded
    assert list(shard.glob("part-00001.safetensors.corrupt-*")), "the damaged file is kept aside, not deleted"


def test_the_asset_records_the_precision_and_the_preflight_refuses_what_the_disk_cannot_hold(data_dir, tiny_target):
    """bf16 would not fit the host's disk, fp8 does: the pre-flight says so with both numbers, before extracting."""
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
    from eagle3_assets.glue.partitions import register_shards
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    traces_path = write_validated_traces(data_dir, SHARD, tiny_target, count=10)
    # Fault injection: the traces claim the story's token count (the states of real ones would not fit any disk
    # here), sized so that bf16 needs 1.3x the free space and fp8 0.7x of it.
    free = __import__("shutil").disk_usage(data_dir).free
    claimed = int(1.3 * free / bytes_per_token(HIDDEN, "bfloat16"))
    assert claimed * bytes_per_token(HIDDEN, FP8_DTYPE) < 0.75 * free
    frame = pl.read_parquet(traces_path)
    metadata = pl.read_parquet_metadata(traces_path)
    frame.with_columns(pl.Series("num_tokens", [claimed // len(frame)] * len(frame), dtype=pl.Int64)).write_parquet(traces_path, metadata=metadata)

    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    resources = {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()}

    def run(dtype: str):
        config = HiddenStatesConfig(dtype=dtype, cpu_threads=1, part_size_bytes=100_000)
        return materialize(
            [hidden_states], partition_key=SHARD, resources=resources, instance=instance,
            run_config=RunConfig(ops={"hidden_states": config}), raise_on_error=False,
        )  # fmt: skip

    refused = run("bfloat16")
    assert not refused.success
    (failure,) = [e for e in refused.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message + (failure.step_failure_data.user_failure_data.description or "")
    needed = (claimed // 10) * 10 * bytes_per_token(HIDDEN, "bfloat16")
    # The whole run's plan refuses first (capacity_plan.refuse_unless_run_fits), with both numbers and the way out.
    assert "the whole run does not fit" in message and f"({needed} > " in message, message
    assert "bfloat16" in message and "8-bit storage (hidden_states config dtype: float8_e4m3fn)" in message, message
    assert not (data_dir / "hidden_states" / SHARD).exists(), "nothing was extracted"

    fitted = run(FP8_DTYPE)
    assert fitted.success
    assert all(e.passed for e in fitted.get_asset_check_evaluations())
    (mat,) = fitted.asset_materializations_for_node("hidden_states")
    assert mat.metadata["dtype"].value == FP8_DTYPE and mat.metadata["data_version_inputs"].value["dtype"] == FP8_DTYPE
    assert mat.metadata["bytes_per_token_over_8H"].value < 0.6
    assert read_sidecar(data_dir / "hidden_states" / SHARD)["dtype"] == FP8_DTYPE
    logs = [e.message for e in instance.all_logs(fitted.run_id) if not e.is_dagster_event]
    assert any(f"{FP8_DTYPE}, H={HIDDEN}" in line and "tokens x" in line for line in logs), "the estimate is said before extraction"
