"""Acceptance length of an EAGLE-3 draft, measured through vLLM speculative decoding.

The target is served three ways on the same held-out prompts, greedy, same
``max_tokens``: alone (the throughput reference), with the trained draft, and
with a baseline draft (an untrained draft of the same shape, or the checkpoint
training started from). vLLM's own ``/metrics`` counters, read before and
after each pass, give the mean acceptance length (1 + accepted / drafts) and
the acceptance rate per draft position. On a CPU the speedup is below 1 for a
tiny target (the draft costs about as much as the target): speedup is a GPU
figure, acceptance length is the portable one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3_assets.core.generation.openai_client import async_openai_client
from eagle3_assets.core.gpu_host.stage_jobs import EVAL_MAX_TOKENS
from eagle3_assets.core.serving.deployment import speculative_config
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.serving.vllm_launcher import VLLMServer
from eagle3_assets.core.serving.vllm_metrics import SpecDecodeCounters, fetch_metrics_text




@dataclass(frozen=True)
class PassResult:
    """One pass of the prompts through one server configuration."""

    label: str
    prompts: int
    failed: int
    output_tokens: int
    wall_s: float
    mean_acceptance_length: float | None = None
    acceptance_rate_per_position: list[float] | None = None
    drafts: float | None = None
    accepted: float | None = None
    # One prompt at a time (the held-out sets' passes): each prompt's own acceptance length, for the spread.
    per_prompt_acceptance_length: list[float] | None = None
    # This server's passes over the other held-out sets, by set name (not in to_dict: the report lists them per set).
    per_set: dict[str, "PassResult"] = field(default_factory=dict, compare=False)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "per_set"}
        described = {**fields, "output_tokens_per_s": self.output_tokens_per_s}
        if self.per_prompt_acceptance_length:
            described["spread_over_prompts"] = spread(self.per_prompt_acceptance_length)
        return described


def spread(values: Sequence[float]) -> dict:
    """How the per-prompt acceptance lengths spread: min, deciles, median, max and standard deviation."""
    import statistics

    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731  the nearest-rank quantile
    return {
        "min": round(ordered[0], 4), "p10": round(at(0.1), 4), "median": round(statistics.median(ordered), 4),
        "p90": round(at(0.9), 4), "max": round(ordered[-1], 4),
        "stdev": round(statistics.pstdev(ordered), 4),
    }  # fmt: skip


async def _send_all(base_url: str, model: str, conversations: Sequence[list[dict]], max_tokens: int, concurrency: int):
    """Completion tokens per conversation, None where the request failed (no retries: a failed request is counted)."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    async with async_openai_client(base_url, connect_timeout_s=10, read_timeout_s=1800, max_retries=0) as client:

        async def one(messages: list[dict]) -> int | None:
            async with gate:
                try:
                    response = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0)
                    return int(response.usage.completion_tokens)
                except (openai.APIError, AttributeError, TypeError, ValueError):  # AttributeError, TypeError: no usage
                    return None

        return await asyncio.gather(*(one(m) for m in conversations))


def run_pass(
    label: str, base_url: str, model: str, conversations: Sequence[list[dict]], max_tokens: int, concurrency: int = 8, speculative: bool = True
) -> PassResult:
    """Send every conversation once; with ``speculative``, diff the spec-decode counters around it."""
    before = SpecDecodeCounters.from_metrics(fetch_metrics_text(base_url)) if speculative else None
    started = time.monotonic()
    tokens = asyncio.run(_send_all(base_url, model, conversations, max_tokens, concurrency))
    wall = time.monotonic() - started
    done = [t for t in tokens if t is not None]
    result = PassResult(label, len(tokens), len(tokens) - len(done), sum(done), wall)
    if before is None:
        return result
    delta = SpecDecodeCounters.from_metrics(fetch_metrics_text(base_url)).minus(before)
    return PassResult(
        **{k: v for k, v in asdict(result).items() if k in ("label", "prompts", "failed", "output_tokens", "wall_s")},
        mean_acceptance_length=delta.mean_acceptance_length,
        acceptance_rate_per_position=delta.acceptance_rate_per_position,
        drafts=delta.drafts,
        accepted=delta.accepted,
    )


