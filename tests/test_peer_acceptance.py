"""The peer bench's choices made before any training (bench/peer_acceptance.py): which held-out prompts both trainers'
drafts are judged on, and whether the peer's drafts can be served beside the target at all; and how its table reads a
variant against the reference measured in the same run.

Both are decided from what a data directory and a target directory hold; neither starts vLLM or the peer environment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.prompts.loading import MESSAGES_DTYPE
from eagle3_assets.core.storage.shard_paths import HELDOUT_SUFFIX

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "peer"))
import peer_acceptance  # noqa: E402


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_held_out(data: Path, shard: str, ids: list[str]) -> None:
    rows = pl.DataFrame(
        {"id": ids, "messages": [[{"role": "user", "content": f"question {i}"}] for i in ids]},
        schema={"id": pl.String, "messages": MESSAGES_DTYPE},
    )
    (data / "prompts").mkdir(parents=True, exist_ok=True)
    rows.write_parquet(data / "prompts" / f"{shard}{HELDOUT_SUFFIX}")


def test_held_out_rows_of_the_prompts_asset_when_nothing_else_names_a_set(tmp_path):
    data, work = tmp_path / "data", tmp_path / "work"
    write_held_out(data, "shard-00001", ["b1"])
    write_held_out(data, "shard-00000", ["a1", "a2"])
    work.mkdir()
    path = peer_acceptance.default_eval_prompts(data, work)
    assert path == work / "eval_prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a1", "a2", "b1"]  # shard order, as draft_evaluation takes them
    assert rows[0]["messages"] == [{"role": "user", "content": "question a1"}]


def test_the_set_draft_evaluation_served_comes_first(tmp_path):
    data, work = tmp_path / "data", tmp_path / "work"
    write_held_out(data, "shard-00000", ["a1"])
    builtin = write_jsonl(data / "demo" / "eval_prompts.jsonl", [{"id": "builtin", "question": "q"}])
    assert peer_acceptance.default_eval_prompts(data, work) == builtin  # the tiny demo's own set before held-out rows
    served = write_jsonl(tmp_path / "elsewhere" / "served.jsonl", [{"id": "served", "question": "q"}])
    (data / "draft_evaluation").mkdir()
    (data / "draft_evaluation" / "report.json").write_text(json.dumps({"eval_prompts": str(served)}))
    assert peer_acceptance.default_eval_prompts(data, work) == served
    served.unlink()  # a report naming a file that is gone: the next source, not a missing file
    assert peer_acceptance.default_eval_prompts(data, work) == builtin


def test_no_held_out_prompts_anywhere_is_refused_with_what_to_pass(tmp_path):
    (tmp_path / "data" / "prompts").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no held-out prompts.*--eval-prompts"):
        peer_acceptance.default_eval_prompts(tmp_path / "data", tmp_path / "work")


def test_a_standard_attention_target_serves_the_peers_llama_form_draft(qwen3_target):
    assert peer_acceptance.peer_form_problem(qwen3_target) is None


def measurement(length: float, train_s: float, steps: int) -> dict:
    return {"mean_acceptance_length": length, "acceptance_rate_per_position": [length / 5] * 5, "train_s": train_s, "optimizer_steps": steps}


def test_a_change_counts_against_the_reference_only_beyond_the_seeds_spread():
    reference = peer_acceptance.variant_figures({"0": measurement(3.8, 34.0, 340), "1": measurement(4.0, 68.0, 340)})
    close = peer_acceptance.variant_figures({"0": measurement(3.9, 34.0, 340), "1": measurement(4.05, 34.0, 340)})
    far = peer_acceptance.variant_figures({"0": measurement(3.5, 34.0, 340), "1": measurement(3.55, 34.0, 340)})
    assert reference["step_s"]["mean"] == pytest.approx(0.15) and reference["step_s"]["min"] == pytest.approx(0.1)
    # +0.075, ranges 0.2 and 0.15: not resolved by the ranges, though above in each seed
    assert peer_acceptance.against_reference(close, reference).endswith("(within the spread; seed by seed above in 2, below in 0 of 2)")
    assert peer_acceptance.against_reference(far, reference) == f"{3.525 / 3.9:.3f} (below, beyond the spread; seed by seed above in 0, below in 2 of 2)"
    mixed = peer_acceptance.variant_figures({"0": measurement(3.7, 34.0, 340), "1": measurement(4.1, 34.0, 340), "2": measurement(4.0, 34.0, 340)})
    assert peer_acceptance.against_reference(mixed, reference).endswith("seed by seed above in 1, below in 1 of 2)")  # seed 2: no reference
    # One seed each: a range of one value is 0, so no difference is read against it (without the check: "beyond").
    one, one_reference = (peer_acceptance.variant_figures({"0": measurement(length, 34.0, 340)}) for length in (4.2, 3.8))
    assert peer_acceptance.against_reference(one, one_reference) == f"{4.2 / 3.8:.3f} (one seed: no spread; seed by seed above in 1, below in 0 of 1)"
    table = peer_acceptance.render({"ours": reference, "far": far}, 5, 32, 2)
    assert "| far | 3.52 (3.50-3.55) |" in table and "| 0.100 (0.100-0.100) | 0.904 (below, beyond the spread; seed by seed above in 0, below in 2 of 2) |" in table


def test_a_draft_measured_without_a_held_out_set_asked_for_now_is_measured_again_and_each_set_summarised_over_its_seeds():
    """--prompt-sets: a kept measurement counts only if it has every set asked for; the sets' figures are their own."""
    with_sets = {**measurement(3.0, 34.0, 340), "per_set": {"long_context": measurement(1.5, 0, 0), "template_perturbation": measurement(2.5, 0, 0)}}
    measured = {
        "ours": {"k5": {"0": with_sets, "1": {**measurement(3.2, 34.0, 340), "per_set": {"long_context": measurement(1.7, 0, 0)}}}},
        "ours-plain": {"k5": {"0": measurement(2.9, 34.0, 340)}},
    }
    labels = ["ours", "ours-plain"]
    assert peer_acceptance.unmeasured(measured, "k5", 2, labels, []) == [(1, "ours-plain")]
    assert peer_acceptance.unmeasured(measured, "k5", 2, labels, ["long_context"]) == [(0, "ours-plain"), (1, "ours-plain")]
    assert peer_acceptance.unmeasured(measured, "k5", 2, labels, ["long_context", "template_perturbation"]) == [
        (0, "ours-plain"), (1, "ours"), (1, "ours-plain"),
    ]  # fmt: skip
    assert peer_acceptance.unmeasured(measured, "k6", 1, ["ours"], []) == [(0, "ours")]  # another k: nothing kept
    figures = peer_acceptance.set_figures(measured, "k5", 2, ["ours"], "long_context")
    assert figures["ours"]["acceptance_length"]["mean"] == pytest.approx(1.6) and figures["ours"]["by_seed"] == {"0": 1.5, "1": 1.7}


