"""``make serve-demo``: serve a built-in target with vLLM until Ctrl-C, as the demo's resources expect it.

For materialising from the UI (``make dev``) against the embedded default:
the generation server the demo's resources point at, on port 8000, under the
built-in target's own served name and reasoning parser. Prints one JSON line
with the server's URL, served model name and log file. A model directory of
your own: ``eagle3-vllm-serve`` (:func:`eagle3_assets.core.serving.vllm_launcher.main`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from eagle3_assets.core.serving.vllm_launcher import VLLMServer, serve_until_stopped
from eagle3_assets.demo.plugin import BUILT_IN
from eagle3_assets.demo.targets import DEMO_TARGETS


def demo_server(model: str = "tiny", port: int = 8000) -> VLLMServer:
    """The generation server of a built-in target: its name and serving profile (``DemoTarget.serving``), nothing else."""
    built_in = DEMO_TARGETS["tiny" if model == BUILT_IN else model]
    return VLLMServer(str(built_in.model_dir()), port=port, **built_in.serving)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_assets.demo.serve", description="Serve a built-in target (default: the tiny one) with vLLM until Ctrl-C."
    )
    parser.add_argument("--model", default="tiny", choices=[*DEMO_TARGETS, BUILT_IN], help=f"a built-in target ('{BUILT_IN}' is the tiny one)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    serve_until_stopped(demo_server(args.model, args.port))


if __name__ == "__main__":
    main()
