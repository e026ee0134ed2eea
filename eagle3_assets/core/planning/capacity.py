"""The capacity plan: what the whole run of the registered shards needs of disk and GPU time, before the work and while it runs.

Disk, per item:

- hidden states: the tokens of each shard x the bytes one token takes in the
  storage precision (:func:`~eagle3_assets.core.extraction.state_layout.bytes_per_token`:
  8·H + 9 in bf16: 1.00016 x 8·H at H = 7,168; at H = 64 the count is 0.9975 of
  the bytes measured on disk, the safetensors headers being the rest). A
  shard's tokens are its validated traces' where they exist; else its prompts
  x the mean tokens per prompt measured over the validated shards (rejected
  rows included, so the rejection rate is in it), or the configured mean;
- raw responses and validated traces: their bytes per token measured on the
  shards already written, or a first guess until one is;
- checkpoints: the training's step checkpoints (weights and AdamW state in
  float32, the newest ``keep`` of them) and the exported draft.

Against two volumes: the GPU host's (hidden states, checkpoints) and the data
volume of the orchestrator (responses and traces); one volume when both are
the same disk. What is already on disk is not needed again. A volume whose
free bytes cannot be read (an SSH GPU host whose Python does not answer) is
not taken to fit: the plan refuses, naming the volume and why, unless the
risk is accepted by name (``accept_unknown_capacity``), and then says so.
Two ways out are
figured whenever the states do not fit: the 8-bit storage
(``float8_e4m3fn``, half the bytes) and the bounded-disk training (a window
of shards on disk at a time, docs/bounded-disk.md).

Time: generation (generated tokens at the measured output tokens/s of the
shards done), extraction (tokens at the measured extraction tokens/s), and
training (every token x the epochs, at the training tokens/s at the target's
width: measured by a previous training of this target, configured, or
estimated from the step's FLOPs and a device rate: :mod:`.stage_rates`), as hours and GPU-hours,
and an ETA for what remains if the stages run one after another.

Nodes (a GPU host that is a Ray cluster, docs/production.md#ray-cluster):
extraction's wall time divides over its engines, one per node, and each run
of ``shards_per_run`` shards builds an engine on each node it uses (a target
load apiece, in parallel: ``target_load_s`` of wall time per run, and of GPU
time per engine); training's divides over ``training_nodes`` x its GPUs, as
DDP scaling is assumed (not measured), and the schedule fits its epochs to
that world size; generation is the vLLM servers', unchanged. The plan does not
ask the cluster how many nodes it has: :func:`plan_nodes` takes the count from
the configuration, else from the GPU host's ``ray_engines``, else one.

Dagster-free: the asset ``capacity_plan`` gathers the facts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from eagle3_assets.core.extraction.state_layout import DEFAULT_DTYPE, FP8_DTYPE, bytes_per_token
from eagle3_assets.core.planning.stage_rates import Rate, training_epochs

# Raw responses (text, token counts, timings) and validated traces (text again, int32 input_ids, int8 loss_mask)
# per token, before a shard of this run is measured: a first guess, replaced by the measured figure after the first
# shard. The built-in tiny target's files measured 6.7 B/token (3 shards, Parquet-compressed short answers); longer, less repetitive
# text compresses less, so the guess is kept above it. Beside the states (57 KB per token at H = 7,168) it hardly matters.
DEFAULT_RESPONSES_BYTES_PER_TOKEN = 16.0
FLOAT32 = 4
ADAMW_STATES = 2  # exp_avg and exp_avg_sq, float32 each
DEFAULT_KEEP_CHECKPOINTS = 2  # core.training.config: keep_checkpoints


@dataclass(frozen=True)
class ShardFacts:
    """What is known of one shard: its prompts, and what of it is already done."""

    key: str
    prompts: int
    validated_tokens: int | None = None  # tokens of its validated traces (None: not validated yet)
    completion_tokens: int | None = None  # tokens the target generated for it (None: not generated yet)
    responses_bytes: int | None = None  # its raw responses and validated traces on disk
    states_bytes: int | None = None  # its hidden states on disk (None: not extracted)


@dataclass(frozen=True)
class Volume:
    """A disk the run writes to: its free bytes now (None: not measured, ``note`` says why)."""

    name: str
    path: str
    free_bytes: int | None
    device: str = ""  # two volumes with the same non-empty device are one disk
    note: str = ""


@dataclass(frozen=True)
class PlanSettings:
    hidden_size: int
    dtype: str = DEFAULT_DTYPE
    sample_tokens: float | None = None  # configured mean tokens of one validated trace per prompt
    completion_tokens: float | None = None  # configured mean tokens the target generates per prompt
    responses_bytes_per_token: float | None = None  # configured; else measured, else DEFAULT_RESPONSES_BYTES_PER_TOKEN
    draft_parameters: int = 0  # trainable parameters of the draft (its step checkpoints and export)
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    epochs: int | None = None  # the training's epochs; None: the schedule fitted to the projected tokens (10 for a large run)
    window_shards: int = 2  # bounded-disk mode's window, for the way-out figure
    generation_gpus: int = 1
    extraction_gpus: int = 1
    training_gpus: int = 1  # per node
    nodes: int = 1  # extraction engines, one per node of a Ray cluster (plan_nodes)
    training_nodes: int | None = None  # nodes training (draft_checkpoint's nnodes); None: ``nodes``
    target_load_s: float | None = None  # one engine build (a target load), per engine per run; None: not counted
    shards_per_run: int = 20  # shards of one extraction run ($EAGLE3_EXTRACTION_SHARDS_PER_RUN): each run loads the target anew
    # A volume whose free bytes are unknown passes (the risk stated in the plan) instead of refusing the run.
    accept_unknown_capacity: bool = False

    @property
    def nodes_training(self) -> int:
        return self.training_nodes or self.nodes


# The setting that accepts a volume of unknown free bytes, as a user sets it (run config and environment).
ACCEPT_UNKNOWN_SETTING = "accept_unknown_capacity: true (the run config of hidden_states and capacity_plan) or EAGLE3_ACCEPT_UNKNOWN_CAPACITY=1"


@dataclass(frozen=True)
class Need:
    """One volume's verdict: the bytes the rest of the run writes there against its free bytes."""

    volume: Volume
    items: dict[str, int]  # item -> bytes still to write

    @property
    def bytes(self) -> int:
        return sum(self.items.values())

    @property
    def fits(self) -> bool | None:
        """Whether the volume holds what is still to write there; None: its free bytes are unknown (and something is to write)."""
        if self.bytes == 0:
            return True
        return None if self.volume.free_bytes is None else self.bytes <= self.volume.free_bytes

    def unknown_free(self) -> str:
        """The volume, what the run writes there, and why its free bytes are unknown."""
        return f"{self.volume.name} {self.volume.path}: free bytes unknown ({self.volume.note or 'not measured'}); the run writes {human(self.bytes)} there"

    def describe(self) -> str:
        parts = " + ".join(f"{name} {human(b)}" for name, b in self.items.items() if b)
        free = human(self.volume.free_bytes) if self.volume.free_bytes is not None else f"unknown ({self.volume.note})"
        return f"{self.volume.name} {self.volume.path}: needs {human(self.bytes)} ({parts or 'nothing'}), has {free} free"


