"""Bounded-disk training: a window of shards on disk, the gates on every streamed shard, SIGKILL and resume.

Real tiny target, real transformers extraction on the CPU, the real stage
process (``python -m eagle3_assets.stages.train_draft --config``: the one
training stage, with the streamed source).
The window is measured from outside the stage while it runs: inotify sees every
file created, written and deleted under the window directory (tests/fs_watch.py).
A run killed and resumed is compared with an uninterrupted run of the same seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
import torch
from dagster import DagsterInstance, RunConfig, materialize

from eagle3_assets.core.extraction.traces import read_traces
from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
from eagle3_assets.core.training.job import BoundedModeError, TrainingJob
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.extraction.state_layout import FP8_DTYPE, bytes_per_token
from eagle3_assets.core.storage.files import write_json_atomic
from eagle3_assets.core.training.checkpoints import JOURNAL, checkpoint_name, read_journal
from eagle3_assets.core.training.launch import EVENT_PREFIX
from eagle3_assets.core.training.loop import train
from eagle3_assets.core.training.streamed import StreamedGateError, StreamedWindow
from eagle3_assets.core.draft.vocab import build_vocab_mapping, save_vocab_mapping
from safetensors.torch import load_file

from tests.extraction_helpers import write_validated_traces
from tests.fs_watch import TreeWatcher
from tests.hold_point import HoldPoint

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = [2, 3, 4]
KEYS = ("shard-a", "shard-b", "shard-c")
WINDOW = 2
SAMPLES_PER_SHARD = 10


@pytest.fixture(scope="module")
def streamed(tiny_target, tmp_path_factory) -> dict:
    """Three shards of validated traces and a vocabulary map built from them."""
    root = tmp_path_factory.mktemp("bounded")
    traces = {key: write_validated_traces(root, key, tiny_target, count=SAMPLES_PER_SHARD, seed=20 + i) for i, key in enumerate(KEYS)}
    counts = torch.zeros(640, dtype=torch.int64)
    for path in traces.values():
        frame = pl.read_parquet(path, columns=["input_ids", "loss_mask"])
        ids = torch.from_numpy(frame["input_ids"].explode().cast(pl.Int64).to_numpy().copy())
        mask = torch.from_numpy(frame["loss_mask"].explode().cast(pl.Int8).to_numpy().copy())
        counts += torch.bincount(ids[mask == 1], minlength=640)
    mapping = save_vocab_mapping(root / "vocab_mapping", build_vocab_mapping(counts, 200), {})
    return {"traces": traces, "mapping": mapping}


def run_settings(tiny_target, streamed, work: Path, *, dtype="bfloat16", epochs=2, every=2) -> dict:
    """A TrainingJob with the streamed source, as the stage's --config takes it (which trains only)."""
    from eagle3_assets.core.target.identity import target_identity

    train = dict(
        hidden_state_dirs=[], vocab_mapping=str(streamed["mapping"]), target_path=str(tiny_target), training_dir=str(work / "training"),
        epochs=epochs, learning_rate=2e-3, warmup_ratio=0.1, ttt_steps=2, batch_tokens=96, max_seq_len=32, seed=3, log_every=1,
    )  # fmt: skip
    shards = [{"key": key, "traces": str(path), "data_version": f"v-{key}"} for key, path in streamed["traces"].items()]
    target = {"path": str(tiny_target), "trust_remote_code": False, "aux_layer_ids": LAYER_IDS, "config_hash": target_identity(tiny_target).config_hash,
        "serving": ServingProfile().model_dump(),
    }  # fmt: skip
    extraction = dict(
        backend="transformers", cpu_threads=1, dtype=dtype, part_size_bytes=20_000,
        logits_check_samples=3, logits_check_positions=256, aux_check_samples=2,
    )  # fmt: skip
    bounded = dict(
        shards=shards, window_dir=str(work / "streamed_states"), target=target, extraction=extraction,
        window_shards=WINDOW, checkpoint_every_steps=every,
    )  # fmt: skip
    return {"train": train, "export_dir": str(work / "model"), "bounded": bounded}


