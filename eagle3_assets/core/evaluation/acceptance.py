"""Acceptance length of an EAGLE-3 draft, measured through vLLM speculative decoding.

The target is served three ways on the same held-out prompts, greedy, same
``max_tokens``: alone (the throughput reference), with the trained draft, and
with a baseline draft (an untrained draft of the same shape, or the checkpoint
training started from). vLLM's own ``/metrics`` counters, read before and
after each pass, give the mean acceptance length (1 + accepted / drafts) and
the acceptance rate per draft position; each response's own spec-decode counts
(:mod:`~eagle3_assets.core.evaluation.spread`) give each prompt's figure in the same
concurrent pass. On a CPU the speedup is below 1 for a
tiny target (the draft costs about as much as the target): speedup is a GPU
figure, acceptance length is the portable one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from eagle3_assets.core.generation.openai_client import async_openai_client
from eagle3_assets.core.evaluation.job import EVAL_MAX_TOKENS
from eagle3_assets.core.serving.deployment import speculative_config
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.core.serving.vllm_launcher import VLLMServer
from eagle3_assets.core.evaluation.spread import (
    FROM_COUNTERS, FROM_RESPONSES, PER_REQUEST_METRICS_ARG, PER_REQUEST_METRICS_LEVEL, PromptAcceptance, per_request_metrics_supported, spread,
)  # fmt: skip
from eagle3_assets.core.serving.vllm_metrics import SpecDecodeCounters, fetch_metrics_text
from eagle3_assets.core.evaluation.output_position import RequestSteps, by_output_position




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
    # Each prompt's own acceptance length and drafts, in the prompts' order (None: no figure for that prompt), from
    # the responses (a concurrent pass on a vLLM with per-request metrics) or from the counters around each prompt
    # (the held-out sets' one-at-a-time passes): ``per_prompt_source`` says which.
    per_prompt_acceptance_length: list[float | None] | None = None
    per_prompt_drafts: list[int | None] | None = None
    per_prompt_source: str = ""
    # Each prompt's verify steps beside its completion, where the server returned them (the ``detailed`` level): not
    # in to_dict (thousands of steps per prompt at long traces); their sum per output position is, as by_output_position.
    per_prompt_steps: list[RequestSteps | None] | None = field(default=None, compare=False)
    # This server's passes over the other held-out sets, by set name (not in to_dict: the report lists them per set).
    per_set: dict[str, "PassResult"] = field(default_factory=dict, compare=False)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("per_set", "per_prompt_steps")}
        described = {**fields, "output_tokens_per_s": self.output_tokens_per_s}
        if self.per_prompt_acceptance_length:
            described["spread_over_prompts"] = self.spread_over_prompts()
        if self.per_prompt_steps and any(s is not None for s in self.per_prompt_steps):
            described["by_output_position"] = by_output_position(self.per_prompt_steps)
        return described

    def spread_over_prompts(self) -> dict | None:
        """The per-prompt figures' spread, the mean's 95 % interval, and the share of the pass's drafts they cover (1.0
        when every prompt has its figure: a check that the per-prompt counts add up to the server's counters)."""
        if not self.per_prompt_acceptance_length:
            return None
        described = spread(self.per_prompt_acceptance_length, self.per_prompt_drafts, self.per_prompt_source)
        if self.drafts and "drafts" in described:
            described["share_of_pass_drafts"] = round(described["drafts"] / self.drafts, 4)
        return described


@dataclass(frozen=True)
class Reply:
    completion_tokens: int | None  # None: the request failed
    acceptance: PromptAcceptance | None = None  # the server's own count for this request, where it returns one


def sampling_args(temperature: float, position: int) -> dict:
    """A request's sampling: greedy at 0; above it, seeded by the prompt's position in its set, so that every
    draft server (and a rerun) samples each prompt with the same seed."""
    return {"temperature": temperature} if temperature == 0 else {"temperature": temperature, "seed": position}


