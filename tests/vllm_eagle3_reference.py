"""Run vLLM's own EAGLE-3 draft module on CPU, outside the engine: either form, by the draft's config.

``llama_eagle3.Eagle3LlamaForCausalLM`` for a Llama-form draft,
``deepseek_eagle3.Eagle3DeepseekV2ForCausalLM`` for an MLA-form one. Used by
tests/test_draft_model.py as the reference for our draft's forward pass.
Everything is vLLM's code — config parsing, ``load_weights`` with its name
mapping (``midlayer.`` -> ``layers.0.``, q/k/v or q_a/kv_a stacking, ``d2t``),
norms, rotary embedding, the MLA projections, ``fc``, ``compute_logits`` with
the draft-to-target scatter — except the attention kernel: the engine's paged
CPU attention needs the engine's scheduler metadata, so a plain causal
attention over a growing KV cache (what the paged kernel computes for one
sequence) stands in for it. For MLA the cache holds what vLLM's holds, the
normalised latent and the rotary key, expanded per head through vLLM's own
``kv_b_proj`` (the MLA prefill path; the decode kernel absorbs ``kv_b_proj``
into the query, the same product).

Drafting is replayed the way vLLM's proposer runs it: for a chain that starts
after position t, step 0 runs over positions 0..t with tokens shifted by one
and the target's fused states; step k runs at position t+k on the state the
previous step handed on (pre-norm, or post-norm under ``norm_output``). Several
drafts run one after another in one process (one per norm combination).

    python tests/vllm_eagle3_reference.py TARGET_DIR INPUTS.safetensors STEPS DRAFT_DIR OUT.safetensors [DRAFT_DIR OUT.safetensors ...]
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
from safetensors.torch import load_file, save_file


class CachedCausalAttention(torch.nn.Module):
    """Causal attention of one sequence over everything written to its KV cache so far."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q, k, v, *args, **kwargs):
        self.keys.append(k.view(-1, self.num_kv_heads, self.head_dim))
        self.values.append(v.view(-1, self.num_kv_heads, self.head_dim))
        keys, values = torch.cat(self.keys), torch.cat(self.values)
        new, total = q.shape[0], keys.shape[0]
        groups = self.num_heads // self.num_kv_heads
        q = q.view(new, self.num_heads, self.head_dim).transpose(0, 1)
        keys = keys.repeat_interleave(groups, dim=1).transpose(0, 1)
        values = values.repeat_interleave(groups, dim=1).transpose(0, 1)
        allowed = torch.arange(total)[None, :] <= (torch.arange(new)[:, None] + total - new)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
        return out.transpose(0, 1).reshape(new, self.num_heads * self.head_dim)


class CachedLatentAttention(torch.nn.Module):
    """vLLM's ``MLAAttention`` for one sequence: causal attention over every latent written to its cache so far."""

    def __init__(self, wrapper):
        super().__init__()
        self.kv_b_proj, self.num_heads, self.scale = wrapper.kv_b_proj, wrapper.num_heads, wrapper.mla_attn.scale
        self.nope, self.rope, self.v_dim = wrapper.qk_nope_head_dim, wrapper.qk_rope_head_dim, wrapper.v_head_dim
        self.latents: list[torch.Tensor] = []
        self.rotary_keys: list[torch.Tensor] = []

    def forward(self, q, kv_c_normed, k_pe, *args, **kwargs):
        self.latents.append(kv_c_normed)
        self.rotary_keys.append(k_pe.reshape(-1, self.rope))
        latents, k_pe = torch.cat(self.latents), torch.cat(self.rotary_keys)
        new, total = q.shape[0], latents.shape[0]
        k_nope, v = self.kv_b_proj(latents)[0].view(total, self.num_heads, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        keys = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)], -1).transpose(0, 1)
        allowed = torch.arange(total)[None, :] <= (torch.arange(new)[:, None] + total - new)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys, v.transpose(0, 1), attn_mask=allowed, scale=self.scale
        )  # fmt: skip
        return out.transpose(0, 1).reshape(new, self.num_heads * self.v_dim)


