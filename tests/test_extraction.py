"""Hidden-state extraction: exact states at exactly the configured layers, from both backends, streamed and resumable.

The reference everywhere is an independent, unpadded, one-sample-at-a-time
transformers forward of the tiny target (``output_hidden_states=True``), not
the code under test. States are stored in float32 here so that "equal" means
fp32 rounding (max abs diff <= 1e-5). The layer ids (1, 4, 6) are not vLLM's
default for the tiny target (2, 3, 4), so a backend that ignored them fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dagster import AssetKey, DagsterInstance, RunConfig, asset, materialize
from safetensors import safe_open

from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
from eagle3_assets.core.extraction.shard_reading import iter_samples, read_sidecar
from eagle3_assets.core.extraction.traces import TargetFacts, Trace, read_traces
from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
from eagle3_assets.core.storage.shard_paths import SIDECAR
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.extraction.job import ExtractionRecipe
from eagle3_assets.core.storage.files import file_hash, stable_hash
from eagle3_assets.core.target.head import TargetHead, rms_norm
from eagle3_assets.core.extraction.hidden_state_checks import (
    rounding_margin,
    check_aux_states_match_layer_ids,
    check_final_state_reproduces_logits,
    check_states_match_traces,
)
from tests.extraction_helpers import in_process_vllm_environment, recorded_checks, recorded_materializations, write_validated_traces

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = (1, 4, 6)
NUM_LAYERS, HIDDEN = 7, 64
TOLERANCE = 1e-5
SHARD = "shard-00000"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's matrices are small: one thread is faster, and far faster on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def traces_path(tiny_target, tmp_path_factory) -> Path:
    return write_validated_traces(tmp_path_factory.mktemp("traces"), SHARD, tiny_target, count=12)


@pytest.fixture(scope="module")
def traces(traces_path, tiny_target):
    return read_traces(traces_path, TargetFacts.from_path(tiny_target).vocab_size)


@pytest.fixture(scope="module")
def independent_forward(tiny_target):
    """Per sample, unpadded: (hidden_states[0..L], the last layer's output before the final norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda _m, _i, out: captured.__setitem__("pre_norm", out[0] if isinstance(out, tuple) else out))
    results = {}

    def forward(input_ids: torch.Tensor):
        key = tuple(input_ids.tolist())
        if key not in results:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([key]), output_hidden_states=True)
            results[key] = ([h[0] for h in out.hidden_states], captured["pre_norm"].reshape(len(key), -1))
        return results[key]

    return forward


@pytest.fixture(scope="module")
def tf_backend(tiny_target):
    return TransformersBackend(tiny_target, LAYER_IDS, ExtractionRecipe(max_batch_size=8))


def settings_for(tiny_target, layer_ids=LAYER_IDS, part_bytes=4 * 60 * 1033) -> ExtractionSettings:
    # float32 storage; about four samples per part, so every shard here spans several files
    return ExtractionSettings(str(tiny_target), "tiny-target", tuple(layer_ids), dtype="float32", part_bytes=part_bytes)