def test_a_kept_draft_is_reused_only_for_the_settings_it_was_trained_with_defaults_included(monkeypatch):
    """A variant is what it names over the training defaults: when a default changes, a draft trained under the old
    one is another variant (its work directory then asks for --fresh or another label; bench/draft_norms.py retrains)."""
    from eagle3_assets.core.training.config import TrainConfig, trained_settings

    recipe = {"epochs": 20, "ttt_steps": 3}
    settings = trained_settings(recipe)
    assert settings["epochs"] == 20 and settings["pack_samples"] == TrainConfig.model_fields["pack_samples"].default
    assert "log_every" not in settings and "hidden_state_dirs" not in settings  # neither changes what is trained
    # A setting added since, at the value every earlier draft had (AdamW), keeps the key drafts were kept by; Muon is
    # another draft, and its weight decay counts under Muon alone.
    assert "optimizer" not in settings and "muon_weight_decay" not in settings
    assert trained_settings({**recipe, "optimizer": "adamw", "muon_weight_decay": 0.5}) == settings
    muon = trained_settings({**recipe, "optimizer": "muon"})
    assert muon["optimizer"] == "muon" and muon["muon_weight_decay"] == TrainConfig.model_fields["muon_weight_decay"].default
    assert trained_settings({**recipe, "optimizer": "muon", "muon_weight_decay": 0.5}) != muon
    monkeypatch.setattr(TrainConfig.model_fields["pack_samples"], "default", not settings["pack_samples"])
    assert trained_settings(recipe) != settings, "a changed default changes the variant"
    assert trained_settings({**recipe, "pack_samples": settings["pack_samples"]}) == settings


