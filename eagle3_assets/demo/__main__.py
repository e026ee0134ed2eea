"""``make demo``: the whole graph on the embedded default, end to end on this machine.

Builds (or reuses) the tiny target, writes the built-in prompt sets, starts a
real vLLM server with the target on a free loopback port, registers the demo's
shards as partitions, materialises every asset shard by shard into the Dagster
instance under ``$DAGSTER_HOME`` (so the UI shows the runs afterwards), prints
where the outputs are, and stops the server, also on Ctrl-C or failure.
"""

from __future__ import annotations

import sys
import time

from dagster import DagsterInstance, materialize

from eagle3_assets.core.storage import data_dir
from eagle3_assets.core.vllm_launcher import VLLMServer
from eagle3_assets.demo.stack import DEMO_SHARD_SIZE, demo_eval_prompts_path, demo_prompts_path, tiny_target_dir
from eagle3_assets.definitions import PER_SHARD_ASSETS, demo_resources
from eagle3_assets.partitions import register_shards


def main() -> int:
    started = time.monotonic()
    target = tiny_target_dir()
    prompts_path, eval_path = demo_prompts_path(), demo_eval_prompts_path()
    print(f"demo: target {target}\ndemo: prompts {prompts_path} (held out: {eval_path})", flush=True)
    instance = DagsterInstance.get()
    with VLLMServer(target, log_path=data_dir() / "demo" / "vllm.log") as server:
        print(f"demo: vLLM serving the tiny target at {server.base_url}", flush=True)
        resources = demo_resources(server.base_url, server.served_model_name)
        keys = resources["prompt_dataset"].shard_keys()
        register_shards(instance, keys)
        for key in keys:
            result = materialize(PER_SHARD_ASSETS, partition_key=key, resources=resources, instance=instance, raise_on_error=False)
            status = "ok" if result.success else "FAILED"
            print(f"demo: {key}: {status} (run {result.run_id})", flush=True)
            if not result.success:
                return 1
    print(f"demo: done in {time.monotonic() - started:.0f}s; outputs under {data_dir()}:")
    for path in sorted(p for p in data_dir().iterdir() if p.is_dir() and p.name != "demo"):
        print(f"  {path}/ ({sum(1 for _ in path.iterdir())} files)")
    print("demo: browse the runs with `make dev` (http://127.0.0.1:3000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
