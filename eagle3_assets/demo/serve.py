"""``make serve-demo``: serve a built-in target (or a model directory) with vLLM until Ctrl-C.

For materialising from the UI (``make dev``) against the embedded default:
the generation server the demo's resources point at, on port 8000. Prints one
JSON line with the server's URL, served model name and log file.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence

from eagle3_assets.core.vllm_launcher import DEFAULT_SERVED_NAME, VLLMServer
from eagle3_assets.demo.plugin import BUILT_IN
from eagle3_assets.demo.targets import DEMO_TARGETS


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_assets.demo.serve", description="Serve a model (default: the tiny built-in target) with vLLM until Ctrl-C."
    )
    parser.add_argument(
        "--model", default="tiny",
        help=f"a built-in target ({', '.join(DEMO_TARGETS)}; '{BUILT_IN}' is the tiny one) or a model directory",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=DEFAULT_SERVED_NAME)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype for a model directory (the built-in targets set their own)")
    parser.add_argument("--trust-remote-code", action="store_true", help="let vLLM run the model directory's own code (e.g. its tokenizer)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="arguments passed to vLLM after --")
    args = parser.parse_args(argv)
    built_in = DEMO_TARGETS.get("tiny" if args.model == BUILT_IN else args.model)
    if built_in is not None:
        model, serving = str(built_in.model_dir()), {"dtype": args.dtype, "trust_remote_code": args.trust_remote_code, **built_in.serving}
    else:
        model, serving = args.model, {"dtype": args.dtype, "trust_remote_code": args.trust_remote_code}
    serving["extra_args"] = [*serving.get("extra_args", []), *(a for a in args.extra if a != "--")]
    server = VLLMServer(model, args.served_model_name, port=args.port, max_model_len=args.max_model_len, **serving)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # turn SIGTERM into the cleanup path
    with server:
        print(json.dumps({"base_url": server.base_url, "model": args.served_model_name, "log": str(server.log_path)}), flush=True)
        try:
            while server.process and server.process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
