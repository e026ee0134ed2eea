"""``loads_in_vllm``: vLLM serves the target with an exported draft as its speculative model and answers.

The draft's blocking gate beside :func:`eagle3_assets.core.draft.export.config_problems`:
a directory whose fields are all there can still fail to start (a shape vLLM
derives differently, a form vLLM cannot serve beside this target), and only a
start says so. :func:`root_cause` keeps the line of vLLM's log that says why.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class VLLMLoadReport:
    passed: bool
    detail: str
    metadata: dict = field(default_factory=dict)


LOAD_CHECK_CONTEXT = 2048  # one short chat completion: a longer context only costs start-up memory
SPEC_COUNTER = re.compile(r"^(vllm:spec_decode_num_(?:drafts|accepted_tokens|draft_tokens)_total)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


def loads_in_vllm_server(
    target_dir: Path,
    draft_dir: Path,
    *,
    num_speculative_tokens: int = 3,
    profile,
    python: str | None = None,
    log_path: Path | None = None,
    startup_timeout_s: float | None = None,
):
    """The server of ``loads_in_vllm``: the target as its serving profile says, this draft as its speculative model."""
    import sys

    from eagle3_assets.core.serving.deployment import speculative_config
    from eagle3_assets.core.serving.vllm_launcher import VLLMServer

    return VLLMServer(
        target_dir,
        profile=profile,
        context=LOAD_CHECK_CONTEXT,
        site_args={"speculative_config": speculative_config(str(Path(draft_dir).resolve()), num_speculative_tokens)},
        python=python or sys.executable,
        log_path=log_path,
        startup_timeout_s=startup_timeout_s,
    )


def check_loads_in_vllm(
    target_dir: Path,
    draft_dir: Path,
    *,
    num_speculative_tokens: int = 3,
    python: str | None = None,
    log_path: Path | None = None,
    profile,
    startup_timeout_s: float | None = None,
    prompt: str = "What is 12 plus 30?",
) -> VLLMLoadReport:
    """Serve the target with this draft as vLLM's speculative model and ask one chat completion.

    Passes when the server comes up, answers, and its ``/metrics`` show that
    the draft proposed tokens (a draft that loads but is never run would not
    prove anything). ``profile``: the target's serving profile
    (:class:`~eagle3_assets.core.serving.profile.ServingProfile`; required: no fallback to the environment's).
    """
    server = loads_in_vllm_server(
        target_dir, draft_dir, num_speculative_tokens=num_speculative_tokens, profile=profile, python=python,
        log_path=log_path, startup_timeout_s=startup_timeout_s,
    )  # fmt: skip
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        log = server.log_path.read_text(errors="replace") if server.log_path.is_file() else str(exc)
        return VLLMLoadReport(False, f"vLLM did not start with this draft: {root_cause(log)}", {"log": str(server.log_path)})
    try:
        body = json.dumps(
            {
                "model": server.served_model_name,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 24,
                "min_tokens": 8,  # some decode steps, so that the draft is run at all
                "temperature": 0.0,
            }
        ).encode()
        request = urllib.request.Request(
            f"{server.base_url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())
            with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as response:
                metrics = response.read().decode()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return VLLMLoadReport(False, f"vLLM started but the chat completion failed: {exc}", {"log": str(server.log_path)})
    finally:
        server.stop()
    counters: dict[str, float] = {}
    for name, value in SPEC_COUNTER.findall(metrics):
        counters[name] = counters.get(name, 0.0) + float(value)
    drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    message = (answer.get("choices") or [{}])[0].get("message") or {}
    text = (message.get("content") or "") + (message.get("reasoning") or "")
    metadata = {
        "completion_tokens": int((answer.get("usage") or {}).get("completion_tokens") or 0),
        "num_drafts": int(drafts),
        "num_accepted_tokens": int(accepted),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "answer_preview": text[:200],
    }
    if not drafts:
        return VLLMLoadReport(False, "vLLM answered but never ran the draft (no spec_decode drafts in /metrics)", metadata)
    return VLLMLoadReport(True, f"vLLM served the target with this draft ({int(drafts)} drafts)", metadata)


ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")


def root_cause(log: str) -> str:
    """The first exception raised in a vLLM start-up log, not the "engine failed" wrappers after it."""
    wrappers = ("Engine core initialization failed", "EngineCore failed to start")
    causes = [m.group(1) + ": " + m.group(2) for line in log.splitlines() if " WARNING " not in line and (m := ERROR_LINE.search(line))]
    real = [c for c in causes if not any(w in c for w in wrappers)]
    lines = [line for line in log.strip().splitlines() if line.strip()]
    return ((real or causes or lines or ["(empty log)"])[0])[:500]