def assert_equals_independent_forward(shard_dir: Path, traces, independent_forward, norm_weight=None):
    """Every stored sample's states equal the reference at exactly LAYER_IDS; returns the worst differences."""
    sidecar = read_sidecar(shard_dir)
    by_id = {t.id: t for t in traces}
    assert sorted(sidecar["sample_ids"]) == sorted(by_id)
    worst_aux = worst_final = 0.0
    for sample in iter_samples(shard_dir):
        trace = by_id[sample.id]
        assert torch.equal(sample.input_ids, trace.input_ids) and torch.equal(sample.loss_mask, trace.loss_mask)
        hidden, pre_norm = independent_forward(trace.input_ids)
        for block, layer in enumerate(LAYER_IDS):
            stored = sample.aux[:, block * HIDDEN : (block + 1) * HIDDEN]
            worst_aux = max(worst_aux, float((stored - hidden[layer]).abs().max()))
            # exactly these ids: the neighbouring layers' states are far off, so an off-by-one would fail above
            for other in (layer - 1, layer + 1):
                assert float((stored - hidden[other]).abs().max()) > 100 * TOLERANCE
        if sidecar["final_state"] == "post_norm":
            worst_final = max(worst_final, float((sample.final - hidden[NUM_LAYERS]).abs().max()))
        else:
            worst_final = max(worst_final, float((sample.final - pre_norm).abs().max()))
            normed = sample.final * torch.rsqrt(sample.final.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight
            worst_final = max(worst_final, float((normed - hidden[NUM_LAYERS]).abs().max()))
    assert worst_aux <= TOLERANCE and worst_final <= TOLERANCE, (worst_aux, worst_final)
    return worst_aux, worst_final


def test_transformers_backend_equals_an_independent_forward_at_the_configured_ids(tmp_path, tiny_target, traces, tf_backend, independent_forward):
    report = extract_shard(traces, tmp_path / SHARD, settings_for(tiny_target), tf_backend)
    assert report.parts > 1 and report.parts_written == report.parts and report.tokens == sum(t.num_tokens for t in traces)
    sidecar = read_sidecar(tmp_path / SHARD, expected_layer_ids=LAYER_IDS)
    assert sidecar["backend"] == "transformers" and sidecar["final_state"] == "post_norm" and sidecar["dtype"] == "float32"
    assert (sidecar["num_layers"], sidecar["hidden_size"], sidecar["vocab_size"]) == (NUM_LAYERS, HIDDEN, 640)
    assert sidecar["num_tokens"] == [next(t.num_tokens for t in traces if t.id == i) for i in sidecar["sample_ids"]]
    assert [f["name"] for f in sidecar["files"]] == sorted(p.name for p in (tmp_path / SHARD).glob("part-*.safetensors"))
    with safe_open(str(tmp_path / SHARD / "part-00000.safetensors"), framework="pt") as part:
        assert part.get_tensor("aux_hidden_states").shape[1] == 3 * HIDDEN and part.get_tensor("input_ids").dtype == torch.int64
        assert part.get_tensor("loss_mask").dtype == torch.int8 and part.get_tensor("sample_offsets")[0] == 0
    assert_equals_independent_forward(tmp_path / SHARD, traces, independent_forward)


def test_batch_size_does_not_change_a_samples_states(tmp_path, tiny_target, traces, tf_backend):
    lengths = sorted(t.num_tokens for t in traces)
    assert any(len({lengths[i] for i in batch}) > 1 for batch in tf_backend.batches(lengths)), "batches of 8 must hold padding"
    tf_backend.max_batch_size = 1
    try:
        extract_shard(traces, tmp_path / "one", settings_for(tiny_target), tf_backend)
    finally:
        tf_backend.max_batch_size = 8
    extract_shard(traces, tmp_path / "eight", settings_for(tiny_target), tf_backend)
    alone = {s.id: s for s in iter_samples(tmp_path / "one")}
    for batched in iter_samples(tmp_path / "eight"):
        single = alone.pop(batched.id)
        assert torch.equal(batched.input_ids, single.input_ids) and torch.equal(batched.loss_mask, single.loss_mask)
        assert float((batched.aux - single.aux).abs().max()) <= TOLERANCE
        assert float((batched.final - single.final).abs().max()) <= TOLERANCE
    assert not alone


def test_a_backend_registered_in_backends_py_alone_is_built_recorded_and_preflighted(tmp_path, tiny_target, traces, tf_backend, monkeypatch):
    """Adding an extraction backend is its class plus one entry in core/extraction/backends.py: nothing else is edited.

    The entry added here, ``shared_model``, builds a transformers backend over the model already loaded (a real
    engine) under a name of its own. The stage's ``make_backend`` builds it from the recipe's name, the shard records
    that name, and the pre-flight is asked for the entry's modules; an unregistered name is refused naming the
    registered ones. Every backend class meets the whole :class:`CaptureBackend` protocol (each member callers use).

    Mutations, each run by hand and failing this test: ``make_backend`` choosing by if-chain again (``if
    recipe.backend == "transformers": ... raise ValueError``) -> "extraction backend 'shared_model'" refused;
    ``extraction_modules`` returning ``EXTRACTION_MODULES`` without the entry's -> the modules differ;
    ``TransformersBackend.keep_references`` removed (the protocol's two-method version) -> not a CaptureBackend.
    """
    from types import SimpleNamespace

    from eagle3_assets.core.extraction import backends

    class SharedModelBackend(TransformersBackend):
        name = "shared_model"

    def build(recipe, target, run_traces):
        return SharedModelBackend(target.path, target.aux_layer_ids, recipe, model=tf_backend.model)

    entry = backends.ExtractionBackend(build, modules=("safetensors",), serves_target=False, description="the loaded model, shared")
    monkeypatch.setitem(backends.EXTRACTION_BACKENDS, "shared_model", entry)
    target = SimpleNamespace(path=str(tiny_target), aux_layer_ids=list(LAYER_IDS), trust_remote_code=False)
    backend = backends.make_backend(ExtractionRecipe(backend="shared_model", max_batch_size=8), target, traces)
    try:
        assert isinstance(backend, SharedModelBackend) and isinstance(backend, backends.CaptureBackend)
        assert isinstance(tf_backend, backends.CaptureBackend)
        extract_shard(traces, tmp_path / SHARD, settings_for(tiny_target), backend)
    finally:
        backend.close()
    assert read_sidecar(tmp_path / SHARD, expected_layer_ids=LAYER_IDS)["backend"] == "shared_model"
    assert backends.extraction_modules("shared_model") == [*backends.extraction_modules("transformers"), "safetensors"]
    with pytest.raises(ValueError, match=r"extraction backend 'nope': one of 'transformers', 'vllm', 'shared_model'"):
        backends.make_backend(ExtractionRecipe(backend="nope"), target, traces)


KILLED_RUN = """
import os, signal, sys, torch
from pathlib import Path
from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
from eagle3_assets.core.extraction.traces import read_traces
from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
from eagle3_assets.core.extraction.job import ExtractionRecipe

torch.set_num_threads(1)
target, traces_file, out, part_bytes = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
parts_done = 0

def kill_mid_part(event):
    # Fault injection: SIGKILL this process in the middle of the third part, after its first batch was written.
    global parts_done
    if event["event"] == "part":
        parts_done += 1
    if event["event"] == "batch" and parts_done == 2:
        os.kill(os.getpid(), signal.SIGKILL)

settings = ExtractionSettings(target, "tiny-target", (1, 4, 6), dtype="float32", part_bytes=part_bytes)
extract_shard(read_traces(Path(traces_file)), out, settings, TransformersBackend(target, (1, 4, 6), ExtractionRecipe(max_batch_size=2)), on_event=kill_mid_part)
"""


def test_a_run_killed_mid_shard_resumes_to_identical_files(tmp_path, tiny_target, traces_path, traces, tf_backend):
    killed = tmp_path / "killed"
    part_bytes = settings_for(tiny_target).part_bytes
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_RUN), str(tiny_target), str(traces_path), str(killed), str(part_bytes)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert sorted(p.name for p in killed.glob("part-*.safetensors")) == ["part-00000.safetensors", "part-00001.safetensors"]
    assert list(killed.glob(".part-00002.safetensors.*.partial")), "the kill must have left the third part half written"
    assert not (killed / SIDECAR).exists(), "a shard without metadata.json is incomplete"
    durable = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in killed.glob("part-*.safetensors")}

    # Same batching as the killed run (other batch sizes agree within fp32 rounding, not to the bit).
    tf_backend.max_batch_size = 2
    try:
        report = extract_shard(traces, killed, settings_for(tiny_target), tf_backend)
        clean = tmp_path / "clean"
        extract_shard(traces, clean, settings_for(tiny_target), tf_backend)
    finally:
        tf_backend.max_batch_size = 8
    assert (report.parts_reused, report.parts_written) == (2, report.parts - 2)
    assert all((killed / name).stat().st_ino == ino and (killed / name).stat().st_mtime_ns == mtime for name, (ino, mtime) in durable.items())
    assert not list(killed.glob("*.partial"))
    names = sorted(p.name for p in clean.iterdir())
    assert names == sorted(p.name for p in killed.iterdir())
    for name in names:
        assert (clean / name).read_bytes() == (killed / name).read_bytes(), name

    # Extracted again once complete: every part reused and no file written, the sidecar included (a resumed streamed
    # window holds the shard, never a second copy of any of its files).
    untouched = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in killed.iterdir()}
    again = extract_shard(traces, killed, settings_for(tiny_target), tf_backend)
    assert (again.parts_reused, again.parts_written) == (again.parts, 0)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in killed.iterdir()} == untouched


