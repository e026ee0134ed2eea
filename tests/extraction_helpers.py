"""The tests' validated traces: eagle3_assets/demo/validated_traces.py (``eagle3-gpu-check`` writes them too)."""

import os
from contextlib import contextmanager

from eagle3_assets.demo.validated_traces import TRACES_SCHEMA, render_trace, write_validated_traces

__all__ = ["in_process_vllm_environment", "TRACES_SCHEMA", "render_trace", "write_validated_traces"]


@contextmanager
def in_process_vllm_environment():
    """What an in-process vLLM engine needs on this CPU host (a 1 GiB KV cache, a loopback address), put back after."""
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_HOST_IP")}
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
