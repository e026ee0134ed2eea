"""Dagster assets that turn a prompt set into a vLLM-loadable EAGLE-3 draft model."""
