"""What the capacity plan is made from, read from the instance, the shards' files and the volumes; and ``hidden_states``' refusal.

Each registered shard's prompts, validated tokens, generated tokens and bytes
on disk (:func:`shard_facts`), the rates the shards' materialisations measured,
and the free space of a volume here or on the GPU host (:func:`volume_at`).
The ``capacity_plan`` asset makes the whole plan from them;
``hidden_states`` calls :func:`refuse_unless_run_fits` before each run: the
states of every registered shard not yet extracted, against the GPU host's
free space. A run that cannot fit stops before its first shard, naming both
numbers and the ways out (8-bit storage, bounded-disk training, fewer shards);
so does one on a host whose free space cannot be read, unless that risk is
accepted (``accept_unknown_capacity``).
Here, not in an asset module, so that no asset module imports another.
"""

import json
import os
import shutil
from pathlib import Path

from dagster import AssetExecutionContext, AssetKey, DagsterInstance, Failure

from eagle3_assets.core.extraction.needs import TRACES, shard_tokens
from eagle3_assets.core.gpu_host.remote import HostError
from eagle3_assets.core.planning.capacity import PlanSettings, ShardFacts, Volume, plan_capacity
from eagle3_assets.core.planning.stage_rates import Rate, measured_rate
from eagle3_assets.core.storage.shard_files import ShardFileError, read_shard_parquet
from eagle3_assets.core.storage.shard_paths import ShardPaths, data_dir
from eagle3_assets.glue.partitions import SAMPLE_SHARDS
from eagle3_assets.glue.shard_status import PAGE, records_filter
from resources.gpu_host import GPUHost
from resources.target_model import TargetModel

# Free bytes and the device of the nearest existing directory of a path, run by an SSH GPU host's own Python
# (volume_at reads the same figures in process for a local one).
_FREE_SPACE = (
    "import json, os, shutil, sys\n"
    "p = os.path.abspath(sys.argv[1])\n"
    "while not os.path.exists(p): p = os.path.dirname(p)\n"
    "print(json.dumps({'path': p, 'free': shutil.disk_usage(p).free, 'device': os.stat(p).st_dev}))\n"
)



def volume_at(name: str, path: str, gpu_host: GPUHost | None = None) -> Volume:
    """The free space at ``path``: on this machine, or on the GPU host through its Python (an ssh host)."""
    try:
        if gpu_host is None or gpu_host.mode == "local":
            p = Path(path).resolve()
            while not p.exists():
                p = p.parent
            return Volume(name, str(path), shutil.disk_usage(p).free, device=f"local:{os.stat(p).st_dev}")
        done = gpu_host.connection().run([gpu_host.python, "-c", _FREE_SPACE, path], timeout_s=gpu_host.preflight_timeout_s)
        report = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None
        if not isinstance(report, dict):
            return Volume(name, path, None, note=f"the host's python did not answer (exit {done.returncode}): {done.stderr.strip()[-200:]}")
        return Volume(name, path, int(report["free"]), device=f"{gpu_host.connection().label}:{report['device']}")
    except (OSError, HostError, ValueError, KeyError) as exc:
        return Volume(name, path, None, note=str(exc))


def latest_metadata(instance: DagsterInstance, asset: str, keys: list[str]) -> dict[str, dict]:
    """Shard -> the metadata of its latest materialisation of ``asset`` (plain values)."""
    found: dict[str, dict] = {}
    wanted = set(keys)
    cursor = None
    while wanted:
        page = instance.fetch_materializations(records_filter(asset, keys), limit=PAGE, cursor=cursor)
        for record in page.records:
            key = record.partition_key
            if key in wanted and key not in found and record.asset_materialization is not None:
                found[key] = {k: getattr(v, "value", v) for k, v in record.asset_materialization.metadata.items()}
        if not page.has_more or len(found) == len(wanted):
            break
        cursor = page.cursor
    return found


def _column_sum(asset: str, key: str, column: str) -> int | None:
    path = ShardPaths(asset, key).parquet
    if not path.is_file():
        return None
    try:
        return int(read_shard_parquet(path, asset=asset, shard=key, columns=[column])[column].sum() or 0)
    except ShardFileError:
        return None  # a damaged file is its own stage's error to name; the plan counts the shard from its prompts


def _validated_tokens(key: str) -> int | None:
    """The shard's validated token count; None when its traces are missing or damaged (then its prompts count)."""
    try:
        return shard_tokens(key)
    except ShardFileError:
        return None


