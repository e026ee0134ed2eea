"""Entry points the GPU host runs as separate processes (``python -m eagle3_assets.stages.<name>``).

They import only what the host needs (torch, transformers, vllm, dagster-pipes),
never the Dagster webserver or the asset definitions. Importing a stage module
must not run it (its work sits under ``if __name__ == "__main__"``): the
pre-flight imports it to prove it and its imports load on the host. The GPU
host starts a stage through the stage runner, ``python -m eagle3_assets.stages
<name>`` (``__main__.py``), which holds the stage lock, forwards the stage's
Pipes messages and stops its process group when the run is terminated.
"""
