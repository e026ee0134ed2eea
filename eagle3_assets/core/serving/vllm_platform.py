"""What this host's vLLM reports about serving a draft beside a target: its platform and its attention backends.

An EAGLE-3 draft runs in the target's engine and shares its KV-cache block
size. vLLM picks an attention backend per kind of attention (latent/MLA for
DeepSeek-V3 and Kimi-K2, standard for Llama-style layers) on this platform and
each backend declares the kernel block sizes it takes
(``get_supported_kernel_block_sizes``: exact sizes or ``MultipleOf(n)``) and,
for some, the head sizes. When the target's and the draft's backends share no
block size vLLM refuses to start ("No common block size"). These facts come
from vLLM's own selector (``vllm.v1.attention.selector.get_attn_backend``,
``vllm.platforms.current_platform``), not from probing the CPU ourselves, so
they follow whatever the installed vLLM does (AMX, CUDA, a future kernel).

Read in a child process (``python -m eagle3_assets.core.serving.vllm_platform``):
importing vLLM configures torch and logging process-wide, which a training
stage should not inherit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass

# Head sizes the selector is asked about: DeepSeek-V3 / Kimi-K2's latent head (512 + 64) and a common Llama head.
MLA_HEAD_SIZE, STANDARD_HEAD_SIZE = 576, 128


@dataclass(frozen=True)
class BackendFacts:
    name: str
    block_sizes: list[int | str]  # an exact size, or "MultipleOf(n)"
    head_sizes: list[int]  # empty: any

    def accepts_block(self, size: int) -> bool:
        return any(size == s if isinstance(s, int) else size % _base(s) == 0 for s in self.block_sizes)


@dataclass(frozen=True)
class ServingFacts:
    platform: str  # vllm.platforms.current_platform.device_type: "cpu", "cuda", ...
    vllm_version: str
    backends: dict[str, BackendFacts]  # "mla", "standard"

    def common_block_size(self, kind_a: str, kind_b: str) -> int | None:
        """The smallest KV block size both kinds' backends take, None when there is none."""
        a, b = self.backends[kind_a], self.backends[kind_b]
        sizes = [s for s in a.block_sizes + b.block_sizes if isinstance(s, int)]
        bases = [_base(s) for s in a.block_sizes + b.block_sizes if not isinstance(s, int)]
        candidates = sorted(set(sizes + bases + [math.lcm(x, y) for x in bases for y in bases]))
        return next((s for s in candidates if a.accepts_block(s) and b.accepts_block(s)), None)

    def shared_block_problem(self, target_kind: str, draft_kind: str) -> str | None:
        """Why a draft with ``draft_kind`` attention cannot share the blocks of a target with ``target_kind``; None if it can."""
        if target_kind == draft_kind or self.common_block_size(target_kind, draft_kind) is not None:
            return None
        target, draft = self.backends[target_kind], self.backends[draft_kind]
        return (
            f"no common KV block size: vLLM {self.vllm_version} on {self.platform} serves the target's {target_kind} attention "
            f"with {target.name} (block sizes {target.block_sizes}) and the draft's {draft_kind} attention with {draft.name} "
            f"(block sizes {draft.block_sizes})"
        )

    def mla_head_problem(self, latent_head_size: int) -> str | None:
        mla = self.backends["mla"]
        if not mla.head_sizes or latent_head_size in mla.head_sizes:
            return None
        return (
            f"the draft's latent head kv_lora_rank + qk_rope_head_dim = {latent_head_size}, but {mla.name} on {self.platform} "
            f"takes only {mla.head_sizes}"
        )

    def summary(self) -> str:
        return f"vLLM {self.vllm_version} on {self.platform}: " + ", ".join(
            f"{kind} attention {b.name} blocks {b.block_sizes}" for kind, b in self.backends.items()
        )

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> ServingFacts:
        return cls(raw["platform"], raw["vllm_version"], {k: BackendFacts(**v) for k, v in raw["backends"].items()})


def _base(multiple: str) -> int:
    return int(multiple[len("MultipleOf(") : -1])


def read_serving_facts() -> ServingFacts:
    """Ask the vLLM imported in this process (use :func:`host_serving_facts` from a process that should not import it)."""
    import torch
    import vllm
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    def facts(backend) -> BackendFacts:
        sizes = [s if isinstance(s, int) else f"MultipleOf({s.base})" for s in backend.get_supported_kernel_block_sizes()]
        return BackendFacts(backend.get_name(), sizes, [int(h) for h in backend.get_supported_head_sizes()])

    with set_current_vllm_config(VllmConfig()):
        backends = {
            "mla": facts(get_attn_backend(MLA_HEAD_SIZE, torch.bfloat16, "auto", use_mla=True)),
            "standard": facts(get_attn_backend(STANDARD_HEAD_SIZE, torch.bfloat16, "auto", use_mla=False)),
        }
    return ServingFacts(str(current_platform.device_type), str(vllm.__version__), backends)


def host_serving_facts(python: str | None = None, timeout_s: float = 600.0) -> ServingFacts:
    """:func:`read_serving_facts` of the vLLM installed for ``python`` (default: this interpreter), in a child process."""
    return serving_facts_of(start_reading_serving_facts(python), timeout_s)


def start_reading_serving_facts(python: str | None = None, preexec_fn=None) -> subprocess.Popen:
    """The child process of :func:`host_serving_facts`, started and not waited for (importing vLLM takes ~10 s):
    :func:`serving_facts_of` reads its answer. The test session starts it early, at the lowest CPU priority."""
    command = [python or sys.executable, "-m", "eagle3_assets.core.serving.vllm_platform"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


def serving_facts_of(child: subprocess.Popen, timeout_s: float = 600.0) -> ServingFacts:
    """The facts ``child`` (:func:`start_reading_serving_facts`) printed; killed when not done within ``timeout_s``."""
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        raise RuntimeError(f"could not read vLLM's platform facts (exit {child.returncode}): {stderr.strip()[-1500:]}")
    return ServingFacts.from_dict(json.loads(lines[-1]))


if __name__ == "__main__":
    print(json.dumps(read_serving_facts().as_dict()), flush=True)
