"""The gates of the per-shard assets that the whole-dataset assets train on: ``validated_traces``' and ``hidden_states``'.

Each table is its asset's checks declared once (name, severity, description,
predicate; :mod:`eagle3_assets.check_results`): the asset builds its check
specs and results from it, and ``vocab_mapping`` and ``draft_checkpoint`` read
its blocking gates to pick the green shards (:func:`eagle3_assets.shard_status.green_shards`).
Here, not in the asset modules, so that no asset module imports another.
"""

from eagle3_assets.check_results import Gate, Gates
from eagle3_assets.core.extraction.needs import TRACES
from eagle3_assets.core.generation.response_rules import DEFAULT_MIN_REASONING_SHARE
from eagle3_assets.core.validation.gates import (
    DEFAULT_MAX_REQUEST_ERROR_SHARE,
    DEFAULT_MAX_TRUNCATION_RATE,
    MAX_THINK_MARKER_SHARE,
    check_loss_mask_aligned,
    check_prompts_fit_context,
    check_reasoning_present,
    check_request_errors_rare,
    check_responses_accounted,
    check_think_markers_absent,
    check_traces_present,
    check_truncation_rate_low,
)

STATES = "hidden_states"

# The evidence each predicate reads: the shard's summary, this run's config, the loss-mask audit, the ids written.
TRACE_GATES = Gates(
    TRACES,
    [
        Gate(
            "traces_present", True, "at least one row of the shard was kept",
            lambda e: check_traces_present(e.summary.kept, e.summary.rejected_by_reason, e.summary.rejected_examples),
        ),
        Gate(
            "reasoning_present", True,
            f"enough of the rows that got a response carry non-empty reasoning (default {DEFAULT_MIN_REASONING_SHARE:.0%})",
            lambda e: check_reasoning_present(
                e.summary.answered_rows, e.summary.ids_without_reasoning, e.config.min_reasoning_share, e.summary.reasoning_fields
            ),
        ),
        Gate(
            "responses_accounted", True, "raw rows = kept + rejected, raw ids unique, every prompt of the shard answered",
            lambda e: check_responses_accounted(e.summary.raw_ids, e.summary.prompt_ids, e.kept_ids, e.rejected_ids),
        ),
        Gate(
            "loss_mask_aligned", True,
            "every kept row supervises exactly the target's output: reasoning, think markers, answer, end of turn; "
            "token by token against the server's own ids where raw_responses has them",
            lambda e: check_loss_mask_aligned(e.alignment),
        ),
        # The one measure of failed requests (raw_responses has none): blocking, because past it the server or the
        # network is failing, and a rerun of raw_responses for the shard sends the errored rows again.
        Gate(
            "request_errors_rare", True,
            "few requests ended in an error, the server's or the network's failure "
            f"(default at most {DEFAULT_MAX_REQUEST_ERROR_SHARE:.0%} of the requests sent; prompts too long were never sent)",
            lambda e: check_request_errors_rare(
                e.summary.raw_rows, e.summary.request_error_ids, e.summary.request_errors_by_kind,
                len(e.summary.prompt_too_long_ids), e.config.max_request_error_share,
            ),
        ),
        Gate(
            "truncation_rate_low", False, f"few generations hit max_tokens (default at most {DEFAULT_MAX_TRUNCATION_RATE:.0%})",
            lambda e: check_truncation_rate_low(e.summary.raw_rows, e.summary.truncated_ids, e.config.max_truncation_rate),
        ),
        Gate(
            "think_markers_absent", False, f"at most {MAX_THINK_MARKER_SHARE:.0%} of the raw rows hold a think marker inside reasoning or answer",
            lambda e: check_think_markers_absent(e.summary.raw_rows, e.summary.think_marker_ids, e.markers),
        ),
        Gate(
            "prompts_fit_context", False,
            "no prompt is longer than the server's context (such prompts are rejected as prompt_too_long, never sent)",
            lambda e: check_prompts_fit_context(e.summary.raw_rows, e.summary.prompt_too_long_ids),
        ),
    ],
)  # fmt: skip


# Computed on the GPU host, next to the files; all block training on a shard whose states are wrong.
STATE_GATES = Gates(
    STATES,
    [
        Gate(
            "target_matches_traces", True,
            "the model that extracts is the one whose tokenizer and template rendered the traces (same config "
            "hash); compared before extraction, so a wrong target costs no GPU time",
        ),
        Gate("states_finite", True, "no NaN or Inf in any stored state"),
        Gate("states_match_traces", True, "exactly the validated traces' ids, each with the same tokens, token count and loss mask"),
        Gate(
            "final_state_reproduces_logits", True,
            "the target's lm_head on the stored final states (normed when pre-norm) gives the argmax "
            "of the target's own forward pass on at least min_argmax_agreement of sampled positions (a flip between two "
            "logits closer than the storage dtype can resolve counts as a tie)",
        ),
        Gate(
            "aux_states_match_layer_ids", True,
            "the sidecar's layer ids are the target's configured ids (vLLM's convention), and the stored "
            "aux states are the states at those ids (checked against a transformers forward where one runs)",
        ),
    ],
)  # fmt: skip