def settled_counters(base_url: str, tries: int = 5) -> SpecDecodeCounters:
    """The spec-decode counters once two reads agree: the last step of a request may reach /metrics just after its reply."""
    counters = SpecDecodeCounters.from_metrics(fetch_metrics_text(base_url))
    for _ in range(tries):
        time.sleep(0.02)
        again = SpecDecodeCounters.from_metrics(fetch_metrics_text(base_url))
        if again == counters:
            break
        counters = again
    return counters


def run_pass_per_prompt(label: str, base_url: str, model: str, conversations: Sequence[list[dict]], max_tokens: int) -> PassResult:
    """Send the conversations one at a time, diffing the counters around each: the pass's figures and each prompt's.

    Sequential, so its wall time is no throughput figure; the totals equal one diff around the whole pass.
    """
    first = previous = settled_counters(base_url)
    started = time.monotonic()
    tokens, lengths = [], []
    for messages in conversations:
        (completion,) = asyncio.run(_send_all(base_url, model, [messages], max_tokens, 1))
        now = settled_counters(base_url)
        tokens.append(completion)
        if completion is not None:
            lengths.append(now.minus(previous).mean_acceptance_length)
        previous = now
    wall = time.monotonic() - started
    total = previous.minus(first)
    done = [t for t in tokens if t is not None]
    return PassResult(
        label, len(tokens), len(tokens) - len(done), sum(done), wall,
        mean_acceptance_length=total.mean_acceptance_length, acceptance_rate_per_position=total.acceptance_rate_per_position,
        drafts=total.drafts, accepted=total.accepted, per_prompt_acceptance_length=lengths,
    )  # fmt: skip


def evaluation_servers(
    target_dir: Path,
    drafts: dict[str, Path],
    num_speculative_tokens: int = 3,
    *,
    profile: ServingProfile | None = None,
    context: int | None = None,
    include_reference: bool = True,
    server_log_dir: Path | None = None,
    k_by_label: dict[str, int] | None = None,
) -> list[tuple[str, VLLMServer]]:
    """The servers evaluation starts, one after the other: the target alone (``reference``), then with each draft.

    Each from the target's serving ``profile``; a draft adds only its ``speculative_config``.
    """
    k_by_label = k_by_label or {}
    setups: list[tuple[str, dict]] = [("reference", {})] if include_reference else []
    setups += [
        (label, {"speculative_config": speculative_config(str(path), k_by_label.get(label, num_speculative_tokens))})
        for label, path in drafts.items()
    ]
    return [
        (
            label,
            VLLMServer(
                target_dir, profile=profile, context=context, site_args=site_args,
                log_path=(server_log_dir / f"vllm-{label}.log") if server_log_dir else None,
            ),
        )
        for label, site_args in setups
    ]  # fmt: skip


