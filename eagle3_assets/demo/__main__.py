"""``make demo``: the whole graph on the embedded default, end to end on this machine.

Builds (or reuses) the tiny target, writes the built-in prompt sets, starts a
real vLLM server with the target on a free loopback port, registers the demo's
shards as partitions, materialises the per-shard assets as a backfill runs them
(generation and extraction each in one run over every shard: the server kept
busy across shard boundaries, the target loaded once to extract), stops the
server, then builds the draft vocabulary, trains and exports the draft,
and measures its acceptance length through vLLM speculative decoding against an
untrained baseline. Every run goes into the Dagster instance under
``$DAGSTER_HOME``, so the UI shows them afterwards. Servers are stopped on exit,
Ctrl-C or failure.
"""

from __future__ import annotations

import json
import sys
import time

from dagster import DagsterInstance

from eagle3_assets.core.storage.shard_paths import DatasetPaths
from eagle3_assets.core.storage.files import data_dir
from eagle3_assets.core.serving.vllm_launcher import VLLMServer
from eagle3_assets.demo.pipeline import run_per_shard, run_whole_dataset
from eagle3_assets.demo.stack import demo_prompts_path
from eagle3_assets.demo.targets import DEMO_TARGET_ENV, selected_demo_target
from eagle3_assets.glue.local_runs import fail_dead_runs
from resources.gpu_host import GPU_POOL, ensure_gpu_pool_limit
from resources.vllm_server import GENERATION_POOL, ensure_generation_pool_limit


def main() -> int:
    started = time.monotonic()
    demo = selected_demo_target()
    target = demo.model_dir()
    prompts_path = demo.prompts_path() if demo.prompts_path else demo_prompts_path()
    held_out = demo.target_model().builtin_eval_prompts() or f"{demo.holdout_share:.0%} of the prompts"
    print(f"demo: target {demo.name} ({DEMO_TARGET_ENV}) at {target}\ndemo: prompts {prompts_path} (held out: {held_out})", flush=True)
    instance = DagsterInstance.get()
    # A demo killed earlier left its run STARTED, holding its pool slot: without this the new one would wait for ever.
    fail_dead_runs(instance, log=lambda line: print(f"demo: {line}", flush=True))
    pool_limit = ensure_generation_pool_limit(instance)  # one shard generating at a time, unless set otherwise
    print(f"demo: pool {GENERATION_POOL}: {pool_limit} generation step(s) at a time", flush=True)
    gpu_limit = ensure_gpu_pool_limit(instance)  # one GPU stage at a time on the GPU host
    print(f"demo: pool {GPU_POOL}: {gpu_limit} GPU stage(s) at a time", flush=True)
    with VLLMServer(target, log_path=data_dir() / "demo" / "vllm.log", **demo.serving) as server:
        print(f"demo: vLLM serving the {demo.name} target at {server.base_url}", flush=True)
        if not run_per_shard(instance, server.base_url, server.served_model_name, demo=demo).ok:
            return 1
    # The whole-dataset assets start vLLM servers of their own (target + draft): the machine's cores go to them.
    if not run_whole_dataset(instance, demo=demo).ok:
        return 1
    print(f"demo: done in {time.monotonic() - started:.0f}s; outputs under {data_dir()}:")
    for path in sorted(p for p in data_dir().iterdir() if p.is_dir() and p.name != "demo"):
        print(f"  {path}/ ({sum(1 for _ in path.iterdir())} files)")
    report = json.loads(DatasetPaths().evaluation_report.read_text())
    for label in ("trained", "baseline"):
        result = report["results"][label]
        print(f"demo: mean acceptance length, {label} draft: {result['mean_acceptance_length']:.2f} at {report['num_speculative_tokens']} speculative tokens")
    curve = ", ".join(f"k={p['k']}: {p['acceptance_length']:.2f}" for p in report["acceptance_curve"])
    print(f"demo: acceptance length by num_speculative_tokens: {curve}; recommended k = {report['recommended_num_speculative_tokens']}")
    print(f"demo: how to serve it: {data_dir() / 'draft_checkpoint' / 'model' / 'SERVING.md'}")
    print("demo: browse the runs with `make dev` (http://127.0.0.1:3000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