def test_wrong_layer_ids_in_the_sidecar_are_caught(tmp_path, tiny_target, traces, tf_backend):
    facts = TargetFacts.from_path(tiny_target)
    reference = lambda ids: tf_backend.reference_forward(ids)[1]  # noqa: E731
    shard = tmp_path / SHARD
    extract_shard(traces, shard, settings_for(tiny_target), tf_backend)
    assert check_aux_states_match_layer_ids(shard, LAYER_IDS, facts, reference).passed

    # A sidecar that names other ids than the target's configured ones.
    sidecar = json.loads((shard / SIDECAR).read_text())
    (shard / SIDECAR).write_text(json.dumps({**sidecar, "aux_layer_ids": [2, 3, 4]}))
    outcome = check_aux_states_match_layer_ids(shard, LAYER_IDS, facts, reference)
    assert not outcome.passed and "sidecar aux_layer_ids [2, 3, 4], configured [1, 4, 6]" in outcome.description
    with pytest.raises(ValueError, match=r"aux_layer_ids \[2, 3, 4\] but \[1, 4, 6\] were expected"):
        read_sidecar(shard, expected_layer_ids=LAYER_IDS)

    # The silent one: states taken one layer later ("output of layer k") under a sidecar that names the right ids.
    off_by_one = tmp_path / "off_by_one"
    shifted = TransformersBackend(tiny_target, (2, 5, 7), model=tf_backend.model)
    try:
        extract_shard(traces, off_by_one, settings_for(tiny_target, layer_ids=(2, 5, 7)), shifted)
    finally:
        shifted.close()
    sidecar = json.loads((off_by_one / SIDECAR).read_text())
    (off_by_one / SIDECAR).write_text(json.dumps({**sidecar, "aux_layer_ids": list(LAYER_IDS)}))
    outcome = check_aux_states_match_layer_ids(off_by_one, LAYER_IDS, facts, reference)
    assert not outcome.passed
    assert "aux block 0 matches hidden_states[2] best" in outcome.description and "the sidecar says layer 1" in outcome.description


