"""Training: the target's head, fine-tuning with a new vocabulary map, kill-and-resume, and DDP by the guide's commands.

Hidden states come from a direct transformers forward of the tiny target over
templated demo conversations (tests/demo_hidden_states.py), cached in
``.cache/`` between runs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_assets.core.draft.model import DraftConfig, Eagle3Draft
from eagle3_assets.core.draft.export import export_draft, read_draft_dir
from eagle3_assets.core.storage.files import write_json_atomic
from eagle3_assets.core.target.head import TargetHead, load_head_weights
from eagle3_assets.core.training.checkpoints import JOURNAL, checkpoint_name, latest_checkpoint, read_journal, run_fingerprint
from eagle3_assets.core.training.config import TrainConfig
from eagle3_assets.core.training.data import HiddenStateIndex, index_hidden_states, load_batch
from eagle3_assets.core.training.initial_weights import initial_draft
from eagle3_assets.core.training.launch import run_training
from eagle3_assets.core.draft.vocab import VocabMapping, build_vocab_mapping, save_vocab_mapping
from tests.demo_hidden_states import cached_demo_hidden_states
from tests.hold_point import HoldPoint

REPO = Path(__file__).resolve().parents[1]
# Loss curves of 1 and 2 processes agree to this relative tolerance: the batches are identical,
# only float summation order differs (DDP's gradient all-reduce vs. local accumulation).
DDP_LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def hidden_states(tiny_target) -> list[Path]:
    return cached_demo_hidden_states(tiny_target, shards=2, count=24)


def mapping_from_hidden_states(shard_dirs: list[Path], size: int, out: Path) -> Path:
    counts = torch.zeros(640, dtype=torch.int64)
    for shard in shard_dirs:
        for part in shard.glob("part-*.safetensors"):
            tensors = load_file(str(part))
            counts += torch.bincount(tensors["input_ids"][tensors["loss_mask"] == 1], minlength=640)
    return save_vocab_mapping(out, build_vocab_mapping(counts, size), {})


def small_config(hidden_states, tiny_target, root: Path, **overrides) -> TrainConfig:
    mapping = root / "vocab_mapping.safetensors"
    if not mapping.is_file():
        mapping_from_hidden_states(hidden_states, 200, root)
    settings = dict(
        hidden_state_dirs=[str(d) for d in hidden_states],
        vocab_mapping=str(mapping),
        target_path=str(tiny_target),
        training_dir=str(root / "training"),
        epochs=3,
        learning_rate=2e-3,
        warmup_ratio=0.1,
        ttt_steps=2,
        batch_tokens=256,
        max_seq_len=40,  # truncated samples: quicker epochs, and truncation is exercised
        seed=7,
        log_every=1,
    )
    return TrainConfig(**{**settings, **overrides})


def final_weights(result: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result["checkpoint"]) / "model.safetensors"))


def test_target_head_normalises_pre_norm_states_like_the_post_norm_ones(tiny_target):
    post = cached_demo_hidden_states(tiny_target, shards=1, count=3, dtype=torch.float32)
    pre = cached_demo_hidden_states(tiny_target, shards=1, count=3, dtype=torch.float32, final_state="pre_norm")
    post_index, pre_index = index_hidden_states(post), index_hidden_states(pre)
    assert (post_index.final_state, pre_index.final_state) == ("post_norm", "pre_norm")
    mapping = build_vocab_mapping(torch.arange(640), 100)
    target = load_head_weights(tiny_target)
    post_batch, pre_batch = load_batch(post_index.samples, 4096), load_batch(pre_index.samples, 4096)
    assert not torch.allclose(post_batch.final, pre_batch.final)  # the stored states really differ
    head = TargetHead.from_weights(target)
    post_logits, post_top = head.draft_logits(post_batch.final, "post_norm", mapping.draft_to_target)
    pre_logits, pre_top = head.draft_logits(pre_batch.final, "pre_norm", mapping.draft_to_target)
    valid = post_batch.loss_mask | (post_batch.input_ids > 0)
    torch.testing.assert_close(pre_logits[valid], post_logits[valid], rtol=1e-4, atol=1e-4)
    assert torch.equal(pre_top[valid], post_top[valid])
    # The top token is the target's own argmax over its whole vocabulary.
    full = post_batch.final @ target["lm_head"].T
    assert torch.equal(post_top[valid], full.argmax(-1)[valid])


def draft_with_rows_named_by_target_id(tiny_target, mapping: VocabMapping, layer_ids=(2, 3, 4)) -> Eagle3Draft:
    """A draft whose lm_head row for target id t is filled with t: misaligned rows show at once."""
    target_config = json.loads((tiny_target / "config.json").read_text())
    draft = Eagle3Draft(DraftConfig.for_target(target_config, mapping.draft_vocab_size, list(layer_ids)))
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    with torch.no_grad():
        draft.lm_head.weight.copy_(mapping.draft_to_target.float()[:, None].expand(-1, draft.config.hidden_size))
        draft.embed_tokens.weight.copy_(load_head_weights(tiny_target)["embed"])
    return draft


def sidecar_index(layer_ids=(2, 3, 4)) -> HiddenStateIndex:
    return HiddenStateIndex([], list(layer_ids), 7, 64, 640, "post_norm", "x", "x")


def test_fine_tuning_remaps_lm_head_rows_by_target_id(tiny_target, tmp_path):
    generator = torch.Generator().manual_seed(1)
    old_mapping = build_vocab_mapping(torch.randint(0, 100, (640,), generator=generator), 200)
    new_mapping = build_vocab_mapping(torch.randint(0, 100, (640,), generator=generator), 230)
    old = draft_with_rows_named_by_target_id(tiny_target, old_mapping)
    old_dir = export_draft(old, tmp_path / "published", dtype="float32")  # bf16 would round the ids
    save_vocab_mapping(tmp_path / "new", new_mapping, {})

    config = TrainConfig(
        hidden_state_dirs=["unused"], vocab_mapping=str(tmp_path / "new"), target_path=str(tiny_target),
        training_dir=str(tmp_path / "training"), init_from=str(old_dir),
    )  # fmt: skip
    draft, report = initial_draft(config, sidecar_index(), new_mapping, load_head_weights(tiny_target))

    assert torch.equal(draft.d2t, new_mapping.d2t) and torch.equal(draft.t2d, new_mapping.t2d)
    in_old = old_mapping.t2d[new_mapping.draft_to_target]
    assert report.lm_head_rows_kept == int(in_old.sum()) and report.lm_head_rows_new == int((~in_old).sum())
    assert 0 < report.lm_head_rows_kept < 230 and report.lm_head_rows_new > 0
    for row, target_id in enumerate(new_mapping.draft_to_target.tolist()):
        weights = draft.lm_head.weight[row]
        if in_old[row]:
            assert torch.all(weights == target_id), f"row {row} (target id {target_id}) carries another token's weights"
        else:
            assert not torch.all(weights == weights[0]), f"row {row} is new and should be freshly initialised"
    # Everything but the head is the published draft's.
    _, published = read_draft_dir(old_dir)
    assert torch.equal(draft.fc.weight, published["fc.weight"].float())
    assert torch.equal(draft.midlayer.self_attn.q_proj.weight, published["midlayer.self_attn.q_proj.weight"].float())


def test_fine_tuning_a_plain_draft_into_eagle31_starts_its_new_norms_at_identity(tiny_target, tmp_path):
    mapping = build_vocab_mapping(torch.arange(640), 200)
    save_vocab_mapping(tmp_path / "map", mapping, {})
    target = load_head_weights(tiny_target)
    published = export_draft(draft_with_rows_named_by_target_id(tiny_target, mapping), tmp_path / "published", dtype="float32")

    def start(init_from: Path, **settings):
        config = TrainConfig(
            hidden_state_dirs=["unused"], vocab_mapping=str(tmp_path / "map"), target_path=str(tiny_target),
            training_dir=str(tmp_path / "t"), init_from=str(init_from), **settings,
        )  # fmt: skip
        return initial_draft(config, sidecar_index(), mapping, target)

    draft, report = start(published, fc_norm=True, norm_output=True, norm_before_residual=False)
    assert (draft.config.fc_norm, draft.config.norm_output, draft.config.norm_before_residual) == (True, True, False)
    assert report.norms_added == ["fc_norm", "norm_output"]  # in the run's metadata ("init")
    assert "norms added at identity (weights 1): fc_norm, norm_output; the starting draft had none (plain EAGLE-3)" in report.notes
    assert all(torch.equal(norm.weight, torch.ones(64)) for norm in draft.fc_norm)
    _, weights = read_draft_dir(published)
    for name, value in draft.state_dict().items():  # every weight the starting draft has is its own
        if name in weights and name not in ("d2t", "t2d"):
            assert torch.equal(value, weights[name].float()), name

    # An EAGLE 3.1 draft keeps its norms (and their trained weights) when the settings leave them off.
    with torch.no_grad():
        draft.fc_norm[0].weight.fill_(0.5)
    eagle31 = export_draft(draft, tmp_path / "eagle31", dtype="float32")
    again, report = start(eagle31, norm_before_residual=False)
    assert again.config.fc_norm and again.config.norm_output and report.norms_added == []
    assert torch.equal(again.fc_norm[0].weight, torch.full((64,), 0.5))
    with pytest.raises(ValueError, match="cannot fine-tune .* with these norm settings: fc_norm and norm_before_fc exclude each other"):
        start(eagle31, norm_before_fc=True)
    with pytest.raises(ValueError, match="fc_norm and norm_before_fc both set"):
        TrainConfig(hidden_state_dirs=["x"], vocab_mapping="m", target_path="t", training_dir="d", fc_norm=True, norm_before_fc=True).validate()


def test_fine_tuning_refuses_a_draft_trained_on_other_layers_or_widths(tiny_target, tmp_path):
    mapping = build_vocab_mapping(torch.arange(640), 100)
    save_vocab_mapping(tmp_path / "map", mapping, {})
    target = load_head_weights(tiny_target)

    def start(draft_dir: Path, index: HiddenStateIndex):
        config = TrainConfig(hidden_state_dirs=["unused"], vocab_mapping=str(tmp_path / "map"), target_path=str(tiny_target), training_dir=str(tmp_path / "t"), init_from=str(draft_dir))
        return initial_draft(config, index, mapping, target)

    other_layers = export_draft(draft_with_rows_named_by_target_id(tiny_target, mapping, (1, 3, 5)), tmp_path / "a", dtype="float32")
    with pytest.raises(ValueError, match=r"trained on layers \[1, 3, 5\].*\[2, 3, 4\]"):
        start(other_layers, sidecar_index())
    with pytest.raises(ValueError, match="reads target states of width 64, the hidden states have 128"):
        start(other_layers, HiddenStateIndex([], [1, 3, 5], 7, 128, 640, "post_norm", "x", "x"))

    # No layer ids in its config: vLLM would use its default (2, L//2, L-3) = (2, 3, 4) here, which fits...
    unnamed = export_draft(draft_with_rows_named_by_target_id(tiny_target, mapping), tmp_path / "b", dtype="float32")
    config_file = unnamed / "config.json"
    raw = json.loads(config_file.read_text())
    del raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    config_file.write_text(json.dumps(raw))
    _, report = start(unnamed, sidecar_index())
    assert "vLLM's default [2, 3, 4]" in report.notes[0]
    # ...but not hidden states taken elsewhere.
    with pytest.raises(ValueError, match=r"vLLM used its default \[2, 3, 4\].*extracted at \[1, 3, 5\]"):
        start(unnamed, sidecar_index((1, 3, 5)))


def test_a_frozen_lm_head_ends_bit_for_bit_as_it_started_and_has_no_optimizer_state(hidden_states, tiny_target, tmp_path):
    """freeze_lm_head: the head stays the target's rows of the draft vocabulary; trained, it moves, and its AdamW state exists."""
    from eagle3_assets.core.draft.vocab import load_vocab_mapping
    from eagle3_assets.core.training.memory import StepShape, estimate_step_bytes

    runs = {}
    for frozen in (True, False):
        config = small_config(hidden_states, tiny_target, tmp_path / f"frozen-{frozen}", epochs=1, freeze_lm_head=frozen)
        result = run_training(config)
        saved = torch.load(Path(result["checkpoint"]) / "trainer.pt", weights_only=True)["optimizers"][0]["state"]
        runs[frozen] = (config, final_weights(result), {index: state["exp_avg"].numel() for index, state in saved.items()})
    mapping = load_vocab_mapping(Path(runs[True][0].vocab_mapping))
    initial = load_head_weights(tiny_target)["lm_head"][mapping.draft_to_target]

    frozen_head, trained_head = runs[True][1]["lm_head.weight"], runs[False][1]["lm_head.weight"]
    assert torch.equal(frozen_head, initial), "a frozen lm_head changed in training"
    assert not torch.equal(trained_head, initial), "the trained lm_head did not move: the comparison shows nothing"
    # No AdamW state for the head: one tensor fewer, the head's weights fewer.
    assert len(runs[True][2]) == len(runs[False][2]) - 1
    assert sum(runs[False][2].values()) - sum(runs[True][2].values()) == initial.numel()
    # The memory plan counts the frozen head's weights but neither its gradient nor its optimizer state.
    draft_config = DraftConfig.for_target(json.loads((tiny_target / "config.json").read_text()), initial.shape[0], [2, 3, 4])
    shapes = {frozen: StepShape.of(draft_config, 64, 64, 2, bf16=False, frozen_lm_head=frozen) for frozen in (True, False)}
    trained, frozen = estimate_step_bytes(shapes[False]), estimate_step_bytes(shapes[True])
    assert trained["weights"] == frozen["weights"]
    assert trained["gradients"] + trained["optimizer"] - frozen["gradients"] - frozen["optimizer"] == initial.numel() * 12


