"""``raw_responses``: the target's own reasoning and answer for every prompt of a shard.

Reads ``<data>/prompts/<shard>.parquet``, sends each prompt to the vLLM server
(``vllm_server`` resource) and writes ``<data>/raw_responses/<shard>.parquet``
with exactly one row per prompt (the response, or the error it ended in). While
it runs, finished rows go to ``<shard>.journal.jsonl``: a rerun after a crash
sends only what is not durable yet, plus the rows that ended in an error and
the rows whose response validation would reject for a reason a new generation
can fix (up to ``vllm_server.max_attempts_per_sample`` requests per sample). A
finished shard made with other settings is kept under ``superseded/``, never
overwritten.

Its blocking ``reasoning_present`` check stops the run before validation when
the answered rows lack reasoning (the story's failure), with the canary's
diagnosis; after the server is fixed, one run of the shard sends those rows again.
The share of requests that ended in an error is measured once, by
``validated_traces``' ``request_errors_rare`` (docs/validation.md says why there);
here it is in the metadata (``request_errors``, ``errors_by_kind``).

A run materialises a range of shards (a backfill puts up to
``EAGLE3_SHARDS_PER_RUN`` in one run; the UI's materialise is a range of one):
one pre-flight, then every shard's samples under ONE budget of
``vllm_server.concurrency`` requests in flight, the next shard's samples taking
the places the previous shard's long traces leave
(:func:`~eagle3_assets.core.generation.shard_run.generate_shards`). Each shard
keeps its own lease, journal and Parquet file, and is checked and recorded as
its own partition the moment it is durable (:class:`~eagle3_assets.glue.shard_runs.ShardReporter`),
so a run killed midway keeps the shards it finished and its rerun resumes the others.

The step runs in the Dagster pool ``vllm_generation`` so that a backfill of many
shards does not multiply the requests in flight (see docs/generation.md).
"""

from collections import Counter
from contextlib import ExitStack
from types import SimpleNamespace

import polars as pl
from dagster import AssetExecutionContext, AssetKey, AssetSpec, Failure, MetadataValue, multi_asset

from eagle3_assets.core.generation.completions import Sample
from eagle3_assets.core.generation.shard_resume import ShardJob, ShardOutcome
from eagle3_assets.core.generation.shard_run import generate_shards
from eagle3_assets.core.generation.client import PreflightError
from eagle3_assets.core.generation.report import completion_length_histogram, shard_summary
from eagle3_assets.glue.check_results import AssetChecks
from eagle3_assets.core.generation.gates import RESPONSE_GATES
from eagle3_assets.core.reporting.checks import CheckOutcome
from eagle3_assets.core.generation.redaction import redact_credentials, redact_url
from eagle3_assets.core.generation.response_rules import DEFAULT_MIN_REASONING_SHARE
from eagle3_assets.core.storage.shard_files import quarantine_if_corrupt, read_shard_parquet
from eagle3_assets.core.storage.shard_lease import ShardLease
from eagle3_assets.core.evaluation.job import EVAL_MAX_TOKENS
from eagle3_assets.core.storage.shard_paths import ShardPaths
from eagle3_assets.core.settings import environment as env_vars
from eagle3_assets.core.storage.files import stable_hash
from eagle3_assets.core.validation.gates import check_reasoning_present
from eagle3_assets.glue.partitions import sample_shards
from eagle3_assets.glue.lineage import upstream_version
from eagle3_assets.glue.shard_runs import ShardReporter, shards_per_run_policy
from resources.target_model import TargetModel
from resources.vllm_server import GENERATION_POOL, VLLMServerResource
from eagle3_assets.defs.raw_responses_adoption import RawResponsesConfig, adopt_existing, adoption_lineage, adoption_metadata


CODE_VERSION = "1"


CHECKS = AssetChecks(RESPONSE_GATES)  # the declared gates as this asset's checks


# A backfill puts up to this many shards in one run (a range of shards); from the UI a run is one shard.
SHARDS_PER_RUN = env_vars.SHARDS_PER_RUN.get()


