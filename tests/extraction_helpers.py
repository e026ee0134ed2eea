"""The tests' validated traces: eagle3_assets/demo/validated_traces.py (``eagle3-gpu-check`` writes them too)."""

from eagle3_assets.demo.validated_traces import TRACES_SCHEMA, render_trace, write_validated_traces

__all__ = ["TRACES_SCHEMA", "render_trace", "write_validated_traces"]
