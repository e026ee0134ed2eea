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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_assets.demo.serve", description="Serve a built-in target (default: the tiny one) with vLLM until Ctrl-C."
    )
    parser.add_argument("--model", default="tiny", choices=[*DEMO_TARGETS, BUILT_IN], help=f"a built-in target ('{BUILT_IN}' is the tiny one)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="arguments passed to vLLM after --")
    args = parser.parse_args(argv)
    built_in = DEMO_TARGETS["tiny" if args.model == BUILT_IN else args.model]
    serving = dict(built_in.serving)
    serving["extra_args"] = [*serving.get("extra_args", []), *(a for a in args.extra if a != "--")]
    serve_until_stopped(VLLMServer(str(built_in.model_dir()), port=args.port, max_model_len=args.max_model_len, **serving))


if __name__ == "__main__":
    main()