def evaluate(
    target_dir: Path,
    drafts: dict[str, Path],
    conversations: Sequence[list[dict]],
    num_speculative_tokens: int = 3,
    max_tokens: int = EVAL_MAX_TOKENS,
    concurrency: int = 8,
    include_reference: bool = True,
    server_log_dir: Path | None = None,
    log: Callable[[str], None] = print,
    profile: ServingProfile | None = None,
    k_by_label: dict[str, int] | None = None,
    prompt_sets: dict[str, Sequence[list[dict]]] | None = None,
) -> dict[str, PassResult]:
    """Serve the target alone (``reference``) and with each draft in turn; one pass each.

    ``prompt_sets``: held-out sets each draft server (not those of ``k_by_label``) also serves, one prompt at a
    time, while it is up: more requests to the same server, no other start; in each result's ``per_set``.

    ``profile``: how vLLM serves the target (:class:`~eagle3_assets.core.serving.profile.ServingProfile`,
    default: the environment's). ``k_by_label``: a draft's own ``num_speculative_tokens`` where it differs from
    the common one (the same draft served at several k, each under its label).
    """
    results: dict[str, PassResult] = {}
    servers = evaluation_servers(
        target_dir, drafts, num_speculative_tokens, profile=profile, include_reference=include_reference,
        server_log_dir=server_log_dir, k_by_label=k_by_label,
    )  # fmt: skip
    for label, server in servers:
        log(f"evaluation: serving the target for '{label}'")
        speculative = "speculative_config" in server.launch.engine_args
        with server:
            results[label] = run_pass(label, server.base_url, server.served_model_name, conversations, max_tokens, concurrency, speculative=speculative)
            if speculative and label not in (k_by_label or {}):
                for name, prompts in (prompt_sets or {}).items():
                    log(f"evaluation: {label}: held-out set '{name}', {len(prompts)} prompts one at a time")
                    results[label].per_set[name] = run_pass_per_prompt(label, server.base_url, server.served_model_name, prompts, max_tokens)
        r = results[label]
        acceptance = f", acceptance length {r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else ""
        log(f"evaluation: {label}: {r.output_tokens} tokens in {r.wall_s:.1f}s ({r.output_tokens_per_s:.0f} tok/s){acceptance}")
    return results


def untrained_twin(trained_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised draft of the trained draft's exact form and shape, vocabulary map and layer ids.

    It is the baseline that says what training bought: vLLM runs it through the
    same code path, so any acceptance above its figure is the training's.
    """
    import torch

    from eagle3_assets.core.draft.forms import new_draft
    from eagle3_assets.core.draft.export import draft_config_from_hf, export_draft, read_draft_dir

    hf, tensors = read_draft_dir(trained_dir)
    config, _ = draft_config_from_hf(hf, str(trained_dir))
    torch.manual_seed(seed)
    model = new_draft(config)  # the trained draft's form
    if "d2t" in tensors:
        d2t = tensors["d2t"].to(torch.int64)
        t2d = tensors.get("t2d")
        if t2d is None:  # vLLM ignores t2d, so an export may leave it out: rebuild it from d2t
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[torch.arange(d2t.numel()) + d2t] = True
        model.set_vocab_mapping(d2t, t2d.to(torch.bool))
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    return export_draft(model, out_dir, dtype=dtype)


def load_conversations(source: str) -> tuple[list[str], list[list[dict]]]:
    """Ids and messages of an evaluation prompt set (any dataset form the prompts asset reads)."""
    from eagle3_assets.core.prompts.records import RowRejected, normalise_record
    from eagle3_assets.core.prompts.sources import iter_dataset_rows

    ids, conversations = [], []
    for row in iter_dataset_rows(source):
        if row.parse_error is not None:
            raise ValueError(f"evaluation prompts {source}, line {row.row_index + 1}: {row.parse_error}")
        try:
            sample_id, messages = normalise_record(row.record)
        except RowRejected as exc:
            raise ValueError(f"evaluation prompts {source}, row {row.row_index + 1}: {exc}") from None
        ids.append(sample_id)
        conversations.append(messages)
    if not conversations:
        raise ValueError(f"evaluation prompts {source}: no prompts")
    return ids, conversations


def render_positions(rates: dict[str, list[float]]) -> str:
    """Acceptance rate per draft position, one bar per draft, as a markdown table the UI shows."""
    rows = ["| position | " + " | ".join(rates) + " |", "| --- |" + " --- |" * len(rates)]
    width = max((len(r) for r in rates.values()), default=0)
    for i in range(width):
        cells = [f"{r[i]:.3f} `{'#' * round(r[i] * 20):<20}`" if i < len(r) else "" for r in rates.values()]
        rows.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