def _files_bytes(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def shard_facts(keys: list[str], prompts: dict[str, int], states: dict[str, dict], responses: bool = True) -> list[ShardFacts]:
    """What is done of each shard, read from its files here (and the states' size from their materialisation when they live on the GPU host).

    ``responses=False`` leaves out what only the full plan needs (generated tokens, the responses' bytes): one file read per shard less.
    """
    facts = []
    for key in keys:
        tokens = _validated_tokens(key)
        written = None
        if tokens is not None and responses:
            traces = ShardPaths(TRACES, key).parquet
            written = _files_bytes(ShardPaths("raw_responses", key).parquet, traces, traces.with_name(f"{key}.rejected.parquet"))
        state_dir = ShardPaths("hidden_states", key)
        if state_dir.sidecar.is_file():
            states_bytes = sum(f.stat().st_size for f in state_dir.directory.iterdir() if f.is_file())
        else:
            states_bytes = states.get(key, {}).get("bytes")
        facts.append(
            ShardFacts(
                key=key,
                prompts=prompts.get(key, 0),
                validated_tokens=tokens,
                completion_tokens=_column_sum("raw_responses", key, "completion_tokens") if responses else None,
                responses_bytes=written,
                states_bytes=int(states_bytes) if states_bytes is not None else None,
            )
        )
    return facts


def prompts_from_files(keys: list[str]) -> dict[str, int]:
    """Prompts per shard from the ``prompts`` files here; a shard not yet read counts as the largest shard seen (a full one)."""
    counts = {}
    for key in keys:
        path = ShardPaths("prompts", key).parquet
        if path.is_file():
            counts[key] = read_shard_parquet(path, asset="prompts", shard=key, columns=["id"]).height
    full = max(counts.values(), default=0)
    return {key: counts.get(key, full) for key in keys}


def measured_rates(instance: DagsterInstance, keys: list[str], states: dict[str, dict]) -> dict[str, Rate | None]:
    """Generation's output tokens/s and extraction's tokens/s over the shards' latest materialisations."""
    generation = latest_metadata(instance, "raw_responses", keys)
    gen = [
        (float(m["output_tokens_per_s"]) * float(m["generation_wall_s"]), float(m["generation_wall_s"]))
        for m in generation.values()
        if m.get("output_tokens_per_s") and m.get("generation_wall_s")
    ]
    ext = []
    for m in states.values():
        if m.get("tokens_per_s") and m.get("bytes") and m.get("bytes_per_token"):
            tokens = float(m["bytes"]) / float(m["bytes_per_token"])
            ext.append((tokens, tokens / float(m["tokens_per_s"])))
    return {"generation": measured_rate(gen, "raw_responses"), "extraction": measured_rate(ext, "hidden_states")}


def measured_training_rate(instance: DagsterInstance, target_hash: str) -> Rate | None:
    """Tokens/s per GPU of the latest draft_checkpoint trained on this target (its width), when there is one."""
    event = instance.get_latest_materialization_event(AssetKey("draft_checkpoint"))
    if event is None or event.asset_materialization is None:
        return None
    metadata = {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}
    target = metadata.get("target") or {}
    rate = metadata.get("train_tokens_per_s") or metadata.get("tokens_per_s")
    if not rate or target.get("config_hash") != target_hash:
        return None
    world = int(metadata.get("world_size") or 1)
    return Rate(float(rate) / world, f"measured by the latest draft_checkpoint of this target ({world} GPU(s))")


# -- hidden_states' refusal


def refuse_unless_run_fits(
    context: AssetExecutionContext, target_model: TargetModel, dtype: str, gpu_host: GPUHost, accept_unknown_capacity: bool = False
) -> None:
    """Before a shard's extraction: refuse when the GPU host cannot hold the states of every registered shard still to extract.

    Also when its free bytes cannot be read, unless ``accept_unknown_capacity``
    (then the run goes ahead with a warning that states the risk).

    The states are nearly all of what the run writes there (checkpoints are a
    few GB beside terabytes); the whole plan, checkpoints and the data volume
    included, is the ``capacity_plan`` asset's.
    """
    keys = sorted(context.instance.get_dynamic_partitions(SAMPLE_SHARDS))
    states = latest_metadata(context.instance, "hidden_states", keys)
    facts = shard_facts(keys, prompts_from_files(keys), states, responses=False)
    volume = volume_at("GPU host", os.path.join(gpu_host.host_data_dir(), "hidden_states"), gpu_host)
    unknown = Rate(None, "not needed for the refusal")
    plan = plan_capacity(
        facts,
        PlanSettings(hidden_size=target_model.hidden_size(), dtype=dtype, accept_unknown_capacity=accept_unknown_capacity),
        volume,
        Volume("data volume", str(data_dir()), None, note="not part of this check"),
        {"generation": unknown, "extraction": unknown, "training": unknown},
    )
    refusal = plan.states_refusal()
    shards = _partitions(context)
    if refusal:
        raise Failure(description=f"hidden_states {shards}: {refusal}", allow_retries=False)
    gpu = plan.needs[0]
    if gpu.fits is None:
        context.log.warning(f"{shards}: the run goes ahead on an accepted risk (accept_unknown_capacity): {gpu.unknown_free()}; not checked")
    else:
        context.log.info(f"{shards}: the run's remaining hidden states fit: {gpu.describe()}")


def _partitions(context: AssetExecutionContext) -> str:
    """The run's shard, or its first and last (a run of several shards)."""
    if context.has_partition_key_range:
        span = context.partition_key_range
        if span.start != span.end:
            return f"{span.start}..{span.end}"
    return context.partition_key
