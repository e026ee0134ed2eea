"""How an exported draft is served in production, and how a running server says which draft it serves.

vLLM's production API does not tell which speculative model a server runs (the
engine config is only on the development endpoint ``/server_info``). But
``--served-model-name`` takes several names and ``/v1/models`` lists them all,
so the platform serves every draft under an extra alias that carries a hash of
its weights, ``eagle3-draft-<hash12>``: clients keep using the target's name,
and a watcher reads the alias to tell which draft each server runs.

The exported directory gets ``SERVING.md`` (the command to paste) and
``serving.json`` (the same facts for programs), written after the export and
rewritten by ``draft_evaluation`` with the ``num_speculative_tokens`` it
recommends.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from pathlib import Path

from eagle3_assets.core.serving.profile import ServingProfile, require_profile, vllm_launch
from eagle3_assets.core.storage.shard_paths import SERVING_NOTES
from eagle3_assets.core.storage.files import write_bytes_atomic, write_json_atomic

ALIAS_PREFIX = "eagle3-draft-"
HASH_LENGTH = 12
ALIAS_PATTERN = re.compile(rf"^{re.escape(ALIAS_PREFIX)}([0-9a-f]{{{HASH_LENGTH}}})$")
SERVING_README = SERVING_NOTES
SERVING_JSON = "serving.json"


def draft_weights_hash(draft_dir: Path | str) -> str:
    """sha256 over the draft's safetensors files (by name, then content), first 12 hex digits.

    The weights, not the directory: the serving notes written beside them
    change with the recommended k, the draft does not.
    """
    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"draft checkpoint {draft_dir}: no *.safetensors weights to hash")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:HASH_LENGTH]


def draft_alias(weights_hash: str) -> str:
    return f"{ALIAS_PREFIX}{weights_hash}"


def served_draft_hashes(model_ids: list[str]) -> list[str]:
    """The draft hashes named by ``eagle3-draft-<hash12>`` aliases in a ``/v1/models`` listing."""
    return [m.group(1) for model_id in model_ids if (m := ALIAS_PATTERN.match(model_id))]


DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM's speculative_config draft_sample_method


def speculative_config(draft_path: str, num_speculative_tokens: int, draft_sample_method: str = "greedy") -> dict:
    """vLLM's ``--speculative-config``. ``draft_sample_method`` (vLLM's default ``greedy``): the draft proposes its
    argmax, taken as certain, so a sampled request accepts it with the target's probability of that token;
    ``probabilistic`` samples the draft's own distribution and accepts with min(1, p / q)."""
    config = {"method": "eagle3", "model": draft_path, "num_speculative_tokens": int(num_speculative_tokens)}
    return config if draft_sample_method == "greedy" else {**config, "draft_sample_method": draft_sample_method}


def serve_command(
    target: str, served_name: str, draft_path: str, weights_hash: str, num_speculative_tokens: int, profile: ServingProfile,
    draft_sample_method: str = "greedy",
) -> list[str]:
    """``vllm serve`` for the target with this draft, as the target's serving ``profile`` says (its parallelism,
    parser, ...), answering to its own name and to the draft's alias."""
    launch = vllm_launch(
        require_profile(profile, "serve_command(profile)"), target, served_model_name=[served_name, draft_alias(weights_hash)],
        site_args={"speculative_config": speculative_config(draft_path, num_speculative_tokens, draft_sample_method)},
    )  # fmt: skip
    return launch.vllm_serve_command()


def write_serving_notes(
    draft_dir: Path | str,
    *,
    target: str,
    num_speculative_tokens: int,
    served_name: str = "<your served model name>",
    chosen_by: str = "the export's default (draft_evaluation has not chosen k yet)",
    curve_markdown: str = "",
    profile: ServingProfile,
    draft_sample_method: str = "greedy",
) -> dict:
    """Write ``SERVING.md`` and ``serving.json`` beside the weights (atomically); return the JSON."""
    draft_dir = Path(draft_dir)
    weights_hash = draft_weights_hash(draft_dir)
    draft_path = str(draft_dir.resolve())
    command = serve_command(target, served_name, draft_path, weights_hash, num_speculative_tokens, profile, draft_sample_method)
    facts = {
        "draft_weights_hash": weights_hash,
        "served_model_alias": draft_alias(weights_hash),
        "num_speculative_tokens": int(num_speculative_tokens),
        "num_speculative_tokens_chosen_by": chosen_by,
        "speculative_config": speculative_config(draft_path, num_speculative_tokens, draft_sample_method),
        "serve_command": command,
    }
    text = "\n".join(
        [
            "# Serving this EAGLE-3 draft",
            "",
            f"Draft weights hash: `{weights_hash}`. num_speculative_tokens: {num_speculative_tokens} ({chosen_by}).",
            "",
            "```sh",
            shlex.join(command),
            "```",
            "",
            f"Keep the alias `{draft_alias(weights_hash)}` in `--served-model-name`: clients still use the first name,",
            "and `/v1/models` then says which draft this server runs (the production watcher, sensor",
            "`deployed_draft_watch`, compares it with the latest draft_checkpoint). On a copy of this directory",
            "elsewhere, change the path in `--speculative-config`, not the alias: the hash is of the weights.",
            *(["", "## Acceptance by num_speculative_tokens", "", curve_markdown] if curve_markdown else []),
            "",
        ]
    )
    write_json_atomic(draft_dir / SERVING_JSON, facts)
    write_bytes_atomic(draft_dir / SERVING_README, text.encode())
    return facts