def test_the_peer_at_its_own_defaults_trains_on_speculators_recipe_whatever_the_caller_passes():
    """``peer-own`` is the peer on its own training defaults, not ours relabelled: the bench passes our recipe to every
    peer run, and ``--recipe speculators`` must set it aside. Mutation: ``resolved_recipe`` reading the flags whatever
    ``--recipe`` says makes the first assertion fail (AdamW at 3e-3, cosine, 1,024-token batches)."""
    import train_speculators

    ours = ["--hidden-states", "x", "--vocab-mapping", "y", "--out", "z", "--lr", "3e-3", "--scheduler", "cosine", "--total-seq-len", "1024"]
    own = train_speculators.resolved_recipe(train_speculators.parser().parse_args([*ours, "--recipe", "speculators"]))
    assert (own["optimizer"], own["lr"], own["scheduler"], own["total_seq_len"], own["warmup_ratio"], own["betas"]) == ("muon", 1e-3, "linear", 8192, None, None)
    caller = train_speculators.resolved_recipe(train_speculators.parser().parse_args(ours))
    assert (caller["optimizer"], caller["lr"], caller["scheduler"], caller["total_seq_len"]) == ("adamw", 3e-3, "cosine", 1024)
    # The bench asks for them by these labels only; the optimizer-only variant keeps the caller's batches.
    assert set(peer_acceptance.PEER_OWN_RECIPE) == {"peer-own", "peer-own-optimizer"} <= set(peer_acceptance.PEER_VARIANTS)
    optimizer_only = train_speculators.resolved_recipe(train_speculators.parser().parse_args([*ours, "--recipe", "speculators-optimizer"]))
    assert (optimizer_only["optimizer"], optimizer_only["lr"], optimizer_only["scheduler"], optimizer_only["total_seq_len"]) == ("muon", 1e-3, "linear", 1024)


def test_the_long_targets_recipe_and_evaluation_reach_both_trainers_and_the_held_out_passes():
    """``--demo-target long``: both trainers on the long demo's recipe (8,192-token samples, the draft windowed as the
    target), the peer given that window on our recipe but keeping its own 2,048 on its own recipe, and the held-out
    passes at the demo's 4,352 completion tokens with its serving profile (its KV cache). Fails with the window left
    out of the peer's command (it trains at 2,048 while ours trains at 128), or with the demo target's evaluation
    ignored (128 tokens: only the first output-position bucket measured)."""
    from eagle3_assets.demo.targets import DEMO_TARGETS

    recipe = {**peer_acceptance.demo_recipe("long"), "betas": [0.9, 0.95]}
    assert (recipe["max_seq_len"], recipe["batch_tokens"], recipe["draft_sliding_window"]) == (8192, 8192, 128)
    assert "draft_sliding_window" not in peer_acceptance.demo_recipe("tiny")
    out, python = Path("/work/peer"), "python"

    def window(label: str) -> str | None:
        command = peer_acceptance.peer_command(label, 0, recipe, [Path("/s")], Path("/v"), Path("/t"), out, python)
        return command[command.index("--sliding-window") + 1] if "--sliding-window" in command else None

    assert window("peer-defaults") == window("peer-plain") == "128"
    assert window("peer-own") is None  # speculators' own recipe: its own window

    long = peer_acceptance.demo_evaluation("long", None, None)
    assert (long["max_tokens"], long["concurrency"]) == (4352, 8) and long["profile"] == DEMO_TARGETS["long"].serving["profile"]
    assert peer_acceptance.demo_evaluation("long", 8192, 4)["max_tokens"] == 8192  # a whole-trace pass, by flag
    tiny = peer_acceptance.demo_evaluation("tiny", None, None)
    assert (tiny["max_tokens"], tiny["concurrency"]) == (128, 8)


