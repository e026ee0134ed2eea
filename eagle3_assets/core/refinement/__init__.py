"""On-policy refinement of a served draft: where vLLM rejected it, recovered by replaying the draft on stored states."""
