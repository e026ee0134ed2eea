"""P10: generation across shards. Does a backfill of ``raw_responses`` keep ``concurrency`` requests in flight?

Through the public path: a real ``dagster dev`` (webserver + daemon, the
instance of ``make dev``: ``deploy/dagster-dev.yaml``, the generation pool at
its limit of 1) and the command a user types, ``python -m eagle3_assets.backfill
--all --assets prompts,raw_responses --wait`` (the whole graph of generation in
one backfill; with ``--separate``: ``--assets prompts`` first, then ``--assets
raw_responses``, as docs/production.md once asked), over ``--shards`` x ``--shard-size`` prompts,
against ``bench/latency_stub.py`` (a BENCH STUB with a latency model, not
vLLM): at most ``--concurrency`` sequences decode at once, each at
``max_tokens / --capped-trace-s`` tokens/s, response lengths log-normal capped
at ``--max-tokens``, fixed per prompt id.

Figures, per backfill:

- the generation window: from the first sample the stub admitted to the last
  response it finished (pre-flight canaries excluded);
- the ideal schedule: the very same lengths, in the same order, with
  ``concurrency`` always in flight (computed here, by simulation); P10 is the
  ideal over the window, goal >= 0.90;
- the generation backfill command's wall time (with the prompts, in the
  whole-graph form), the runs of ``raw_responses`` it took, and the most run
  processes alive at once (sampled each second);
- per shard: its own window, and the gap between one shard's last response
  and the next shard's first request.

It runs twice: with the platform's default shards per run
(``EAGLE3_SHARDS_PER_RUN``) over every shard, and with 1 shard per run, the
per-shard runs of before, over the first ``--baseline-shards`` (each of its
runs pays a run start and a drained batch: the figures per shard say the same
over 5 shards as over 20, in a quarter of the time), printed beside it. Usage: ``.venv/bin/python bench/generation_at_scale.py
[--shards 20] [--shard-size 128] [--capped-trace-s 10] [--per-run 32,1] [--separate]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("EAGLE3_TINY_TARGET_DIR", str(REPO / ".cache" / "tiny_target"))

from latency_stub import completion_tokens  # noqa: E402

from eagle3_assets.core.serving.vllm_launcher import free_port  # noqa: E402
from eagle3_assets.core.settings.environment import SHARDS_PER_RUN  # noqa: E402
from tests.dagster_dev import DagsterDev  # noqa: E402


def ideal_makespan(durations: list[float], slots: int) -> float:
    """The schedule that keeps ``slots`` in flight: each next request (in order) starts when a place frees."""
    free = [0.0] * slots
    end = 0.0
    for duration in durations:
        start = heapq.heappop(free)
        heapq.heappush(free, start + duration)
        end = max(end, start + duration)
    return end


def in_flight_mean(served: list, slots: int) -> float:
    """Requests in flight on average over the generation window (the stub's admitted-to-finished spans)."""
    window = max(e for _, _, e in served) - min(a for _, a, _ in served)
    return sum(e - a for _, a, e in served) / window if window > 0 else float(slots)


def write_prompts(path: Path, count: int) -> None:
    with path.open("w") as fh:
        for i in range(count):
            fh.write(json.dumps({"id": f"q{i:06d}", "question": f"What is {i} plus {i % 97}? Explain step by step."}) + "\n")


def live_runs_sampler(home: Path, stop: threading.Event, most: list[int]) -> None:
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    instance = DagsterInstance.from_config(str(home))
    alive = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
    while not stop.wait(1.0):
        try:
            most[0] = max(most[0], len(instance.get_runs(RunsFilter(statuses=alive))))
        except Exception:  # the database busy for a moment: the next sample
            pass


def one_backfill(args, per_run: int, shards: int, root: Path, prompts_path: Path) -> dict:
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    from eagle3_assets.glue.partitions import register_shards
    from resources.prompt_dataset import PromptDataset
    from resources.vllm_server import ensure_generation_pool_limit

    # One data directory and instance for every mode: the prompts are materialised once; each mode's
    # generation starts from no raw_responses files (a fresh dagster dev reads its EAGLE3_SHARDS_PER_RUN).
    work = root / "work"
    data, home = work / "data", work / "dagster_home"
    data.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(data / "raw_responses", ignore_errors=True)
    port = free_port()
    tokens_per_s = args.max_tokens / args.capped_trace_s
    stub = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "latency_stub.py"), "--port", str(port), "--max-seqs", str(args.concurrency),
         "--tokens-per-s", str(tokens_per_s), "--median", str(args.median), "--sigma", str(args.sigma), "--max-model-len", "8192"],
        start_new_session=True,
    )  # fmt: skip
    stub_url = f"http://127.0.0.1:{port}"
    env = {
        "EAGLE3_DATA_DIR": str(data), "EAGLE3_PROMPTS": str(prompts_path), "EAGLE3_SHARD_SIZE": str(args.shard_size),
        "EAGLE3_VLLM_URLS": stub_url, "EAGLE3_SERVED_MODEL": "latency-stub", "EAGLE3_SHARDS_PER_RUN": str(per_run),
    }  # fmt: skip
    config = {"resources": {
        "prompt_dataset": {"config": {"source": str(prompts_path), "shard_size": args.shard_size, "holdout_share": 0.0}},
        "vllm_server": {"config": {"base_urls": [stub_url], "served_model_name": "latency-stub", "max_tokens": args.max_tokens,
                                   "concurrency": args.concurrency, "progress_interval_s": 10.0}},
    }}  # fmt: skip
    (work / "run_config.json").write_text(json.dumps(config))
    try:
        with DagsterDev(home, env, work / f"dagster_dev.per-run-{per_run}.log") as dev:
            instance = DagsterInstance.from_config(str(home))
            keys = PromptDataset(source=str(prompts_path), shard_size=args.shard_size, holdout_share=0.0).shard_keys()
            register_shards(instance, keys)
            ensure_generation_pool_limit(instance, 1)

            which = ["--all"] if shards == len(keys) else ["--shards", ",".join(keys[:shards])]  # --all: as the user types it
            keys = keys[:shards]

            def backfill(assets: str) -> tuple[subprocess.CompletedProcess, float]:
                started = time.time()
                done = subprocess.run(
                    [sys.executable, "-m", "eagle3_assets.backfill", "--url", dev.url, *which, "--assets", assets,
                     "--wait", "--run-config", str(work / "run_config.json"), "--title", f"P10 {assets}, {per_run} shard(s) per run"],
                    cwd=REPO, env={**os.environ, **env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=args.timeout,
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"backfill failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{dev.log_tail(40)}")
                return done, time.time() - started

            # The whole graph in one backfill, as the user types it; each mode starts without prompts files, so
            # that every mode's backfill makes them. --separate: the prompts first, then the generation.
            prompts_s = 0.0
            if args.separate:
                if not (data / "prompts").is_dir():
                    _, prompts_s = backfill("prompts")  # the first mode's shards: the most of any mode
            else:
                shutil.rmtree(data / "prompts", ignore_errors=True)
            stop, most = threading.Event(), [0]
            sampler = threading.Thread(target=live_runs_sampler, args=(home, stop, most), daemon=True)
            sampler.start()
            done, command_s = backfill("raw_responses" if args.separate else "prompts,raw_responses")
            stop.set()
            sampler.join()
            runs = instance.get_runs(RunsFilter(tags={"dagster/backfill": done.stdout.split("launched backfill ", 1)[1].split(":", 1)[0]}))
            generation_runs = [r for r in runs if "raw_responses" in {k.to_user_string() for k in (r.asset_selection or [])}]
            prompts_runs = [r for r in runs if "prompts" in {k.to_user_string() for k in (r.asset_selection or [])}]
            assert all(r.status == DagsterRunStatus.SUCCESS for r in runs), [r.status for r in runs]
        with urllib.request.urlopen(stub_url + "/stub/stats", timeout=60) as response:
            served = json.loads(response.read())["served"]
    finally:
        stub.terminate()
        stub.wait(30)

    import polars as pl

    order = [i for key in keys for i in pl.read_parquet(data / "prompts" / f"{key}.parquet")["id"].to_list()]
    shard_of = {i: key for key in keys for i in pl.read_parquet(data / "prompts" / f"{key}.parquet")["id"].to_list()}
    assert len(order) == shards * args.shard_size, (len(order), shards * args.shard_size)
    first_admitted: dict[str, float] = {}
    for sample_id, admitted, ended in served:
        first_admitted.setdefault(sample_id, admitted)
    assert set(first_admitted) == set(order), "the stub did not serve every prompt"
    window = max(e for _, _, e in served) - min(a for _, a, _ in served)
    durations = [completion_tokens(i, args.max_tokens, args.median, args.sigma) / tokens_per_s for i in order]
    ideal = ideal_makespan(durations, args.concurrency)
    spans = {}
    for sample_id, admitted, ended in served:
        key = shard_of[sample_id]
        lo, hi = spans.get(key, (admitted, ended))
        spans[key] = (min(lo, admitted), max(hi, ended))
    gaps = [spans[b][0] - spans[a][1] for a, b in zip(keys, keys[1:])]
    return {
        "per_run": per_run, "shards": shards, "prompts_backfill_s": prompts_s, "window_s": window, "ideal_s": ideal, "p10": ideal / window, "command_s": command_s,
        "runs": len(runs), "generation_runs": len(generation_runs), "prompts_runs": len(prompts_runs), "most_live_runs": most[0],
        "in_flight_mean": in_flight_mean(served, args.concurrency),
        "shard_window_median_s": statistics.median(hi - lo for lo, hi in spans.values()),
        "gap_median_s": statistics.median(gaps) if gaps else 0.0, "overlapping_boundaries": sum(g < 0 for g in gaps), "boundaries": len(gaps),
        "capped": sum(completion_tokens(i, args.max_tokens, args.median, args.sigma) >= args.max_tokens for i in order),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=128, help="vllm_server.concurrency and the stub's cap on sequences")
    parser.add_argument("--max-tokens", type=int, default=2048, help="the demo target's context is 4,096: 2,048 leaves room for prompts")
    parser.add_argument("--capped-trace-s", type=float, default=10.0, help="seconds a response of max_tokens takes to decode")
    parser.add_argument("--median", type=float, default=400.0, help="median response length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the response lengths")
    parser.add_argument("--per-run", default=f"{SHARDS_PER_RUN.get()},1", help="shards per run of each backfill, comma separated")
    parser.add_argument("--baseline-shards", type=int, default=5, help="shards of the 1-shard-per-run backfill (each run pays its start)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--separate", action="store_true", help="backfill prompts first, then raw_responses (not the whole graph at once)")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-p10-") as tmp:
        root = Path(tmp)
        prompts_path = root / "prompts.jsonl"
        write_prompts(prompts_path, args.shards * args.shard_size)
        for per_run in [int(x) for x in args.per_run.split(",")]:
            shards = args.shards if per_run > 1 else min(args.shards, args.baseline_shards)
            print(f"backfill of {shards} shards x {args.shard_size} prompts, {per_run} shard(s) per run ...", flush=True)
            result = one_backfill(args, per_run, shards, root, prompts_path)
            results.append(result)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}), flush=True)

    form = "--assets prompts, then --assets raw_responses" if args.separate else "--all --assets prompts,raw_responses --wait (one backfill)"
    print(
        f"\nP10: {args.shards} shards x {args.shard_size} prompts, backfill {form}, concurrency {args.concurrency}, max_tokens {args.max_tokens} "
        f"(a capped trace {args.capped_trace_s:g} s; lengths log-normal, median {args.median:g}, sigma {args.sigma:g}; "
        f"{results[0]['capped']} capped)"
    )
    print("| shards per run | shards | runs of prompts | runs of raw_responses | most run processes alive | generation window | ideal (concurrency always in flight) | P10 = ideal / window | in flight (mean) | backfill command | shard window (median) | gap between shards (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['per_run']} | {r['shards']} | {r['prompts_runs']} | {r['generation_runs']} | {r['most_live_runs']} | {r['window_s']:.1f} s | {r['ideal_s']:.1f} s | "
            f"**{r['p10']:.3f}** | {r['in_flight_mean']:.1f} of {args.concurrency} | {r['command_s']:.1f} s | {r['shard_window_median_s']:.1f} s | {r['gap_median_s']:.1f} s "
            f"({r['overlapping_boundaries']} of {r['boundaries']} boundaries overlapped) |"
        )


if __name__ == "__main__":
    main()