def test_the_loss_setting_reaches_the_loop_and_the_run_records_it(hidden_states, tiny_target, tmp_path):
    """Each loss trains the same steps from the same start to other weights (tests/test_training_losses.py: what each is)."""
    results = {loss: run_training(small_config(hidden_states, tiny_target, tmp_path / loss, epochs=1, loss=loss)) for loss in ("kl", "nla", "lk_hybrid", "opd")}
    weights = {loss: final_weights(r) for loss, r in results.items()}
    for loss in ("nla", "lk_hybrid", "opd"):
        state = json.loads((Path(results[loss]["checkpoint"]) / "state.json").read_text())
        assert state["config"]["loss"] == loss and state["step"] == json.loads((Path(results["kl"]["checkpoint"]) / "state.json").read_text())["step"]
        assert not torch.allclose(weights[loss]["fc.weight"], weights["kl"]["fc.weight"]), f"loss {loss} trained the default's weights"
        assert all(torch.isfinite(t).all() for t in weights[loss].values())


def test_a_frozen_lm_head_without_the_targets_head_is_refused(hidden_states, tiny_target, tmp_path):
    config = small_config(hidden_states, tiny_target, tmp_path, freeze_lm_head=True, head_from_target=False)
    with pytest.raises(ValueError, match="freeze_lm_head with head_from_target false"):
        run_training(config)
    assert not (Path(config.training_dir) / "checkpoints").exists(), "refused after training had started"