@multi_asset(
    specs=[
        AssetSpec(
            "raw_responses", partitions_def=sample_shards, deps=[AssetKey("prompts")], group_name="generation",
            code_version=CODE_VERSION, kinds={"vllm", "parquet"},
            description="The target's reasoning and answer for every prompt of the shard, regenerated through vLLM; resumable after a crash.",
        )
    ],
    check_specs=CHECKS.specs(),
    can_subset=True,
    backfill_policy=shards_per_run_policy(SHARDS_PER_RUN),
    pool=GENERATION_POOL,
)  # fmt: skip
def raw_responses(context: AssetExecutionContext, config: RawResponsesConfig, vllm_server: VLLMServerResource, target_model: TargetModel):
    """Every shard of the run's range under one in-flight budget; each shard written, checked and recorded as soon as it is durable."""
    keys = list(context.partition_keys)
    where = keys[0] if len(keys) == 1 else f"{keys[0]}..{keys[-1]} ({len(keys)} shards)"
    # Everything the later stages will ask of the target, checked once per run before hours of generation depend on it.
    max_tokens = vllm_server.max_tokens or default_max_tokens(context, target_model, keys)
    problems = target_model.preflight_problems(max_tokens=max_tokens, eval_max_tokens=EVAL_MAX_TOKENS)
    if problems:
        raise Failure(f"raw_responses {where}: the target pre-flight failed, nothing was sent:\n" + "\n".join(f"- {p}" for p in problems))
    reporter = ShardReporter(context, CHECKS, code_version=CODE_VERSION, upstream=["prompts"])
    with ExitStack() as leases:
        # One writer per shard: a shard another run holds fails this run here, naming that run, before any request.
        held = {}
        for key in keys:
            paths = ShardPaths("raw_responses", key)
            held[key] = leases.enter_context(ShardLease(paths.asset_dir, key, asset="raw_responses", run_id=context.run.run_id, log=context.log.info))
        stopped = _generate(context, vllm_server, keys, where, reporter, held, max_tokens, config)
    yield from reporter.results(stopped)


def default_max_tokens(context: AssetExecutionContext, target_model: TargetModel, keys: list[str]) -> int:
    """``vllm_server.max_tokens`` unset: what the target's context leaves beside the run's longest prompt (up to 8,192)."""
    messages = []
    for key in keys:
        path = ShardPaths("prompts", key).parquet
        if path.is_file():
            messages += read_shard_parquet(path, asset="prompts", shard=key, columns=["messages"])["messages"].to_list()
    budget = target_model.completion_budget(messages)
    context.log.info(f"vllm_server.max_tokens unset: {budget} ({target_model.context_length()}-token context, the run's prompts)")
    return budget


def _generate(
    context: AssetExecutionContext, vllm_server: VLLMServerResource, keys: list[str], where: str, reporter: ShardReporter, held,
    max_tokens: int, adoption: RawResponsesConfig,
) -> dict[str, str]:
    """Generates the shards of ``keys`` in one run; returns the shards that stopped and why (the others are reported)."""
    config = vllm_server.generation_config(max_tokens)
    if vllm_server.credentials_in_config():
        context.log.warning(
            "vllm_server.base_urls carries credentials in run config, which Dagster stores with the run; "
            "put the URL with its credentials in EAGLE3_VLLM_URLS and the URL without them in the config"
        )
    stopped: dict[str, str] = {}
    jobs, prompt_ids = [], {}
    for key in keys:
        paths = ShardPaths("raw_responses", key)
        prompts_path = ShardPaths("prompts", key, paths.root).parquet
        if not prompts_path.is_file():
            stopped[key] = f"the shard's prompts are missing ({prompts_path}); materialise `prompts` for {key} first"
            continue
        prompt_rows = read_shard_parquet(prompts_path, asset="prompts", shard=key, columns=["id", "messages"])
        prompt_ids[key] = prompt_rows["id"]
        # A finished Parquet that no longer decodes is moved aside; the journal's rows are kept and the rest is sent again.
        quarantine_if_corrupt(paths.parquet, context.log.warning)
        samples = [Sample(r["id"], r["messages"]) for r in prompt_rows.iter_rows(named=True)]
        adopt_existing(context, adoption, samples, paths, config)  # rows of an existing file first: only the rest is sent
        jobs.append(ShardJob(key, samples, paths.journal, paths.parquet))
    if not jobs:
        return stopped
    context.log.info(
        f"{sum(len(j.samples) for j in jobs)} prompts of {len(jobs)} shard(s) -> {config.model} on {len(config.servers)} server(s), "
        f"{config.concurrency} in flight across the shards, max_tokens {config.max_tokens}"
    )

    def shard_done(key: str, outcome: ShardOutcome) -> None:
        metadata, outcomes = _shard_report(context, key, config, outcome, prompt_ids[key])
        paths = ShardPaths("raw_responses", key)
        version = stable_hash(
            {"prompts": upstream_version(context, "prompts", key, ShardPaths("prompts", key).parquet), "generation": config.identity(), **adoption_lineage(paths)}
        )
        reporter.report(key, metadata, version, outcomes)
        held.pop(key).release()  # durable and recorded: the shard is free for the next writer (a rerun, validation)

    try:
        run = generate_shards(
            config, jobs, on_shard_done=shard_done, log=context.log.info,
            progress_interval_s=vllm_server.progress_interval_s, canary_prompt=vllm_server.canary_prompt,
            canary_max_tokens=vllm_server.canary_max_tokens, canary_client=vllm_server.get_async_client,
        )  # fmt: skip
    except PreflightError as exc:
        raise Failure(f"raw_responses {where}: pre-flight failed, nothing was sent: {exc}") from None
    except Exception as exc:
        if redact_credentials(str(exc)) == str(exc):
            raise
        # An unexpected error quoting a server URL with its credentials: Dagster would store the text (and the
        # chained traceback) in the event log, so only the redacted text goes on.
        raise Failure(f"raw_responses {where}: {type(exc).__name__}: {redact_credentials(str(exc))}") from None
    stopped.update({key: f"stopped: {redact_credentials(str(exc))}" for key, exc in run.stopped.items()})
    return stopped


