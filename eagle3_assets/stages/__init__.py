"""Entry points the GPU host runs as separate processes (``python -m eagle3_assets.stages.<name>``).

They import only what the host needs (torch, transformers, vllm, dagster-pipes),
never the Dagster webserver or the asset definitions.
"""