@dataclass(frozen=True)
class CapacityPlan:
    settings: PlanSettings
    shards: int
    generated: int
    validated: int
    extracted: int
    tokens_per_prompt: float | None
    tokens_per_prompt_source: str
    completion_per_prompt: float | None
    tokens: int  # every shard's, projected
    tokens_to_extract: int
    completion_tokens_to_generate: int
    states_bytes: int  # every shard's, projected
    states_bytes_on_disk: int
    states_bytes_to_write: int
    states_to_write_8bit: int
    bounded_window_bytes: int
    responses_bytes_to_write: int
    responses_bytes_per_token: float
    responses_source: str
    checkpoint_bytes: int
    needs: list[Need]
    rates: dict[str, Rate]
    hours: dict[str, float | None]  # stage -> wall hours of what remains (training: the whole training)
    gpu_hours: dict[str, float | None]
    epochs: int = 0  # the training's, as set or fitted
    unknown: list[str] = field(default_factory=list)  # what the plan could not estimate, and what would tell it
    assumed: list[str] = field(default_factory=list)  # what its figures take for granted without a measurement
    made_at: float = field(default_factory=time.time)

    @property
    def fits(self) -> bool:
        """Whether every volume holds what the rest of the run writes there: False when a measured one cannot, and when
        one's free bytes are unknown, unless that risk is accepted (``accept_unknown_capacity``)."""
        return all(need.fits or (need.fits is None and self.settings.accept_unknown_capacity) for need in self.needs)

    def unjudged(self, states_only: bool = False) -> list[Need]:
        """The volumes whose free bytes are unknown and that the rest of the run writes to (``states_only``: those holding states)."""
        return [n for n in self.needs if n.fits is None and (not states_only or n.items.get("hidden states"))]

    def unknown_refusal(self, states_only: bool = False) -> str | None:
        """Why the run cannot be judged, naming each volume and why its free bytes are unknown; None when every volume
        was measured or the risk is accepted."""
        unknown = self.unjudged(states_only)
        if not unknown or self.settings.accept_unknown_capacity:
            return None
        return "\n".join(
            [f"cannot tell whether the run fits: {n.unknown_free()}" for n in unknown]
            + [
                "ways out:",
                "- make the free space readable (for an ssh GPU host: its gpu_host.python must run; see the note)",
                f"- or accept the risk by name: {ACCEPT_UNKNOWN_SETTING}",
            ]
        )

    def accepted_risks(self) -> list[str]:
        """The volumes of unknown free bytes passed because the risk was accepted, each said as such."""
        if not self.settings.accept_unknown_capacity:
            return []
        return [f"accepted risk (accept_unknown_capacity): {n.unknown_free()}; not checked" for n in self.unjudged()]

    @property
    def projected(self) -> bool:
        """Whether every shard's tokens are known or estimated (False: no shard validated and no configured mean)."""
        return self.tokens_per_prompt is not None or self.validated == self.shards

    @property
    def remaining_hours(self) -> float | None:
        known = [h for h in self.hours.values() if h is not None]
        return sum(known) if len(known) == len(self.hours) else None

    def eta(self) -> str:
        hours = self.remaining_hours
        if hours is None:
            return "unknown (" + ", ".join(f"{stage}: {self.rates[stage].source}" for stage, h in self.hours.items() if h is None) + ")"
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.made_at + hours * 3600)) + f" (in {hours:.1f} h, stages one after another)"

    def states_refusal(self) -> str | None:
        """Why ``hidden_states`` must not start: a volume that holds the states cannot hold the rest of the run, or its free
        bytes are unknown and that risk is not accepted; None when it can."""
        short = [need for need in self.needs if need.fits is False and need.items.get("hidden states")]
        if not short:
            return self.unknown_refusal(states_only=True)
        need = short[0]
        free = need.volume.free_bytes or 0
        lines = [
            f"the whole run does not fit: {need.describe()} "
            f"({need.bytes} > {free} bytes; {self.shards - self.extracted} of {self.shards} registered shard(s) still to extract, "
            f"{self.tokens_to_extract} tokens x {bytes_per_token(self.settings.hidden_size, self.settings.dtype)} B/token, "
            f"{self.settings.dtype}, H={self.settings.hidden_size}; {self.tokens_per_prompt_source})",
            "ways out:",
            f"- 8-bit storage (hidden_states config dtype: {FP8_DTYPE}): the states still to write take {human(self.states_to_write_8bit)}"
            + (" and fit" if self.states_to_write_8bit + need.bytes - need.items["hidden states"] <= free else " (still too many)"),
            f"- bounded-disk training (draft_checkpoint hidden_states_mode: bounded, window_shards: {self.settings.window_shards}): "
            f"at most {human(self.bounded_window_bytes)} of states on disk at a time, no hidden_states partitions (docs/bounded-disk.md)",
            f"- fewer shards: a sample cap (EAGLE3_MAX_SAMPLES) or retiring shards (python -m eagle3_assets.retire), or free "
            f"{human(need.bytes - free)} on {need.volume.path}",
        ]
        return "\n".join(lines)

    def as_metadata(self) -> dict:
        """The figures as plain values (bytes, hours, sources), for the asset's metadata and the bench."""
        return {
            "shards": self.shards,
            "shards_generated": self.generated,
            "shards_validated": self.validated,
            "shards_extracted": self.extracted,
            "tokens_per_prompt": round(self.tokens_per_prompt, 1) if self.tokens_per_prompt else None,
            "tokens_per_prompt_source": self.tokens_per_prompt_source,
            "projected_tokens": self.tokens,
            "hidden_states_bytes": self.states_bytes,
            "hidden_states_bytes_to_write": self.states_bytes_to_write,
            "hidden_states_bytes_to_write_8bit": self.states_to_write_8bit,
            "bounded_window_bytes": self.bounded_window_bytes,
            "responses_bytes_to_write": self.responses_bytes_to_write,
            "checkpoint_bytes": self.checkpoint_bytes,
            "volumes": [
                {"volume": n.volume.name, "path": n.volume.path, "needed_bytes": n.bytes, "free_bytes": n.volume.free_bytes, "fits": n.fits, "items": n.items}
                for n in self.needs
            ],
            "rates_tokens_per_s": {stage: {"tokens_per_s": r.tokens_per_s and round(r.tokens_per_s, 1), "source": r.source} for stage, r in self.rates.items()},
            "hours": {stage: h and round(h, 2) for stage, h in self.hours.items()},
            "training_epochs": self.epochs,
            "gpu_hours": {stage: h and round(h, 2) for stage, h in self.gpu_hours.items()},
            "nodes": {"extraction": self.settings.nodes, "training": self.settings.nodes_training},
            "eta": self.eta(),
            "fits": self.fits,
            "accepted_risks": self.accepted_risks(),
            "unknown": self.unknown,
            "assumed": self.assumed,
        }

    def markdown(self) -> str:
        s = self.settings
        rows = [
            "| item | projected | on disk | still to write |",
            "| --- | --- | --- | --- |",
            f"| hidden states ({s.dtype}, H = {s.hidden_size}) | {human(self.states_bytes)} | {human(self.states_bytes_on_disk)} | {human(self.states_bytes_to_write)} |",
            f"| same in 8-bit ({FP8_DTYPE}) | | | {human(self.states_to_write_8bit)} |",
            f"| bounded-disk window ({s.window_shards} shards) | | | at most {human(self.bounded_window_bytes)} at a time |",
            f"| raw responses + validated traces ({self.responses_bytes_per_token:.1f} B/token, {self.responses_source}) | | | {human(self.responses_bytes_to_write)} |",
            f"| checkpoints ({s.keep_checkpoints} step checkpoints + export) | | | {human(self.checkpoint_bytes)} |",
            "",
            "| volume | needs | free | fits |",
            "| --- | --- | --- | --- |",
        ]
        for need in self.needs:
            free = human(need.volume.free_bytes) if need.volume.free_bytes is not None else f"unknown ({need.volume.note})"
            unknown = "unknown: risk accepted" if s.accept_unknown_capacity else "**unknown: refused**"
            verdict = {True: "yes", False: "**NO**", None: unknown}[need.fits]
            rows.append(f"| {need.volume.name} `{need.volume.path}` | {human(need.bytes)} | {free} | {verdict} |")
        rows += [
            "",
            f"| stage | tokens/s | source | nodes | hours left | GPU-hours left (training: {self.epochs} epochs) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        nodes = {"generation": "its servers", "extraction": str(s.nodes), "training": str(s.nodes_training)}
        for stage, rate in self.rates.items():
            tps = f"{rate.tokens_per_s:,.0f}" if rate.tokens_per_s else "unknown"
            hours, gpu = self.hours[stage], self.gpu_hours[stage]
            rows.append(f"| {stage} | {tps} | {rate.source} | {nodes.get(stage, '')} | {_h(hours)} | {_h(gpu)} |")
        head = (
            f"{self.shards} registered shard(s): {self.generated} generated, {self.validated} validated, {self.extracted} extracted; "
            f"{self.tokens:,} tokens projected ({_tokens_line(self)}). ETA of the rest: {self.eta()}."
        )
        notes = [f"- {line}" for line in self.accepted_risks() + self.unknown + self.assumed]
        return "\n".join([head, "", *rows, *([""] + notes if notes else [])])


def _h(hours: float | None) -> str:
    return "unknown" if hours is None else f"{hours:,.1f}"


def _tokens_line(plan: CapacityPlan) -> str:
    per = f"{plan.tokens_per_prompt:,.0f}" if plan.tokens_per_prompt else "unknown"
    return f"{per} tokens per prompt, {plan.tokens_per_prompt_source}"


def human(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n}"


def checkpoint_bytes(draft_parameters: int, keep: int, export_bytes_per_parameter: int = 2) -> int:
    """Step checkpoints (float32 weights and AdamW's two states, the newest ``keep``) and the exported draft (bf16)."""
    return draft_parameters * (FLOAT32 * (1 + ADAMW_STATES) * keep + export_bytes_per_parameter)


def plan_capacity(
    shards: Sequence[ShardFacts],
    settings: PlanSettings,
    gpu_host: Volume,
    data_volume: Volume,
    rates: dict[str, Rate],
) -> CapacityPlan:
    """The plan for ``shards`` (the registered ones, retired left out by the caller).

    ``rates``: ``generation`` (output tokens/s), ``extraction`` and ``training``
    (tokens/s per GPU), each measured, configured or unknown.
    """
    unknown: list[str] = []
    validated = [s for s in shards if s.validated_tokens is not None]
    validated_prompts = sum(s.prompts for s in validated)
    if validated_prompts:
        per_prompt = sum(s.validated_tokens or 0 for s in validated) / validated_prompts
        source = f"measured over the validated traces of {len(validated)} shard(s)"
    elif settings.sample_tokens:
        per_prompt, source = float(settings.sample_tokens), "configured (sample_tokens)"
    else:
        per_prompt, source = None, "unknown until a shard is validated"
        unknown.append("tokens per prompt: validate a shard, or configure sample_tokens")

    def shard_tokens(s: ShardFacts) -> int:
        if s.validated_tokens is not None:
            return s.validated_tokens
        return round(s.prompts * per_prompt) if per_prompt else 0

    generated = [s for s in shards if s.completion_tokens is not None]
    generated_prompts = sum(s.prompts for s in generated)
    if generated_prompts:
        completion_per_prompt = sum(s.completion_tokens or 0 for s in generated) / generated_prompts
    else:
        completion_per_prompt = settings.completion_tokens or per_prompt  # a trace's length bounds what was generated
    completion_to_generate = round(sum(s.prompts for s in shards if s.completion_tokens is None) * (completion_per_prompt or 0))

    per_token = bytes_per_token(settings.hidden_size, settings.dtype)
    tokens = sum(shard_tokens(s) for s in shards)
    extracted = [s for s in shards if s.states_bytes is not None]
    to_extract = [s for s in shards if s.states_bytes is None]
    tokens_to_extract = sum(shard_tokens(s) for s in to_extract)
    states_to_write = tokens_to_extract * per_token
    states_on_disk = sum(s.states_bytes or 0 for s in extracted)
    largest = sorted((shard_tokens(s) for s in shards), reverse=True)[: max(1, settings.window_shards)]
    window = sum(largest) * per_token

    measured_responses = [(s.responses_bytes, s.validated_tokens) for s in shards if s.responses_bytes and s.validated_tokens]
    if settings.responses_bytes_per_token:
        responses_per_token, responses_source = settings.responses_bytes_per_token, "configured"
    elif measured_responses:
        responses_per_token = sum(b for b, _ in measured_responses) / sum(t for _, t in measured_responses)
        responses_source = f"measured on {len(measured_responses)} shard(s)"
    else:
        responses_per_token, responses_source = DEFAULT_RESPONSES_BYTES_PER_TOKEN, "a first guess until a shard is written"
    responses_to_write = round(sum(shard_tokens(s) for s in shards if s.responses_bytes is None) * responses_per_token)
    checkpoints = checkpoint_bytes(settings.draft_parameters, settings.keep_checkpoints)

    gpu_items = {"hidden states": states_to_write, "checkpoints": checkpoints}
    data_items = {"raw responses + traces": responses_to_write}
    if gpu_host.device and gpu_host.device == data_volume.device:
        one_disk = Volume(f"{gpu_host.name} and {data_volume.name} (one disk)", gpu_host.path, gpu_host.free_bytes, gpu_host.device)
        needs = [Need(one_disk, {**gpu_items, **data_items})]
    else:
        needs = [Need(gpu_host, gpu_items), Need(data_volume, data_items)]

    training_world = settings.training_gpus * settings.nodes_training
    epochs = settings.epochs or training_epochs(tokens, settings.hidden_size, training_world)
    hours = {
        "generation": rates["generation"].hours(completion_to_generate),
        "extraction": rates["extraction"].hours(tokens_to_extract),
        "training": rates["training"].hours(tokens * epochs),
    }
    # Rates are per GPU for extraction and training (a run on n GPUs is n times as fast);
    # generation's is the whole server's, which holds all of its GPUs for the time it runs.
    gpu_hours = {
        "generation": hours["generation"] * settings.generation_gpus if hours["generation"] is not None else None,
        "extraction": hours["extraction"],
        "training": hours["training"],
    }
    if hours["extraction"] is not None:
        hours["extraction"], load_gpu_hours = extraction_wall_hours([shard_tokens(s) for s in to_extract], rates["extraction"], settings)
        gpu_hours["extraction"] += load_gpu_hours
    hours["training"] = hours["training"] / training_world if hours["training"] is not None else None
    for stage, rate in rates.items():
        if not rate.tokens_per_s:
            unknown.append(f"{stage} rate: {rate.source}")
    assumed = node_assumptions(settings, bool(to_extract))
    return CapacityPlan(
        settings=settings,
        shards=len(shards),
        generated=len(generated),
        validated=len(validated),
        extracted=len(extracted),
        tokens_per_prompt=per_prompt,
        tokens_per_prompt_source=source,
        completion_per_prompt=completion_per_prompt,
        tokens=tokens,
        tokens_to_extract=tokens_to_extract,
        completion_tokens_to_generate=completion_to_generate,
        states_bytes=states_on_disk + states_to_write,
        states_bytes_on_disk=states_on_disk,
        states_bytes_to_write=states_to_write,
        states_to_write_8bit=tokens_to_extract * bytes_per_token(settings.hidden_size, FP8_DTYPE),
        bounded_window_bytes=window,
        responses_bytes_to_write=responses_to_write,
        responses_bytes_per_token=responses_per_token,
        responses_source=responses_source,
        checkpoint_bytes=checkpoints,
        needs=needs,
        rates=dict(rates),
        hours=hours,
        gpu_hours=gpu_hours,
        epochs=epochs,
        unknown=unknown,
        assumed=assumed,
    )


def extraction_wall_hours(shard_tokens: Sequence[int], rate: Rate, settings: PlanSettings) -> tuple[float, float]:
    """Extraction's wall hours for shards of ``shard_tokens`` (in backfill order), and the GPU-hours of its target loads.

    The backfill cuts them into runs of ``shards_per_run``; a run builds one engine per node it uses (never more
    than its shards) and hands the shards out as engines free up, so its tokens divide over those engines (ideally:
    a shard is not split, so the last ones may leave engines idle). Each run pays one target load of wall time, the
    engines loading at once, and each engine's load of its GPUs' time.
    """
    assert rate.tokens_per_s
    per_run = max(1, settings.shards_per_run)
    load_s = settings.target_load_s or 0.0
    wall_s = load_gpu_s = 0.0
    for start in range(0, len(shard_tokens), per_run):
        run = shard_tokens[start : start + per_run]
        engines = min(max(1, settings.nodes), len(run))
        wall_s += load_s + sum(run) / rate.tokens_per_s / (settings.extraction_gpus * engines)
        load_gpu_s += load_s * engines * settings.extraction_gpus
    return wall_s / 3600, load_gpu_s / 3600


def node_assumptions(settings: PlanSettings, extracting: bool) -> list[str]:
    """What the hours take for granted about nodes and target loads, said in the plan."""
    lines = []
    if settings.nodes_training > 1:
        lines.append(
            f"training over {settings.nodes_training} nodes x {settings.training_gpus} GPU(s): DDP assumed to scale linearly "
            "(the per-GPU rate of one host; across nodes not measured); set draft_checkpoint's nnodes to match"
        )
    if settings.nodes > 1:
        lines.append(
            f"extraction over {settings.nodes} engines, one per node: the tokens of each run of {settings.shards_per_run} "
            "shards divide over its engines (whole shards: the last ones may leave engines idle)"
        )
    if extracting and settings.target_load_s is None:
        lines.append(
            f"target loads not counted: one per engine per run of {settings.shards_per_run} shards; set target_load_s "
            "(each build's load_s is in <data>/hidden_states/engine_builds.jsonl)"
        )
    return lines


def plan_nodes(configured: int | None, host_mode: str, ray_engines: int) -> tuple[int, str | None]:
    """The nodes the plan spreads extraction (and, unless set apart, training) over, and what to say of the count.

    The plan does not ask the cluster: the count is the configured one, else the GPU host's ``ray_engines`` on a
    Ray cluster, else one. A Ray cluster of every node that fits (``ray_engines`` 0) is counted as one node and said
    so; a count above one on a host that is not a Ray cluster is planned as asked, said as a what-if.
    """
    if configured is not None:
        if configured > 1 and host_mode != "ray":
            return configured, f"nodes {configured} on a GPU host in mode {host_mode!r}: a what-if (this deployment's stages run on one host)"
        return configured, None
    if host_mode == "ray" and ray_engines > 0:
        return ray_engines, None
    if host_mode == "ray":
        return 1, (
            "nodes: the GPU host is a Ray cluster of every node that fits (gpu_host.ray_engines 0), which the plan does not "
            "ask; planned as 1: set capacity_plan's nodes to its GPU nodes"
        )
    return 1, None