def start_stage(config_file: Path, log: Path, hold: HoldPoint | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env = hold.env(env) if hold else env
    return subprocess.Popen(
        [sys.executable, "-m", "eagle3_assets.stages.train_draft", "--config", str(config_file)],
        stdout=open(log, "a"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


def events(log: Path) -> list[dict]:
    return [json.loads(line.split(EVENT_PREFIX, 1)[1]) for line in log.read_text().splitlines() if EVENT_PREFIX in line]


def _final_weights(training: Path) -> dict[str, torch.Tensor]:
    result = json.loads((training / "result.json").read_text())
    return load_file(str(Path(result["checkpoint"]) / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_target, streamed, tmp_path_factory) -> Path:
    """The reference: the same settings and seed, trained in one run that nobody kills."""
    work = tmp_path_factory.mktemp("uninterrupted")
    settings = run_settings(tiny_target, streamed, work)
    write_json_atomic(work / "run.json", settings)
    process = start_stage(work / "run.json", work / "stage.log")
    assert process.wait(timeout=600) == 0, (work / "stage.log").read_text()[-3000:]
    return Path(settings["train"]["training_dir"])


def test_killed_bounded_training_resumes_to_the_uninterrupted_run_and_never_exceeds_the_window(tiny_target, streamed, uninterrupted, tmp_path):
    settings = run_settings(tiny_target, streamed, tmp_path)
    config_file, log = tmp_path / "run.json", tmp_path / "stage.log"
    write_json_atomic(config_file, settings)
    training = Path(settings["train"]["training_dir"])
    watcher = TreeWatcher(Path(settings["bounded"]["window_dir"]))
    watcher.start()

    # The kill lands right after the third commit (a checkpoint, then its journal lines) of the first run,
    # however fast or loaded the machine: the stage is held there until killed.
    reference_log = uninterrupted.parent / "stage.log"
    reference_commits = [e["step"] for e in events(reference_log) if e["event"] == "checkpoint"]
    reference_journal = read_journal(uninterrupted / JOURNAL)
    killed_at = reference_commits[2]
    assert reference_journal[killed_at]["shard"] == reference_journal[killed_at - 1]["shard"], "the third commit falls mid-shard"
    with HoldPoint("eagle3_assets.core.training.loop:append_journal", call=3) as hold:
        process = start_stage(config_file, log, hold)
        try:
            assert hold.wait(lambda: process.poll() is None, "the first run's third commit") == process.pid, log.read_text()[-3000:]
            hold.kill()
        finally:
            process.kill()
            process.wait()
    # What the killed run left: exactly the steps up to the third commit, in a complete checkpoint and in the journal.
    durable = read_journal(training / JOURNAL)
    assert [(r["step"], r["shard"], r["samples"]) for r in durable] == [(r["step"], r["shard"], r["samples"]) for r in reference_journal[:killed_at]]
    checkpoints = sorted(c.name for c in (training / "checkpoints").glob("step-*"))
    assert checkpoints[-1] == checkpoint_name(killed_at) and set(checkpoints) <= {checkpoint_name(s) for s in reference_commits[:3]}
    assert not (training / "result.json").exists()

    # Second run: resumes and finishes.
    process = start_stage(config_file, log)
    assert process.wait(timeout=600) == 0, log.read_text()[-3000:]
    watcher.finish()

    # -- the same training as a run nobody killed: every step's loss and the final weights
    resumed_history = json.loads((training / "history.json").read_text())["history"]
    reference_history = json.loads((uninterrupted / "history.json").read_text())["history"]
    assert [r["step"] for r in resumed_history] == [r["step"] for r in reference_history]
    for mine, theirs in zip(resumed_history, reference_history):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), f"step {mine['step']}: {mine['loss']} vs {theirs['loss']}"
    resumed_weights, reference_weights = _final_weights(training), _final_weights(uninterrupted)
    assert resumed_weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

    # -- no batch twice, every batch once per epoch: from the journal of committed steps
    journal = read_journal(training / JOURNAL)
    assert [r["step"] for r in journal] == list(range(1, len(journal) + 1)), "steps are committed once each, in order"
    batch_ids = [b for r in journal for b in r["batches"]]
    assert len(batch_ids) == len(set(batch_ids)), f"trained twice: {[b for b, n in Counter(batch_ids).items() if n > 1]}"
    assert len({r["pid"] for r in journal}) == 2 and len({r["pid"] for r in journal[killed_at:]}) == 1, "the second process trained the rest"
    for epoch in (1, 2):
        for key, path in streamed["traces"].items():
            ids = [t.id for t in read_traces(path)]
            seen = [s for r in journal if r["epoch"] == epoch and r["shard"] == key for s in r["samples"]]
            assert sorted(seen) == sorted(ids), f"epoch {epoch} {key}: every sample exactly once"
    logged = events(log)
    (resumed,) = [e for e in logged if e["event"] == "resumed"]
    assert resumed["step"] == killed_at and resumed["checkpoint"].endswith(f"step-{killed_at:08d}")

    # -- the window, from every change the kernel reported under it during both runs
    result = json.loads((training / "result.json").read_text())
    shard_bytes = {e["shard"]: e["bytes"] for e in logged if e["event"] == "extracted"}
    assert not watcher.overflowed and watcher.events > 0 and watcher.peak_dirs >= 1
    assert watcher.peak_dirs <= WINDOW, f"{watcher.peak_dirs} shards of states on disk at once (window {WINDOW})"
    window_bound = sum(sorted(shard_bytes.values(), reverse=True)[:WINDOW])
    assert watcher.peak_bytes <= window_bound, f"{watcher.peak_bytes} B on disk at once, the window holds {window_bound} B"
    assert watcher.peak_bytes >= max(shard_bytes.values()), "the watcher saw at least the largest shard whole"
    assert 0 < result["source"]["peak_window_bytes"] <= window_bound
    assert {n for n in watcher.names if not n.startswith(".")} <= {f"e{e:04d}-{k}" for e in (1, 2) for k in KEYS}, watcher.names
    assert not any(Path(settings["bounded"]["window_dir"]).iterdir()), "nothing is left on disk after training"
    # Every streamed shard recorded once per epoch, with the data version it was given and its gates.
    streamed = result["source"]["streamed_shards"]
    assert sorted((s["epoch"], s["shard"]) for s in streamed) == sorted((e, k) for e in (1, 2) for k in KEYS)
    assert all(s["data_version"] == f"v-{s['shard']}" and all(s["gates"].values()) for s in streamed)
    assert Path(result["checkpoint"]).name == f"step-{len(journal):08d}"


class NaNForOneSample:
    """Fault injection: the real transformers backend, except that one sample's final states come back NaN."""

    def __init__(self, backend: TransformersBackend, poisoned: torch.Tensor):
        self.backend, self.poisoned = backend, poisoned
        self.name, self.final_state = backend.name, backend.final_state

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def capture(self, sequences, dtype):
        states = []
        for ids, (aux, final) in zip(sequences, self.backend.capture(sequences, dtype)):
            if torch.equal(ids, self.poisoned):
                final = final.clone()
                final[0, 0] = float("nan")
            states.append((aux, final))
        return states


def test_a_streamed_shard_failing_a_gate_stops_training_before_it_learns_from_it(tiny_target, streamed, tmp_path):
    settings = run_settings(tiny_target, streamed, tmp_path, epochs=1, dtype=FP8_DTYPE)
    job = TrainingJob.from_dict(settings)
    run = job.bounded
    poisoned = read_traces(streamed["traces"]["shard-b"])[0].input_ids
    backend = TransformersBackend(tiny_target, LAYER_IDS)
    try:
        with pytest.raises(StreamedGateError, match=r"streamed shard shard-b \(epoch 1\): gate states_finite failed: .*training stopped"):
            train(job.train, StreamedWindow(run, NaNForOneSample(backend, poisoned)))
    finally:
        backend.close()
    journal = read_journal(Path(job.train.training_dir) / JOURNAL)
    assert all(r["shard"] != "shard-b" for r in journal), "no step learned from the failing shard"
    assert (Path(run.window_dir) / "e0001-shard-b").is_dir(), "the failing states are kept for inspection"


def test_bad_mode_settings_are_refused_naming_the_setting(data_dir, tiny_target):
    from eagle3_assets.defs.draft_checkpoint import DraftTrainingConfig, check_mode, draft_checkpoint
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    with pytest.raises(BoundedModeError, match=r"hidden_states_mode 'streaming': one of \('offline', 'bounded'\)"):
        check_mode("streaming", 2)
    with pytest.raises(BoundedModeError, match=r"window_shards 0: at least 1"):
        check_mode("bounded", 0)
    with pytest.raises(BoundedModeError, match=r"nproc_per_node 2: bounded mode trains in one process"):
        check_mode("bounded", 2, nproc=2)
    check_mode("offline", 2, nproc=2)  # DDP stays offline mode's
    result = materialize(
        [draft_checkpoint],
        resources={"target_model": TargetModel(path=str(tiny_target)), "gpu_host": GPUHost()},
        instance=DagsterInstance.ephemeral(),
        run_config=RunConfig(ops={"draft_checkpoint": DraftTrainingConfig(hidden_states_mode="bounded", window_shards=-1)}),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "window_shards -1: at least 1 shard of hidden states must fit on disk" in failure.step_failure_data.error.to_string()


def test_the_preflight_estimates_the_window_and_names_the_mode_and_both_numbers(data_dir, tiny_target):
    from eagle3_assets.defs.draft_checkpoint import STAGE, bounded_requirements
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig
    from resources.gpu_host import GPUHost

    free = __import__("shutil").disk_usage(data_dir).free
    per_token = bytes_per_token(64, "bfloat16")
    claimed = {"shard-a": int(0.7 * free / per_token), "shard-b": int(0.2 * free / per_token), "shard-c": int(0.5 * free / per_token)}
    for i, (key, tokens) in enumerate(claimed.items()):
        path = write_validated_traces(data_dir, key, tiny_target, count=4, seed=i)
        # Fault injection: the traces claim many tokens (real states of that many would not fit any disk here).
        frame, metadata = pl.read_parquet(path), pl.read_parquet_metadata(path)
        frame.with_columns(pl.Series("num_tokens", [tokens // 4] * 4, dtype=pl.Int64)).write_parquet(path, metadata=metadata)
    sizes = {key: (tokens // 4) * 4 * per_token for key, tokens in claimed.items()}
    config = HiddenStatesConfig()

    one = bounded_requirements(list(claimed), 64, config, window_shards=1)
    assert one.disk_bytes == sizes["shard-a"]  # the largest shard: the window of one can hold it
    assert f"bounded mode: a window of 1 of 3 shards = {sizes['shard-a']} B" in one.disk_note
    assert f"offline mode would keep all {sum(sizes.values())} B" in one.disk_note
    report = GPUHost().preflight(STAGE, one)
    assert not any(f.startswith("disk:") for f in report["failures"]), report["failures"]

    two = bounded_requirements(list(claimed), 64, config, window_shards=2)
    assert two.disk_bytes == sizes["shard-a"] + sizes["shard-c"]
    report = GPUHost().preflight(STAGE, two)
    (line,) = [f for f in report["failures"] if f.startswith("disk:")]
    assert f"< {two.disk_bytes} bytes" in line and "bounded mode: a window of 2 of 3 shards" in line, line
    assert f"offline mode would keep all {sum(sizes.values())} B" in line, line


@pytest.mark.vllm
def test_bounded_mode_through_dagster_records_what_was_streamed_and_materialises_no_hidden_states(tiny_target, data_dir, streamed):
    """draft_checkpoint in bounded mode: the GPU host's stage streams, trains, exports; vLLM loads the draft."""
    from dagster import AssetKey

    from eagle3_assets.defs.draft_checkpoint import DraftTrainingConfig, draft_checkpoint, streamed_data_version
    from eagle3_assets.defs.hidden_states import HiddenStatesConfig
    from eagle3_assets.glue.partitions import register_shards
    from eagle3_assets.defs.vocab_mapping import VocabMappingConfig, vocab_mapping
    from resources.gpu_host import GPUHost
    from resources.target_model import TargetModel

    for key, path in streamed["traces"].items():
        (data_dir / "validated_traces").mkdir(exist_ok=True)
        (data_dir / "validated_traces" / f"{key}.parquet").write_bytes(path.read_bytes())
    instance = DagsterInstance.ephemeral()
    register_shards(instance, list(KEYS))
    target = TargetModel(path=str(tiny_target), aux_layer_ids=LAYER_IDS)
    training = DraftTrainingConfig(
        epochs=2, learning_rate=3e-3, ttt_steps=2, batch_tokens=256, max_seq_len=64, hidden_states_mode="bounded", window_shards=1,
        streamed_extraction=HiddenStatesConfig(dtype=FP8_DTYPE, cpu_threads=1, part_size_bytes=50_000),
    )  # fmt: skip
    result = materialize(
        [vocab_mapping, draft_checkpoint],
        resources={"target_model": target, "gpu_host": GPUHost()},
        instance=instance,
        run_config=RunConfig(ops={"vocab_mapping": VocabMappingConfig(draft_vocab_size=200), "draft_checkpoint": training}),
        raise_on_error=False,
    )
    logs = [entry.user_message for entry in instance.all_logs(result.run_id) if entry.user_message]
    assert result.success, "\n".join(logs[-30:])
    metadata = next(
        e.materialization.metadata for e in result.get_asset_materialization_events() if e.materialization.asset_key == AssetKey("draft_checkpoint")
    )
    assert metadata["hidden_states_mode"].value == "bounded" and metadata["window_shards"].value == 1
    assert metadata["hidden_state_dtypes"].value == [FP8_DTYPE] and metadata["samples"].value == len(KEYS) * SAMPLES_PER_SHARD
    records = metadata["streamed_shards"].value
    assert sorted((r["epoch"], r["shard"]) for r in records) == sorted((e, k) for e in (1, 2) for k in KEYS)
    largest = max(r["bytes"] for r in records)
    assert 0 < metadata["peak_window_bytes"].value <= largest  # a window of one shard
    assert any("bounded mode: a window of 1 of 3 shards" in line for line in logs), "the estimate is said before the stage starts"
    # Each shard streamed with the version hidden_states would have given its states (same traces, target, layers, backend, dtype).
    assert {r["data_version"] for r in records if r["shard"] == "shard-a"} == {
        streamed_data_version(_context_for(instance), "shard-a", target, training.streamed_extraction)
    }
    # Nothing claims a deleted file: no hidden_states partition exists, and no states are left on disk.
    assert instance.get_latest_materialization_event(AssetKey("hidden_states")) is None
    assert not (data_dir / "hidden_states").exists() or not any((data_dir / "hidden_states").iterdir())
    assert not any((data_dir / "draft_checkpoint" / "streamed_states").iterdir())
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    for name in ("config_complete", "loads_in_vllm"):
        assert checks[name].passed, (name, checks[name].description)


def _context_for(instance):
    """What streamed_data_version reads of a context: the instance (validated_traces' recorded versions)."""
    from types import SimpleNamespace

    return SimpleNamespace(instance=instance)
