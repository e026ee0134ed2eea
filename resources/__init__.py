"""Dagster resources that wrap the outside world: the prompt dataset, the vLLM server, the GPU host."""