async def _send_all(
    base_url: str, model: str, conversations: Sequence[list[dict]], max_tokens: int, concurrency: int, temperature: float = 0.0, first: int = 0
) -> list[Reply]:
    """One reply per conversation, in order (no retries: a failed request is counted as failed); ``first``: the
    position of the first conversation in its set (the seed of a sampled request)."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    async with async_openai_client(base_url, connect_timeout_s=10, read_timeout_s=1800, max_retries=0) as client:

        async def one(position: int, messages: list[dict]) -> Reply:
            async with gate:
                try:
                    response = await client.chat.completions.create(
                        model=model, messages=messages, max_tokens=max_tokens, **sampling_args(temperature, position)
                    )
                    return Reply(int(response.usage.completion_tokens), PromptAcceptance.from_response(response))
                except (openai.APIError, AttributeError, TypeError, ValueError):  # AttributeError, TypeError: no usage
                    return Reply(None)

        return await asyncio.gather(*(one(first + i, m) for i, m in enumerate(conversations)))


def run_pass(
    label: str, base_url: str, model: str, conversations: Sequence[list[dict]], max_tokens: int, concurrency: int = 8, speculative: bool = True,
    temperature: float = 0.0,
) -> PassResult:
    """Send every conversation once; with ``speculative``, diff the spec-decode counters around it, and keep each
    prompt's own figures where the server returns them (:mod:`~eagle3_assets.core.evaluation.spread`)."""
    before = settled_counters(base_url) if speculative else None
    started = time.monotonic()
    replies = asyncio.run(_send_all(base_url, model, conversations, max_tokens, concurrency, temperature))
    wall = time.monotonic() - started
    done = [r.completion_tokens for r in replies if r.completion_tokens is not None]
    result = PassResult(label, len(replies), len(replies) - len(done), sum(done), wall)
    if before is None:
        return result
    delta = settled_counters(base_url).minus(before)
    per_prompt = {}
    if any(r.acceptance is not None for r in replies):
        per_prompt = {
            "per_prompt_acceptance_length": [r.acceptance.mean_acceptance_length if r.acceptance else None for r in replies],
            "per_prompt_drafts": [r.acceptance.drafts if r.acceptance else None for r in replies],
            "per_prompt_source": FROM_RESPONSES,
            "per_prompt_steps": [r.acceptance.steps(r.completion_tokens) if r.acceptance else None for r in replies],
        }
    return PassResult(
        **{k: v for k, v in asdict(result).items() if k in ("label", "prompts", "failed", "output_tokens", "wall_s")},
        mean_acceptance_length=delta.mean_acceptance_length,
        acceptance_rate_per_position=delta.acceptance_rate_per_position,
        drafts=delta.drafts,
        accepted=delta.accepted,
        **per_prompt,
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


def run_pass_per_prompt(
    label: str, base_url: str, model: str, conversations: Sequence[list[dict]], max_tokens: int, temperature: float = 0.0
) -> PassResult:
    """Send the conversations one at a time, diffing the counters around each: the pass's figures and each prompt's.

    Sequential, so its wall time is no throughput figure; the totals equal one diff around the whole pass.
    """
    first = previous = settled_counters(base_url)
    started = time.monotonic()
    tokens, lengths, drafts = [], [], []
    for position, messages in enumerate(conversations):
        (reply,) = asyncio.run(_send_all(base_url, model, [messages], max_tokens, 1, temperature, first=position))
        now = settled_counters(base_url)
        this = now.minus(previous)
        tokens.append(reply.completion_tokens)
        answered = reply.completion_tokens is not None and this.drafts > 0  # a prompt without a draft has no figure
        lengths.append(this.mean_acceptance_length if answered else None)
        drafts.append(int(this.drafts) if answered else None)
        previous = now
    wall = time.monotonic() - started
    total = previous.minus(first)
    done = [t for t in tokens if t is not None]
    return PassResult(
        label, len(tokens), len(tokens) - len(done), sum(done), wall,
        mean_acceptance_length=total.mean_acceptance_length, acceptance_rate_per_position=total.acceptance_rate_per_position,
        drafts=total.drafts, accepted=total.accepted, per_prompt_acceptance_length=lengths, per_prompt_drafts=drafts,
        per_prompt_source=FROM_COUNTERS,
    )  # fmt: skip


def evaluation_servers(
    target_dir: Path,
    drafts: dict[str, Path],
    num_speculative_tokens: int = 3,
    *,
    profile: ServingProfile,
    context: int | None = None,
    include_reference: bool = True,
    server_log_dir: Path | None = None,
    k_by_label: dict[str, int] | None = None,
    per_request_metrics: bool | None = None,
    draft_sample_method: str = "greedy",
) -> list[tuple[str, VLLMServer]]:
    """The servers evaluation starts, one after the other: the target alone (``reference``), then with each draft.

    Each from the target's serving ``profile``; a draft adds its ``speculative_config`` and, with
    ``per_request_metrics`` (default: where this host's vLLM has them), vLLM's per-request spec-decode counts, so
    that each response says what its prompt accepted (:mod:`~eagle3_assets.core.evaluation.spread`).
    """
    k_by_label = k_by_label or {}
    if per_request_metrics is None:
        per_request_metrics = bool(drafts) and per_request_metrics_supported()
    counted = {PER_REQUEST_METRICS_ARG: PER_REQUEST_METRICS_LEVEL} if per_request_metrics else {}
    setups: list[tuple[str, dict]] = [("reference", {})] if include_reference else []
    setups += [
        (label, {"speculative_config": speculative_config(str(path), k_by_label.get(label, num_speculative_tokens), draft_sample_method), **counted})
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
    *,
    profile: ServingProfile,
    k_by_label: dict[str, int] | None = None,
    prompt_sets: dict[str, Sequence[list[dict]]] | None = None,
    temperature: float = 0.0,
    draft_sample_method: str = "greedy",
) -> dict[str, PassResult]:
    """Serve the target alone (``reference``) and with each draft in turn; one pass each.

    ``prompt_sets``: held-out sets each draft server (not those of ``k_by_label``) also serves while it is up:
    more requests to the same server, no other start; in each result's ``per_set``. Where the server returns each
    request's own spec-decode counts (:mod:`~eagle3_assets.core.evaluation.spread`), a set is one concurrent pass
    like the standard one, and the set that *is* the standard set (same conversations) is that pass itself;
    otherwise a set is served one prompt at a time, the counters read around each prompt.

    ``profile``: how vLLM serves the target (:class:`~eagle3_assets.core.serving.profile.ServingProfile`,
    required: no fallback to the environment's). ``k_by_label``: a draft's own ``num_speculative_tokens`` where it differs from
    the common one (the same draft served at several k, each under its label). ``temperature``: 0 is greedy;
    above it every request is sampled, seeded by its prompt's position (:func:`sampling_args`), and
    ``draft_sample_method`` says how the drafts propose (:func:`~eagle3_assets.core.serving.deployment.speculative_config`).
    """
    results: dict[str, PassResult] = {}
    servers = evaluation_servers(
        target_dir, drafts, num_speculative_tokens, profile=profile, include_reference=include_reference,
        server_log_dir=server_log_dir, k_by_label=k_by_label, draft_sample_method=draft_sample_method,
    )  # fmt: skip
    for label, server in servers:
        log(f"evaluation: serving the target for '{label}'")
        speculative = "speculative_config" in server.launch.engine_args
        with server:
            results[label] = run_pass(
                label, server.base_url, server.served_model_name, conversations, max_tokens, concurrency, speculative=speculative, temperature=temperature
            )
            if speculative and label not in (k_by_label or {}):
                main_pass = results[label]
                counted = main_pass.per_prompt_source == FROM_RESPONSES
                for name, prompts in (prompt_sets or {}).items():
                    if counted and list(prompts) == list(conversations):
                        main_pass.per_set[name] = replace(main_pass, per_set={})
                    elif counted:
                        log(f"evaluation: {label}: held-out set '{name}', {len(prompts)} prompts, {concurrency} in flight")
                        main_pass.per_set[name] = run_pass(
                            label, server.base_url, server.served_model_name, prompts, max_tokens, concurrency, temperature=temperature
                        )
                    else:
                        log(f"evaluation: {label}: held-out set '{name}', {len(prompts)} prompts one at a time")
                        main_pass.per_set[name] = run_pass_per_prompt(
                            label, server.base_url, server.served_model_name, prompts, max_tokens, temperature
                        )
        r = results[label]
        acceptance = f", acceptance length {r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else ""
        spread_now = r.spread_over_prompts() or {}
        if spread_now.get("prompts"):
            acceptance += f" (over {spread_now['prompts']} prompts: {spread_now['min']:.2f} to {spread_now['max']:.2f}, median {spread_now['median']:.2f})"
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
