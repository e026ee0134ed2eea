"""The gates of a ``hidden_states`` shard, declared once: name, blocking, threshold, description.

Computed on the GPU host, next to the files, by
:mod:`eagle3_assets.core.extraction.hidden_state_checks` (one function per
gate, in this order; the first before extraction). Declared here, beside those
checks but in a module of its own, because the code location reads the
declarations (the asset's check specs, the green shards training takes) and
must load without torch, which the checks import. All five block training on
a shard whose states are wrong.
"""

from __future__ import annotations

from eagle3_assets.core.reporting.checks import Gate, GateTable

HIDDEN_STATE_GATES = GateTable(
    "hidden_states",
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
            threshold=0.999,  # min_argmax_agreement's default
        ),
        Gate(
            "aux_states_match_layer_ids", True,
            "the sidecar's layer ids are the target's configured ids (vLLM's convention), and the stored "
            "aux states are the states at those ids (checked against a transformers forward where one runs)",
        ),
    ],
)  # fmt: skip