class WrongFinalStateBackend_fault(TransformersBackend):
    """Fault injection: stores one aux block (an inner layer's state) as the final state, labelled post-norm."""

    def capture(self, sequences, dtype):
        return [(aux, aux[:, HIDDEN : 2 * HIDDEN].clone()) for aux, _final in super().capture(sequences, dtype)]


def test_the_logits_gate_passes_bf16_rounding_and_fails_a_wrong_final_state(tmp_path, tiny_target, traces, tf_backend):
    head = TargetHead.from_checkpoint(tiny_target)
    bf16 = ExtractionSettings(str(tiny_target), "tiny-target", LAYER_IDS, dtype="bfloat16")
    extract_shard(traces, tmp_path / "right", bf16, tf_backend)
    outcome = check_final_state_reproduces_logits(tmp_path / "right", head, tf_backend.reference_argmax, samples=12)
    assert outcome.passed and outcome.metadata["argmax_agreement"] == 1.0, outcome.description

    wrong = WrongFinalStateBackend_fault(tiny_target, LAYER_IDS, model=tf_backend.model)
    extract_shard(traces, tmp_path / "wrong", bf16, wrong)
    outcome = check_final_state_reproduces_logits(tmp_path / "wrong", head, tf_backend.reference_argmax, samples=12)
    assert not outcome.passed and outcome.metadata["argmax_agreement"] < 0.9, outcome.description
    assert outcome.metadata["disagreements"] and set(outcome.metadata["offending_ids"]) <= {t.id for t in traces}


def test_the_rounding_margin_bounds_what_bf16_storage_does_to_a_logit_gap(tiny_target):
    """Ties are forgiven only within the margin, so the margin must hold: rounding never moves a gap further."""
    head = TargetHead.from_checkpoint(tiny_target)
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(4096, HIDDEN, generator=generator) * torch.rand(4096, 1, generator=generator) * 40
    rounded = states.bfloat16().float()
    first, second = torch.randint(0, 640, (2, 4096), generator=generator)
    gap = lambda h: ((head.lm_head[first] - head.lm_head[second]) * h).sum(-1)  # noqa: E731
    moved = (gap(rounded) - gap(states)).abs()
    margin = rounding_margin(head, states, first, second, "bfloat16")
    assert bool((moved <= margin).all()) and float(moved.max()) > 0.05 * float(margin.max())
    assert bool((rounding_margin(head, states, first, second, "float32") <= margin / 1000).all())


