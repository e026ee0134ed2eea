"""Time speculators' EAGLE-3 training step at a given shape (runs in the peer environment; ``bench/peer_training.py`` starts it).

One optimizer step as speculators' ``Trainer.train_epoch`` runs it: the draft's
forward over one packed micro-batch (documents of ``seq_len`` tokens with
document ids, positions from 1 in each), its training-time-test unroll and KL
loss against the verifier head's logits, backward, gradient clipping at 1.0,
AdamW. Synthetic states and weights of the shape given (the draft's embedding,
head and the verifier's head random, as the step's cost does not depend on
their values); data loading is left out, as in ``bench/training.py``.

On a CPU: eager attention and speculators' eager losses, float32. On CUDA
(GPU-only, not run on the development machine): its compiled forward
(``conditional_torch_compile``), FlexAttention over the packed documents, its
fused (Triton) KL loss, bf16 autocast, as its trainer runs there.

Prints one JSON line: tokens/s and peak memory (CUDA: ``max_memory_allocated``;
CPU: the process's maximum RSS; with ``steps`` 0, that is what building the
draft and the batch took, the baseline the bench subtracts).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="JSON: shape (hidden, heads, kv_heads, head_dim, intermediate, vocab, draft_vocab, seq_len, batch_tokens), ttt, steps, warmup, device, threads, settings")
    spec = json.loads(p.parse_args().spec)
    import torch
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    shape, device = spec["shape"], torch.device(spec["device"])
    on_cuda = device.type == "cuda"
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    layer = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"], num_hidden_layers=1,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], hidden_act="silu",
        max_position_embeddings=max(4096, shape["seq_len"] + 1), rms_norm_eps=1e-5, tie_word_embeddings=False,
        sliding_window=2048, use_sliding_window=True, layer_types=["sliding_attention"],  # speculators' CLI default for its draft
    )  # fmt: skip
    layer._attn_implementation = "simple_flex_attention" if on_cuda else "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=shape["draft_vocab"], eagle_aux_hidden_state_layer_ids=[2, 3, 4],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=spec["ttt"])], default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
        **spec["settings"],
    )  # fmt: skip
    model = Eagle3DraftModel(config)
    draft_ids = torch.randperm(shape["vocab"])[: shape["draft_vocab"]].sort().values
    t2d = torch.zeros(shape["vocab"], dtype=torch.bool)
    t2d[draft_ids] = True
    model.load_vocab_mappings(t2d, draft_ids - torch.arange(shape["draft_vocab"]))
    with torch.no_grad():  # the verifier-owned weights start as NaN until loaded from a verifier: random ones here
        model.embed_tokens.weight.normal_(0, 0.02)
        model.lm_head.weight.normal_(0, 0.02)
        model.verifier_lm_head.weight.normal_(0, 0.02)
    model.to(device)
    trainable = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01)
    loss_config = resolve_loss_config("kl_div", "fused" if on_cuda else "eager")

    tokens, length = shape["batch_tokens"], shape["seq_len"]
    documents = max(1, tokens // length)
    total = documents * length
    dtype = torch.bfloat16 if on_cuda else torch.float32
    batch = {
        "hidden_states": torch.randn(1, total, 3 * shape["hidden"], device=device, dtype=dtype),
        "verifier_last_hidden_states": torch.randn(1, total, shape["hidden"], device=device, dtype=dtype),
        "input_ids": torch.randint(0, shape["vocab"], (1, total), device=device),
        "loss_mask": torch.ones(1, total, dtype=torch.bool, device=device),
        "document_ids": torch.arange(documents, device=device).repeat_interleave(length)[None],
        "position_ids": (torch.arange(length, device=device) + 1).repeat(documents)[None],  # from 1, as after shift_batch
    }
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda else torch.autocast("cpu", enabled=False)

    def step() -> None:
        with autocast:
            _tokens, loss, _metrics = model(**batch, ttt_steps=spec["ttt"], ttt_step_loss_decay=1.0, loss_config=loss_config)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    for _ in range(spec["warmup"]):
        step()
    sync()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    sync()
    elapsed = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if on_cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"tokens_per_s": total * spec["steps"] / elapsed, "peak_bytes": peak, "tokens": total, "documents": documents, "seq_len": length}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
