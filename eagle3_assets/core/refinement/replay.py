"""The rejected proposals of a served draft, recovered by replaying it, greedy, on the target's stored states.

vLLM (0.32) returns, per request, how many draft tokens each verify step
accepted (``per_step_accepted``, ``--per-request-spec-decode-metrics
detailed``), but not which token it rejected: the draft's proposals never leave
the server. They are recovered here from what the platform stores anyway: the
completion's token ids and the target's auxiliary states for prompt +
completion (the existing extraction, :mod:`~eagle3_assets.core.extraction`).

**How vLLM drafts** (``vllm/v1/spec_decode/llm_base_proposer.py``,
``SpecDecodeBaseProposer.propose``). After each target step the draft runs once
over the positions the target just verified: at position ``i`` it reads the
target's fused states of ``i`` and the token at ``i + 1`` (the last one: the
token the target has just sampled), writing its KV cache there; from the last
verified position ``t`` it then drafts ``k`` tokens autoregressively, greedy
(``argmax`` of its logits), each step reading its *own* previous state and
proposal, at positions ``t + 1, t + 2, ...``, over a KV cache that holds the
target-fed keys of every position ``<= t`` (rejected drafts' slots lie beyond
``t`` and are masked by the sequence length, then overwritten). That is the
"training-time test" chain of :mod:`~eagle3_assets.core.draft.model` exactly,
with the draft's own tokens in place of the teacher-forced ones. (At greedy the
tokens make no difference to what is recovered: up to a chain's first mismatch
its own proposals *are* the target's tokens, so the accepted count and the
rejected token are those of the teacher-forced chain; what must be the draft's
own is the state each later step reads.)

**Where each step starts.** The prefill samples output token 0 and drafts
nothing; verify step ``i`` drafts from output position ``o_i = 1 + sum(a_j + 1
for j < i)`` (:meth:`~eagle3_assets.core.evaluation.output_position.RequestSteps.starts`,
``a_j`` the server's accepted counts): its first proposal is for absolute
position ``s = P + o_i`` (``P`` prompt tokens), from the chain that starts at
``t = s - 2`` (the target's states at ``s - 2``, the token at ``s - 1``). Its
accepted count is the length of the prefix of its proposals equal to the
target's tokens at ``s, s + 1, ...`` (greedy verification). The steps are placed
by the server's counts, not the replay's, so that one disagreeing step does not
shift the rest.

**Agreement.** A step is *decided* when the stored tokens settle its count: a
mismatch inside the completion, or all its drafts inside it. The last step a
stop (EOS, ``max_tokens``) cut may have its matching prefix run past the
completion's end, where the target's next tokens are not stored: such a step is
counted as undecided, not compared. The agreement is the share of decided steps
whose replayed count is the server's. Below :data:`AGREEMENT_THRESHOLD` the
replay is refused (:class:`ReplayDisagreement`): its rejected tokens would not
be the ones vLLM rejected.

Dagster-free; memory: ``k`` draft forwards over one sample at a time, no grad.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3_assets.core.draft.export import draft_config_from_hf, read_draft_dir
from eagle3_assets.core.draft.forms import new_draft
from eagle3_assets.core.draft.model import Eagle3Draft
from eagle3_assets.core.evaluation.output_position import RequestSteps

AGREEMENT_THRESHOLD = 0.95  # below it a round is refused: the replayed rejections are not the server's


class ReplayDisagreement(ValueError):
    """The replay's accepted counts agree with the server's on too few steps; the message names the share."""


@dataclass(frozen=True)
class ReplayedStep:
    """One verify step of one request, replayed."""

    output_position: int  # the output position of its first proposal (the step's start)
    drafted: int  # proposals the server verified at this step
    server_accepted: int  # what vLLM counted
    replayed_accepted: int | None  # what the replay counts (None: undecided, the stored tokens end inside its prefix)
    proposals: tuple[int, ...]  # the replayed draft's tokens (target ids), ``drafted`` of them
    # At the replay's first mismatch: the draft's token there and the target's (None: every draft accepted, or undecided).
    rejected_token: int | None = None
    target_token: int | None = None

    @property
    def decided(self) -> bool:
        return self.replayed_accepted is not None

    @property
    def agrees(self) -> bool:
        return self.replayed_accepted == self.server_accepted


@dataclass(frozen=True)
class ReplayAgreement:
    """The replay's counts against the server's, over every step of every replayed request."""

    requests: int
    steps: int
    decided: int  # steps the stored tokens settle
    agreeing: int  # decided steps whose replayed count is the server's
    rejections: int  # decided steps with a rejected proposal (replayed count below drafted)
    # Disagreeing steps by (server's count, replayed count), for the report.
    disagreements: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def share(self) -> float | None:
        return self.agreeing / self.decided if self.decided else None

    def to_dict(self) -> dict:
        return {
            "requests": self.requests, "steps": self.steps, "decided_steps": self.decided, "agreeing_steps": self.agreeing,
            "agreement": round(self.share, 4) if self.share is not None else None, "rejections": self.rejections,
            "threshold": AGREEMENT_THRESHOLD,
            "disagreements": {f"server {s}, replay {r}": n for (s, r), n in sorted(self.disagreements.items())},
        }  # fmt: skip


def draft_from_export(draft_dir: Path | str, target_embedding: torch.Tensor | None = None) -> Eagle3Draft:
    """The draft vLLM serves from ``draft_dir`` (its native export), in float32, eval mode; ``target_embedding``
    (the target's ``embed_tokens`` [V, H]) where the export shares the target's, as vLLM does then."""
    hf, tensors = read_draft_dir(Path(draft_dir))
    config, _ = draft_config_from_hf(hf, str(draft_dir))
    draft = new_draft(config)
    weights = {name: value.float() if value.is_floating_point() else value for name, value in tensors.items()}
    if "embed_tokens.weight" not in weights:
        if target_embedding is None:
            raise ValueError(f"draft {draft_dir} shares the target's embedding: pass target_embedding")
        weights["embed_tokens.weight"] = target_embedding.float()
    if "d2t" not in weights:  # the whole target vocabulary: no map
        weights["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    d2t = weights["d2t"].to(torch.int64)
    weights["d2t"] = d2t
    if "t2d" not in weights:  # vLLM ignores t2d, an export may leave it out
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t] = True
        weights["t2d"] = t2d
    weights["t2d"] = weights["t2d"].to(torch.bool)
    draft.load_state_dict(weights)
    return draft.eval()


@torch.no_grad()
def greedy_proposals(draft: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, k: int) -> torch.Tensor:
    """``out[t, j]``: the target id the draft proposes, greedy, at step ``j`` of the chain that starts at position
    ``t`` (the target's states at ``t``, the token at ``t + 1``): its guess for the token at ``t + 2 + j``.

    Every chain at once: step 0 over the whole sequence (the KV cache vLLM's draft holds of the verified positions),
    then each later step fed, per chain, its own previous state and its own previous proposal (never the target's
    token). ``aux`` [T, 3H] as stored, ``input_ids`` [T]. The last chain reads no next token (a pad, never used).
    """
    dtype = next(draft.parameters()).dtype
    length = input_ids.shape[0]
    ids = torch.cat([input_ids[1:], input_ids.new_zeros(1)])[None]  # the token at t + 1
    positions = torch.arange(length)[None]
    hidden = draft.fuse(aux.to(dtype)[None])
    cache: list = []
    proposals = []
    for step in range(k):
        logits, hidden = draft.step(ids, hidden, positions + step, cache)
        ids = draft.draft_to_target_ids(logits.argmax(-1))  # each chain's own proposal is its next input
        proposals.append(ids[0])
    return torch.stack(proposals, dim=-1)


def replay_request(
    draft: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, prompt_tokens: int, steps: RequestSteps, k: int
) -> list[ReplayedStep]:
    """One request's verify steps replayed on its stored states (``aux`` and ``input_ids`` of prompt + completion).

    ``steps``: the server's per-step counts beside the completion's length, which must add up to it
    (:meth:`RequestSteps.adds_up`); ``k``: the server's ``num_speculative_tokens``.
    """
    total = int(input_ids.shape[0])
    if prompt_tokens + steps.completion_tokens != total:
        raise ValueError(
            f"stored sample of {total} tokens, but the request had {prompt_tokens} prompt and {steps.completion_tokens} completion tokens"
        )
    if aux.shape[0] != total:
        raise ValueError(f"stored states of {aux.shape[0]} positions for {total} tokens")
    if not steps.adds_up():
        raise ValueError(
            f"the server's {len(steps.accepted)} steps do not add up to its {steps.completion_tokens} completion tokens: "
            "the steps' output positions are unknown"
        )
    if any(d > k for d in steps.drafted):
        raise ValueError(f"a step drafted {max(steps.drafted)} tokens, more than k = {k}")
    proposals = greedy_proposals(draft, aux, input_ids, k).tolist() if steps.accepted else []
    tokens = input_ids.tolist()
    replayed = []
    for start, accepted, drafted in zip(steps.starts(), steps.accepted, steps.drafted):
        first = prompt_tokens + start  # absolute position of the step's first proposal
        proposed = proposals[first - 2][:drafted]
        count, rejected, expected = 0, None, None
        while count < drafted and first + count < total and proposed[count] == tokens[first + count]:
            count += 1
        if count < drafted and first + count < total:
            rejected, expected = proposed[count], tokens[first + count]
        decided = count == drafted or first + count < total
        replayed.append(ReplayedStep(start, drafted, accepted, count if decided else None, tuple(proposed), rejected, expected))
    return replayed


def agreement(replayed: Iterable[Sequence[ReplayedStep]]) -> ReplayAgreement:
    """The share of decided steps, over requests, whose replayed count is the server's."""
    requests = steps = decided = agreeing = rejections = 0
    disagreements: Counter = Counter()
    for request in replayed:
        requests += 1
        for step in request:
            steps += 1
            if not step.decided:
                continue
            decided += 1
            agreeing += step.agrees
            rejections += step.replayed_accepted < step.drafted
            if not step.agrees:
                disagreements[(step.server_accepted, step.replayed_accepted)] += 1
    return ReplayAgreement(requests, steps, decided, agreeing, rejections, dict(disagreements))


def check_agreement(result: ReplayAgreement, threshold: float = AGREEMENT_THRESHOLD) -> ReplayAgreement:
    """``result`` when at least ``threshold`` of its decided steps agree; else :class:`ReplayDisagreement`, naming why."""
    share = result.share
    if share is None:
        raise ReplayDisagreement(f"no verify step to check the replay on ({result.steps} steps, none decided by the stored tokens)")
    if share < threshold:
        worst = ", ".join(f"server {s} / replay {r}: {n}" for (s, r), n in sorted(result.disagreements.items(), key=lambda kv: -kv[1])[:3])
        raise ReplayDisagreement(
            f"the replay agrees with the server's accepted counts on {share:.1%} of {result.decided} steps "
            f"({result.agreeing} agree, over {result.requests} requests), below the {threshold:.0%} threshold: "
            f"its rejected tokens would not be the ones vLLM rejected (most frequent disagreements: {worst})"
        )
    return result