def main(target_dir: str, inputs_file: str, steps: int, runs: list[tuple[str, str]]) -> None:
    """Each ``(draft_dir, out_file)`` of ``runs`` in turn, in one process (one distributed setup, one vLLM import)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    inputs = load_file(inputs_file)
    for draft_dir, out_file in runs:
        save_file({"logits": replay(target_dir, draft_dir, inputs["aux"].float(), inputs["input_ids"].long(), steps)}, out_file)


def replay(target_dir: str, draft_dir: str, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """vLLM's draft module of ``draft_dir`` drafting ``steps`` tokens after every position: logits [chains, steps, vocab]."""
    from vllm.config import (
        CompilationConfig, CompilationMode, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig,
        set_current_vllm_config,
    )  # fmt: skip
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    mla = "Eagle3DeepseekV2ForCausalLM" in json.loads(open(os.path.join(draft_dir, "config.json")).read())["architectures"]
    # An MLA target's tokenizer may be remote code (Kimi's); vLLM's CPU rotary kernel rotates MLA's strided
    # slices wrongly, so MLA runs with vLLM's PyTorch rotary, as the project serves it (core/target/description.py).
    model_config = ModelConfig(model=target_dir, dtype="float32", max_model_len=512, seed=0, trust_remote_code=mla)
    parallel = ParallelConfig()
    speculative = SpeculativeConfig(
        method="eagle3", model=draft_dir, num_speculative_tokens=steps,
        target_model_config=model_config, target_parallel_config=parallel,
    )  # fmt: skip
    # Eager: a compiled graph would bake the stand-in attention into vLLM's shared compile cache.
    vllm_config = VllmConfig(
        model_config=model_config, parallel_config=parallel, speculative_config=speculative,
        compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["all", "-rotary_embedding"] if mla else []),
    )  # fmt: skip
    with set_current_vllm_config(vllm_config):
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.distributed.parallel_state import model_parallel_is_initialized

        if not model_parallel_is_initialized():  # once per process, inside a config (vLLM reads it there)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
            ensure_model_parallel_initialized(1, 1)
        from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

        model = (Eagle3DeepseekV2ForCausalLM if mla else Eagle3LlamaForCausalLM)(vllm_config=vllm_config)
        hf = model.config
        flags = {f: bool(getattr(hf, f, False)) for f in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")}
        print(f"reference module: {type(model).__name__} {json.dumps(flags)}", flush=True)
        model.load_weights(load_file(os.path.join(draft_dir, "model.safetensors")).items())
        if not model.has_own_embed_tokens:  # the engine would share the target's: do the same
            target = load_file(os.path.join(target_dir, "model.safetensors"))
            model.model.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
        attn = model.model.layers[0].self_attn
        if mla:  # before process_weights_after_loading, which would absorb kv_b_proj into the replaced kernel
            attn.mla_attn.mla_attn = CachedLatentAttention(attn.mla_attn)
        process_weights_after_loading(model, model_config, torch.device("cpu"))

        def fresh_cache() -> None:
            if mla:
                attn.mla_attn.mla_attn = CachedLatentAttention(attn.mla_attn)
            else:
                attn.attn = CachedCausalAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim)

        chains = ids.numel() - steps - 1
        logits = torch.zeros(chains, steps, model.config.vocab_size)
        with torch.no_grad():
            fused = model.combine_hidden_states(aux)
            for t in range(chains):
                fresh_cache()
                # The model returns (what compute_logits reads, what the next step takes): vLLM's proposer feeds the
                # second back, the pre-norm state, or under norm_output the post-norm one.
                normed, next_hidden = model(ids[1 : t + 2], torch.arange(t + 1), fused[: t + 1])
                logits[t, 0] = model.compute_logits(normed[-1:])[0]
                hidden = next_hidden[-1:]
                for k in range(1, steps):
                    normed, hidden = model(ids[t + 1 + k : t + 2 + k], torch.tensor([t + k]), hidden)
                    logits[t, k] = model.compute_logits(normed)[0]
    return logits


if __name__ == "__main__":
    target_dir, inputs_file, steps, *pairs = sys.argv[1:]
    main(target_dir, inputs_file, int(steps), list(zip(pairs[::2], pairs[1::2])))
