"""The peer bench's alignment: our stored rows in the layout speculators' EAGLE-3 trainer expects (bench/peer/alignment.py).

speculators trains row j on (token j+1, aux states of j, final state of j+1,
loss mask of j+1) with positions from 1 (``shift_batch`` in
speculators/models/eagle3/data.py); the issue's first peer run without that
alignment reached 1.90 instead of about 3.2. These tests hold the alignment on
a tiny synthetic shard in the hidden-states contract's layout, where every
value names its token, and need neither speculators nor its environment; the
peer script checks the same function equal to speculators' own ``shift_batch``
on the real data before it trains (``check_alignment``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_assets.core.extraction.part_files import quantise_rows
from eagle3_assets.core.extraction.shard_reading import iter_samples

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "peer"))
import alignment  # noqa: E402

H = 4
LENGTHS = [5, 7]  # two samples in one part


def write_shard(shard: Path, dtype: str = "float32", final_state: str = "post_norm") -> dict[str, torch.Tensor]:
    """A one-part shard whose row g (over the part) holds token 100+g, aux states g+0.25, final state g+0.5, mask g odd."""
    total = sum(LENGTHS)
    g = torch.arange(total, dtype=torch.float32)
    rows = {
        "aux": (g[:, None] + 0.25).expand(total, 3 * H).contiguous(),
        "final": (g[:, None] + 0.5).expand(total, H).contiguous(),
        "ids": 100 + torch.arange(total, dtype=torch.int64),
        "mask": (torch.arange(total) % 2).to(torch.int8),
    }
    tensors = {
        "sample_offsets": torch.tensor([0, LENGTHS[0], total], dtype=torch.int64),
        "input_ids": rows["ids"],
        "loss_mask": rows["mask"],
    }
    if dtype == "float8_e4m3fn":
        tensors["aux_hidden_states"], tensors["aux_scales"] = quantise_rows(rows["aux"], H)
        tensors["final_hidden_states"], tensors["final_scales"] = quantise_rows(rows["final"], H)
    else:
        tensors["aux_hidden_states"], tensors["final_hidden_states"] = rows["aux"], rows["final"]
    shard.mkdir(parents=True)
    save_file(tensors, str(shard / "part-00000.safetensors"))
    sidecar = {
        "format": 1, "backend": "transformers", "target_path": "/models/tiny", "num_layers": 7, "hidden_size": H, "vocab_size": 640,
        "aux_layer_ids": [2, 3, 4], "final_state": final_state, "dtype": dtype, "sample_ids": ["a", "b"], "num_tokens": LENGTHS,
        "files": [{"name": "part-00000.safetensors", "first_sample": 0, "num_samples": 2}],
    }  # fmt: skip
    (shard / "metadata.json").write_text(json.dumps(sidecar))
    return rows


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_the_bench_reads_what_training_reads(tmp_path, dtype):
    shard = tmp_path / "shard-00000"
    write_shard(shard, dtype)
    stored = alignment.index_shards([shard])
    assert [(s.sample_id, s.length) for s in stored.samples] == [("a", 5), ("b", 7)]
    assert (stored.hidden_size, stored.aux_layer_ids, stored.final_state) == (H, [2, 3, 4], "post_norm")
    for ref, reference in zip(stored.samples, iter_samples(shard), strict=True):  # the platform's own reader
        sample = alignment.read_sample(ref)
        assert torch.equal(sample["hidden_states"], reference.aux.float())
        assert torch.equal(sample["verifier_last_hidden_states"], reference.final.float())
        assert torch.equal(sample["input_ids"], reference.input_ids)
        assert torch.equal(sample["loss_mask"], reference.loss_mask == 1)


def test_speculators_layout_puts_token_t1_aux_t_final_t1_mask_t1_together(tmp_path):
    shard = tmp_path / "shard-00000"
    rows = write_shard(shard)
    second = alignment.index_shards([shard]).samples[1]  # starts at row 5 of the part
    aligned = alignment.speculators_layout(alignment.read_sample(second))
    n = second.length - 1
    assert aligned["lengths"].tolist() == [n]
    assert aligned["position_ids"].tolist() == list(range(1, n + 1))  # positions from 1, as speculators' shift_batch
    for j in range(n):
        t = second.start + j  # the row of the part that aux states of row j come from
        assert aligned["input_ids"][j] == rows["ids"][t + 1]
        assert torch.equal(aligned["hidden_states"][j], rows["aux"][t])
        assert torch.equal(aligned["verifier_last_hidden_states"][j], rows["final"][t + 1])
        assert bool(aligned["loss_mask"][j]) == bool(rows["mask"][t + 1])
    # Never across samples: the last row pairs the sample's last token with its own last aux-but-one state.
    assert aligned["input_ids"][-1] == rows["ids"][second.end - 1]
    assert torch.equal(aligned["hidden_states"][-1], rows["aux"][second.end - 2])


def test_a_cut_sample_is_aligned_within_the_cut(tmp_path):
    shard = tmp_path / "shard-00000"
    rows = write_shard(shard)
    ref = alignment.index_shards([shard]).samples[1]
    aligned = alignment.speculators_layout(alignment.read_sample(ref, max_len=4))
    assert aligned["input_ids"].tolist() == rows["ids"][ref.start + 1 : ref.start + 4].tolist()
    assert aligned["lengths"].tolist() == [3]


def test_the_final_norm_is_applied_only_to_a_pre_norm_state(tmp_path):
    assert alignment.verifier_norm_needed("pre_norm") is True
    assert alignment.verifier_norm_needed("post_norm") is False  # stored after the norm: norming again would skew the targets
    with pytest.raises(ValueError, match="final_state"):
        alignment.verifier_norm_needed("normed")


def test_shards_extracted_differently_are_refused(tmp_path):
    write_shard(tmp_path / "shard-00000", final_state="post_norm")
    write_shard(tmp_path / "shard-00001", final_state="pre_norm")
    with pytest.raises(ValueError, match="disagree on final_state"):
        alignment.index_shards([tmp_path / "shard-00000", tmp_path / "shard-00001"])