def test_killed_training_resumes_from_its_last_complete_checkpoint_to_the_same_weights(hidden_states, tiny_target, tmp_path):
    config = small_config(hidden_states, tiny_target, tmp_path / "a", epochs=3)
    uninterrupted = run_training(config)
    history = json.loads((Path(config.training_dir) / "history.json").read_text())["history"]
    assert [r["epoch"] for r in history][-1] == 3 and len(history[0]["accuracy"]) == 2

    interrupted = small_config(hidden_states, tiny_target, tmp_path / "b", epochs=3)
    assert run_fingerprint(interrupted, index_hidden_states(interrupted.hidden_state_dirs)) == uninterrupted["fingerprint"]
    Path(interrupted.training_dir).mkdir(parents=True)
    launch = Path(interrupted.training_dir) / "launch.json"
    write_json_atomic(launch, interrupted.to_dict())
    # The one-process form of the worker docs/training.md runs by hand, held right after its first commit
    # (epoch 1's checkpoint, then its journal lines) and killed there, however fast or loaded the machine.
    checkpoints = Path(interrupted.training_dir) / "checkpoints"
    with HoldPoint("eagle3_assets.core.training.loop:append_journal", call=1) as hold:
        command = [sys.executable, "-m", "eagle3_assets.core.training", "--config", str(launch)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=hold.env(os.environ))
        try:
            assert hold.wait(lambda: process.poll() is None, "the first checkpoint") == process.pid
            hold.kill()
        finally:
            process.kill()
            process.wait()
    steps_per_epoch = sum(1 for r in history if r["epoch"] == 1)
    first = checkpoints / checkpoint_name(steps_per_epoch)
    assert sorted(checkpoints.glob("step-*")) == [first], "offline mode commits at each epoch's end: epoch 1's checkpoint alone"
    assert json.loads((first / "state.json").read_text())["epoch"] == 1
    assert [r["step"] for r in read_journal(Path(interrupted.training_dir) / JOURNAL)] == list(range(1, steps_per_epoch + 1))
    assert not (Path(interrupted.training_dir) / "result.json").exists()

    # Fault injection: what a crash while writing epoch 2's checkpoint and a damaged one would leave.
    second = checkpoints / checkpoint_name(2 * steps_per_epoch)
    crashed = checkpoints / f".{second.name}.crashed.partial"
    crashed.mkdir(exist_ok=True)
    (crashed / "model.safetensors").write_bytes(b"half a file")
    second.mkdir()
    for name in ("model.safetensors", "trainer.pt", "state.json", "manifest.json"):
        (second / name).write_bytes((first / name).read_bytes())
    with open(second / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    assert latest_checkpoint(checkpoints, uninterrupted["fingerprint"]) == first

    resumed = run_training(interrupted)
    assert resumed["resumed_from"] == str(first)
    assert not crashed.exists()
    expected, got = final_weights(uninterrupted), final_weights(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resuming"
    resumed_history = json.loads((Path(interrupted.training_dir) / "history.json").read_text())["history"]
    assert [r["loss"] for r in resumed_history] == [r["loss"] for r in history]
    # The journal of committed steps: every step once, in order, and each epoch's batches once.
    journal = read_journal(Path(interrupted.training_dir) / JOURNAL)
    assert [r["step"] for r in journal] == list(range(1, len(history) + 1))
    batch_ids = [b for r in journal for b in r["batches"]]
    assert len(batch_ids) == len(set(batch_ids))


def documented_command(heading: str) -> str:
    """The shell command under ``heading`` in docs/training.md, continuation lines joined."""
    section = (REPO / "docs" / "training.md").read_text().split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.replace("\\\n", " ")


def run_documented(command: str, config_file: Path, replacements: dict[str, str]) -> None:
    """Run a command of the guide as written, with this test's config file, interpreter and sizes."""
    command = command.replace("data/draft_checkpoint/training/launch_config.json", str(config_file))
    for old, new in replacements.items():
        assert old in command, f"the guide's command no longer says {old!r}: {command}"
        command = command.replace(old, new)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(shlex.split(command), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_the_guides_torchrun_commands_train_two_processes_along_the_single_process_loss_curve(hidden_states, tiny_target, tmp_path):
    """docs/training.md's by-hand commands, run as written: one node of 2 processes, then 2 nodes of 1 on loopback.

    1 process accumulating 2 micro-batches per step sees the batches that 2 processes see together.
    """
    single = small_config(hidden_states, tiny_target, tmp_path / "one", epochs=2, grad_accumulation=2, torch_threads=1)
    run_training(single, nproc=1)
    curve_1 = json.loads((Path(single.training_dir) / "history.json").read_text())["history"]
    assert curve_1[-1]["loss"] < curve_1[0]["loss"]

    python = sys.executable
    torchrun = str(Path(python).parent / "torchrun")
    port = str(29500 + os.getpid() % 1000)
    commands = {
        "one node": (documented_command("Several GPUs"), {"python ": f"{python} ", "--nproc-per-node 8": "--nproc-per-node 2"}),
        "two nodes": (
            documented_command("Several nodes"),
            {"torchrun ": f"{torchrun} ", "--nproc-per-node 8": "--nproc-per-node 1", "node0:29500": f"127.0.0.1:{port}"},
        ),
    }
    for label, (command, replacements) in commands.items():
        ddp = small_config(hidden_states, tiny_target, tmp_path / label.replace(" ", "-"), epochs=2, grad_accumulation=1, torch_threads=1)
        config_file = tmp_path / f"{label.replace(' ', '-')}.json"
        write_json_atomic(config_file, ddp.to_dict())
        nodes = 2 if label == "two nodes" else 1  # each "node" is one torchrun agent; they meet at the rendezvous endpoint
        with ThreadPoolExecutor(nodes) as pool:
            for node in [pool.submit(run_documented, command, config_file, replacements) for _ in range(nodes)]:
                node.result()
        result = json.loads((Path(ddp.training_dir) / "result.json").read_text())
        assert result["world_size"] == 2, label
        curve_2 = json.loads((Path(ddp.training_dir) / "history.json").read_text())["history"]
        assert len(curve_1) == len(curve_2) >= 6, label
        torch.testing.assert_close(
            torch.tensor([r["loss"] for r in curve_2]), torch.tensor([r["loss"] for r in curve_1]), rtol=DDP_LOSS_RTOL, atol=0
        )
        assert [r["tokens"] for r in curve_1] == [r["tokens"] for r in curve_2], label