def test_states_match_traces_catches_missing_and_altered_samples(tmp_path, tiny_target, traces, tf_backend):
    shard = tmp_path / SHARD
    extract_shard(traces, shard, settings_for(tiny_target), tf_backend)
    assert check_states_match_traces(shard, traces).passed
    first = traces[0]
    altered = [Trace.of(first.id, first.input_ids.tolist() + [5], first.loss_mask.tolist() + [1]), *traces[1:]]
    outcome = check_states_match_traces(shard, altered + [Trace.of("never-extracted", [1, 2], [0, 1])])
    assert not outcome.passed
    assert outcome.metadata["missing_count"] == 1 and outcome.metadata["token_count_differs_count"] == 1
    assert {"never-extracted", traces[0].id} <= set(outcome.metadata["offending_ids"])


def test_bad_traces_get_an_error_naming_the_file_and_the_sample(tmp_path):
    import polars as pl

    from eagle3_assets.core.extraction.traces import ExtractionInputError

    path = tmp_path / "validated_traces" / f"{SHARD}.parquet"
    path.parent.mkdir()
    pl.DataFrame({"id": ["a", "b"], "input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1]]}).write_parquet(path)
    with pytest.raises(ExtractionInputError, match=rf"{SHARD}.parquet: sample 'b': loss_mask has 1 entries for 2 input_ids"):
        read_traces(path)
    pl.DataFrame({"id": ["a", "b"], "input_ids": [[1, 2, 3], [4, 700]], "loss_mask": [[0, 1, 1], [1, 1]]}).write_parquet(path)
    with pytest.raises(ExtractionInputError, match=r"sample 'b': token id outside the target's vocabulary of 640"):
        read_traces(path, vocab_size=640)
    with pytest.raises(ExtractionInputError, match=r"no such file \(materialise validated_traces for this shard first\)"):
        read_traces(tmp_path / "missing.parquet")


# -- the vLLM backend ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_backend(tiny_target, tmp_path_factory):
    """One vLLM engine for the module (extract_hidden_states + the CPU-safe connector), in this process."""
    from eagle3_assets.core.extraction.vllm_backend import VLLMBackend

    with in_process_vllm_environment():
        backend = VLLMBackend(
            tiny_target, LAYER_IDS, ExtractionRecipe(), max_model_len=512, scratch_dir=tmp_path_factory.mktemp("vllm-scratch"),
            serving=ServingProfile(),  # the demo target's profile (DemoTargetModel's: the environment's defaults)
        )
        yield backend
        backend.close()


@pytest.mark.vllm
def test_vllm_backend_equals_an_independent_forward_and_feeds_training_the_same(
    tmp_path, tiny_target, traces, tf_backend, vllm_backend, independent_forward
):
    report = extract_shard(traces, tmp_path / "vllm", settings_for(tiny_target), vllm_backend)
    assert report.parts > 1
    sidecar = read_sidecar(tmp_path / "vllm", expected_layer_ids=LAYER_IDS)
    assert sidecar["backend"] == "vllm" and sidecar["final_state"] == "pre_norm"
    head = TargetHead.from_checkpoint(tiny_target)
    assert_equals_independent_forward(tmp_path / "vllm", traces, independent_forward, norm_weight=head.norm_weight)
    assert not list(vllm_backend.scratch_dir.iterdir()), "vLLM's per-request files are removed once stored"

    # Both backends feed training the same thing: equal aux states, and equal final states once a
    # pre-norm one gets the target's final norm (what a reader does when the sidecar says pre_norm).
    extract_shard(traces, tmp_path / "transformers", settings_for(tiny_target), tf_backend)
    from_transformers = {s.id: s for s in iter_samples(tmp_path / "transformers")}
    for sample in iter_samples(tmp_path / "vllm"):
        other = from_transformers[sample.id]
        assert float((sample.aux - other.aux).abs().max()) <= TOLERANCE
        assert float((rms_norm(sample.final, head.norm_weight, head.eps) - other.final).abs().max()) <= TOLERANCE
        logits = head.logits(sample.final, "pre_norm") - head.logits(other.final, "post_norm")
        assert float(logits.abs().max()) <= 1e-3  # over 640 tokens: the lm_head sees the same inputs

    # The logits gate against vLLM's own forward (prompt logprobs) and against transformers'.
    for reference in (vllm_backend.reference_argmax, tf_backend.reference_argmax):
        outcome = check_final_state_reproduces_logits(tmp_path / "vllm", head, reference, samples=4)
        assert outcome.passed and outcome.metadata["argmax_agreement"] == 1.0, outcome.description


@pytest.mark.vllm
def test_vllm_backend_writes_8bit_states_through_the_shared_writer_that_pass_the_gates(tmp_path, tiny_target, traces, tf_backend, vllm_backend):
    """8-bit storage is the shared writer's: vLLM's states get the same codes and scales format, and the same gates pass."""
    from eagle3_assets.core.extraction.hidden_state_checks import check_states_finite, storage_unit_roundoff
    from eagle3_assets.core.extraction.state_layout import FP8_DTYPE

    fp8 = ExtractionSettings(str(tiny_target), "tiny-target", LAYER_IDS, dtype=FP8_DTYPE, part_bytes=60_000)
    report = extract_shard(traces, tmp_path / "vllm", fp8, vllm_backend)
    assert report.parts > 1 and read_sidecar(tmp_path / "vllm")["dtype"] == FP8_DTYPE
    extract_shard(traces, tmp_path / "transformers", settings_for(tiny_target), tf_backend)  # float32: the reference
    head = TargetHead.from_checkpoint(tiny_target)
    exact = {s.id: s for s in iter_samples(tmp_path / "transformers")}
    unit = storage_unit_roundoff(FP8_DTYPE, HIDDEN)
    for sample in iter_samples(tmp_path / "vllm"):
        assert sample.aux.dtype == torch.float32  # dequantised for readers
        reference = exact[sample.id]
        for block in range(3):
            rows = slice(block * HIDDEN, (block + 1) * HIDDEN)
            error = (sample.aux[:, rows] - reference.aux[:, rows]).norm(dim=-1) / reference.aux[:, rows].norm(dim=-1)
            assert float(error.max()) <= unit
        normed = rms_norm(sample.final, head.norm_weight, head.eps)  # vLLM stores the pre-norm state
        assert float(((normed - reference.final).norm(dim=-1) / reference.final.norm(dim=-1)).max()) <= 2 * unit
    assert check_states_finite(tmp_path / "vllm").passed
    outcome = check_final_state_reproduces_logits(tmp_path / "vllm", head, vllm_backend.reference_argmax, samples=4)
    assert outcome.passed and outcome.metadata["argmax_agreement"] == 1.0, outcome.description


# -- the asset: a planted NaN fails states_finite and nothing downstream is built -----------------


def test_a_planted_nan_fails_states_finite_and_blocks_downstream(data_dir, tiny_target):
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig, hidden_states
    from eagle3_assets.glue.partitions import register_shards, sample_shards
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    @asset(partitions_def=sample_shards, deps=[hidden_states], group_name="training")
    def reads_hidden_states() -> None:
        """Stands for training, which consumes a shard's hidden states."""

    write_validated_traces(data_dir, SHARD, tiny_target, count=10)
    instance = DagsterInstance.ephemeral()
    register_shards(instance, [SHARD])
    resources = {"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()}
    run_config = RunConfig(ops={"hidden_states": HiddenStatesConfig(dtype="float32", cpu_threads=1, part_size_bytes=200_000)})

    first = materialize([hidden_states], partition_key=SHARD, resources=resources, instance=instance, run_config=run_config)
    assert first.success
    assert {e.check_name: e.passed for e in first.get_asset_check_evaluations()} == {
        "target_matches_traces": True,
        "states_finite": True,
        "states_match_traces": True,
        "final_state_reproduces_logits": True,
        "aux_states_match_layer_ids": True,
    }
    (mat,) = first.asset_materializations_for_node("hidden_states")
    assert mat.metadata["bytes_per_token"].value == pytest.approx(mat.metadata["bytes"].value / mat.metadata["tokens"].value, abs=0.01)
    assert mat.metadata["final_state"].value == "post_norm" and mat.metadata["aux_layer_ids"].value == [2, 3, 4]
    assert mat.tags["dagster/data_version"] == stable_hash(mat.metadata["data_version_inputs"].value)
    shard = data_dir / "hidden_states" / SHARD
    assert read_sidecar(shard)["target_config_hash"] == TargetModel(path=str(tiny_target)).config_hash()

    # A NaN that the extraction itself wrote (a bf16 overflow in the target, say): planted, and recorded in the
    # sidecar's checksum as the extraction records what it wrote. (A part damaged after it was written does not
    # match its checksum and is extracted again: test_a_damaged_part_... below.)
    part = shard / "part-00001.safetensors"
    plant_nan(part)
    sidecar = json.loads((shard / SIDECAR).read_text())
    for entry in sidecar["files"]:
        if entry["name"] == part.name:
            entry["sha256"] = file_hash(part, length=64)
    (shard / SIDECAR).write_text(json.dumps(sidecar))

    second = materialize(
        [hidden_states, reads_hidden_states], partition_key=SHARD, resources=resources, instance=instance, run_config=run_config, raise_on_error=False
    )
    assert not second.success
    checks = recorded_checks(instance, second.run_id)
    assert not checks["states_finite"].passed and checks["states_match_traces"].passed
    assert checks["states_finite"].metadata["non_finite_values"].value == 1
    (mat,) = recorded_materializations(instance, second.run_id, "hidden_states")
    assert mat.metadata["parts_reused"].value == mat.metadata["parts"].value  # re-checked, not recomputed over
    assert not second.asset_materializations_for_node("reads_hidden_states")
    assert instance.get_latest_materialization_event(AssetKey("reads_hidden_states")) is None


def plant_nan(part) -> None:
    """Overwrite the 8th float32 of the part's first aux state with a NaN, in place."""
    raw = part.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    aux_start = 8 + header_len + json.loads(raw[8 : 8 + header_len])["aux_hidden_states"]["data_offsets"][0]
    with open(part, "r+b") as fh:
        fh.seek(aux_start + 4 * 7)
        fh.write(torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes())


@pytest.mark.vllm
def test_the_vllm_logits_gate_uses_the_pass_that_stored_the_states(tmp_path, tiny_target, traces, vllm_backend):
    """The gate's samples named before extraction get vLLM's prompt logprobs in their capture requests; others a pass of their own."""
    from eagle3_assets.core.extraction.hidden_state_checks import keep_logits_references, sample_ids_for_checks

    keep_logits_references(vllm_backend, traces, 4, 0)
    extract_shard(traces, tmp_path / "vllm", settings_for(tiny_target), vllm_backend)
    head = TargetHead.from_checkpoint(tiny_target)
    outcome = check_final_state_reproduces_logits(tmp_path / "vllm", head, vllm_backend.reference_argmax, samples=4)
    assert outcome.passed and outcome.metadata["argmax_agreement"] == 1.0, outcome.description
    assert outcome.metadata["reference_passes"] == {"same_pass": 4, "separate_pass": 0}
    # Samples drawn with another seed were not named: their references come from a pass of their own, counted.
    other_seed = check_final_state_reproduces_logits(tmp_path / "vllm", head, vllm_backend.reference_argmax, samples=4, seed=1)
    assert other_seed.passed and other_seed.metadata["reference_passes"]["separate_pass"] > 0, other_seed.description
    # The same-pass choices are the engine's own greedy choices: a second pass of this dense fp32 target agrees.
    checked = {t.id: t for t in traces if t.id in set(sample_ids_for_checks(tmp_path / "vllm", 4, 0))}
    same_pass = vllm_backend.reference_argmax([t.input_ids for t in checked.values()])
    vllm_backend.keep_references([])  # forget them: the next call runs a pass of its own
    second_pass = vllm_backend.reference_argmax([t.input_ids for t in checked.values()])
    assert all(torch.equal(a, b) for a, b in zip(same_pass, second_pass))
