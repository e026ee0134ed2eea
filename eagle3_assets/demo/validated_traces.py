"""Validated traces of the demo prompts for a tiny target, written per the ``validated_traces`` contract.

The hidden-state tests and ``eagle3-gpu-check`` need the validation stage's
output without the stages before it (and without Dagster). Demo prompts get templated answers (the reasoning and answer the tiny
target was taught), rendered with the tiny target's own chat template as a
conversation whose assistant turn carries ``reasoning_content``. The loss mask
is 1 over what the target generates after the generation prompt (reasoning,
``</think>``, answer, ``<|im_end|>``) and 0 over the prompt and the template's
trailing newline.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from eagle3_assets.core.storage.files import atomic_path
from eagle3_assets.core.target.identity import parquet_metadata, target_identity
from eagle3_assets.demo.prompt_set import make_traces

TRACES_SCHEMA = {
    "id": pl.String,
    "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
    "reasoning": pl.String,
    "content": pl.String,
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.Int8),
    "num_tokens": pl.Int64,
}


def render_trace(tokenizer, question: str, reasoning: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one conversation in the target's template."""
    user = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": answer, "reasoning_content": reasoning}], tokenize=False
    )
    if not full.startswith(prompt):
        raise AssertionError(f"the template does not extend the generation prompt:\n{prompt!r}\n{full!r}")
    generated_end = full.rindex("<|im_end|>") + len("<|im_end|>")
    generated, trailer = full[len(prompt) : generated_end], full[generated_end:]
    pieces = [(prompt, 0), (generated, 1), (trailer, 0)]
    ids: list[int] = []
    mask: list[int] = []
    for text, supervised in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        mask += [supervised] * len(piece)
    return ids, mask


def write_validated_traces(data_dir: Path, shard: str, target_dir: Path, count: int, seed: int = 5) -> Path:
    """``<data>/validated_traces/<shard>.parquet`` with ``count`` rows; lengths vary with the question template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    rows = []
    for i, (question, reasoning, answer) in enumerate(make_traces(count, seed)):
        ids, mask = render_trace(tokenizer, question, reasoning, answer)
        rows.append(
            {
                "id": f"{shard}-q{i:03d}",
                "messages": [{"role": "user", "content": question}],
                "reasoning": reasoning,
                "content": answer,
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
            }
        )
    path = Path(data_dir) / "validated_traces" / f"{shard}.parquet"
    with atomic_path(path) as tmp:  # with the identity of the target that rendered them, as validated_traces writes it
        pl.DataFrame(rows, schema=TRACES_SCHEMA).write_parquet(tmp, metadata=parquet_metadata(target_identity(target_dir)))
    return path
