"""The EAGLE-3 draft model in vLLM's native form, its vocabulary, and its export."""