def test_acceptance_by_output_position_is_summarised_over_the_seeds_that_have_steps_in_each_bucket():
    """Each bucket's mean over the seeds whose passes reached it (a seed with no step there is not a zero), with the
    steps of every seed kept beside it, and the decay ratio over seeds. Fails with an empty bucket counted as 1.0 (the
    4,096-8,192 mean drops to 2.0) or with the seeds' ranges lost."""

    def seed(first: float, last: float | None, decay: float | None) -> dict:
        buckets = [
            {"bucket": "0-512", "mean_acceptance_length": first, "steps": 100},
            {"bucket": "4096-8192", "mean_acceptance_length": last, "steps": 10 if last else 0},
        ]
        return {"mean_acceptance_length": first, "by_output_position": {"buckets": buckets, "decay_ratio": decay}}

    figures = peer_acceptance.output_position_figures({"0": seed(3.0, 3.3, 1.1), "1": seed(3.4, None, None), "2": seed(3.2, 2.7, 0.84375)})
    first, last = figures["buckets"]["0-512"], figures["buckets"]["4096-8192"]
    assert (first["n"], first["min"], first["max"]) == (3, 3.0, 3.4) and abs(first["mean"] - 3.2) < 1e-9
    assert (last["n"], last["steps"]) == (2, [10, 0, 10]) and abs(last["mean"] - 3.0) < 1e-9
    assert figures["decay_ratio"]["n"] == 2
    table = peer_acceptance.render_output_positions({"ours": {"by_output_position": figures}, "peer": {"by_output_position": None}})
    assert "| ours | 3.20 (3.00-3.40) | 3.00 (2.70-3.30) | 0.97 (0.84-1.10) |" in table and "| peer |" not in table


# A fake peer interpreter, for fault injection only: it takes the bench's command line for bench/peer/train_speculators.py,
# notes when each seed starts and ends, fails on seed 1, and otherwise hands back a draft directory as the real one does.
FAULT_INJECTING_PEER = """#!{python}
import json, sys, time
from pathlib import Path

argv = sys.argv[2:]
out, seed = Path(argv[argv.index("--out") + 1]), int(argv[argv.index("--seed") + 1])
times = out.parent.parent / "times.jsonl"
with open(times, "a") as f:
    f.write(json.dumps({{"seed": seed, "event": "start", "t": time.time()}}) + "\\n")
if seed == 1:
    time.sleep(0.5)
    sys.exit("fault injected: seed 1")
time.sleep(3.0)
out.mkdir(parents=True)
with open(times, "a") as f:
    f.write(json.dumps({{"seed": seed, "event": "end", "t": time.time()}}) + "\\n")
print(json.dumps({{"draft": str(out)}}))
"""


def test_drafts_train_side_by_side_and_a_failure_keeps_the_ones_in_training_and_starts_no_more(tmp_path):
    """``--train-jobs 2``: two drafts train at once (on a 2-core host, each trainer on its own core), and when one fails
    the other finishes and is kept for the rerun while the next waiting draft never starts. Fails if the jobs are run
    one after another (seed 1 starts after seed 0 ends), if a failure abandons the draft beside it (seed 0 not kept),
    or if the queue goes on after it (seed 2 starts)."""
    peer = tmp_path / "fault_injecting_peer"
    peer.write_text(FAULT_INJECTING_PEER.format(python=sys.executable))
    peer.chmod(0o755)
    work = tmp_path / "work"
    recipe = {"epochs": 1, "learning_rate": 3e-3, "warmup_ratio": 0.05, "ttt_steps": 3, "batch_tokens": 1024, "max_seq_len": 512, "betas": [0.9, 0.95]}
    inputs = ({}, recipe, [tmp_path / "shard"], tmp_path / "vocab", tmp_path / "target", work, str(peer))
    pending = [(0, "peer-defaults"), (1, "peer-defaults"), (2, "peer-defaults")]
    with pytest.raises(SystemExit, match=r"(?s)peer-defaults seed 1: speculators' training failed .*fault injected: seed 1"):
        peer_acceptance.train_in_parallel(pending, 2, *inputs)
    events = [json.loads(line) for line in (work / "times.jsonl").read_text().splitlines()]
    at = {(e["seed"], e["event"]): e["t"] for e in events}
    assert at[(1, "start")] < at[(0, "end")], "seed 1 waited for seed 0: the drafts trained one after another"
    assert (work / "drafts" / "peer-defaults-seed0" / peer_acceptance.DONE).is_file(), "the draft in training beside the failure was lost"
    assert (2, "start") not in at and not (work / "drafts" / "peer-defaults-seed2").exists(), "a draft started after the failure"