def _shard_report(context, key: str, config, outcome: ShardOutcome, expected_ids: pl.Series) -> tuple[dict, list[CheckOutcome]]:
    """One durable shard's metadata and gate outcomes."""
    paths = ShardPaths("raw_responses", key)
    parquet_path = paths.parquet
    frame, summary = outcome.frame, shard_summary(outcome.frame)
    reasoning = check_reasoning_present(
        summary["answered_rows"], summary["rows_without_reasoning_ids"], DEFAULT_MIN_REASONING_SHARE, summary["reasoning_fields"]
    )
    kept_generations = [p.relative_to(paths.asset_dir).as_posix() for p in paths.superseded()]
    written_ids = pl.read_parquet(parquet_path, columns=["id"])["id"]
    duplicated = written_ids.filter(written_ids.is_duplicated()).unique().to_list()
    missing = sorted(set(expected_ids) - set(written_ids))
    extra = sorted(set(written_ids) - set(expected_ids))
    context.log.info(
        f"{key}: {frame.height} rows, {summary['errors']} errors, {summary['rows_without_reasoning']} without reasoning, "
        f"finish reasons {summary['finish_reasons']}"
    )
    metadata = {
        "path": MetadataValue.path(str(parquet_path)),
        "dagster/row_count": frame.height,
        "model": config.model,
        "servers": MetadataValue.json(list(config.shown_servers)),
        # Which server answered how many rows, and what failed over: a dead or flaky server shows here.
        "rows_by_server": MetadataValue.json(_by_server(Counter(frame["server"].to_list()))),
        "failed_attempts_by_server": MetadataValue.json(_by_server(outcome.failed_attempts_by_server)),
        "failovers": outcome.failovers,
        "max_model_len": outcome.preflight.max_model_len,
        "sampling": MetadataValue.json({k: v for k, v in config.identity().items() if k != "model"}),
        "reused_rows": outcome.reused,
        "sent_rows": outcome.sent,
        # Durable rows this run sent again, by why ("error: <kind>", or what validation would reject them for).
        "resent_rows": MetadataValue.json(outcome.resent),
        "attempts_exhausted": len(outcome.attempts_exhausted),
        "max_attempts_per_sample": config.max_attempts_per_sample,
        "allow_truncated": config.allow_truncated,
        # Finished generations of this shard made with other settings: kept, never deleted.
        "superseded_this_run": str(outcome.superseded) if outcome.superseded else "",
        "kept_generations": MetadataValue.json(kept_generations),
        "errors": summary["errors"],
        "prompts_too_long": summary["prompts_too_long"],
        "errors_by_kind": MetadataValue.json(summary["errors_by_kind"]),
        # Requests that ended in an error (prompts too long were never sent); validated_traces gates their share.
        "request_errors": summary["request_errors"],
        "error_examples": MetadataValue.json(summary["error_examples"]),
        "rows_without_reasoning": summary["rows_without_reasoning"],
        "finish_reasons": MetadataValue.json(summary["finish_reasons"]),
        "reasoning_fields": MetadataValue.json(summary["reasoning_fields"]),
        # Rows validation can check token by token against the server's own ids (0: the server returned none).
        "rows_with_token_ids": summary["rows_with_token_ids"],
        "return_token_ids": config.return_token_ids,
        "output_tokens_per_s": round(outcome.output_tokens_per_s, 1),
        # From the shard's first request to its last row: its samples share the run's budget with the other shards.
        "generation_wall_s": round(outcome.wall_s, 2),
        "latency_p50_s": summary["latency_p50_s"],
        "latency_p95_s": summary["latency_p95_s"],
        "completion_lengths": MetadataValue.md(completion_length_histogram(frame["completion_tokens"].to_list())),
        **adoption_metadata(paths, frame),
    }
    evidence = SimpleNamespace(
        written_ids=written_ids, expected_ids=expected_ids, duplicated=duplicated, missing=missing, extra=extra,
        reasoning=reasoning.with_evidence(reasoning_fields=summary["reasoning_fields"]),
    )  # fmt: skip
    return metadata, [gate.predicate(evidence) for gate in CHECKS.by_name.values()]


def _by_server(counts) -> dict[str, int]:
    """Counts keyed by server URL, without credentials ("" is a row settled without a request)."""
    named = Counter()
    for server, n in counts.items():
        named[redact_url(server) if server else ""] += int(n)
    return dict(sorted(named.items()))
