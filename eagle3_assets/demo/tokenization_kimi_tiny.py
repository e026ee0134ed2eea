"""The Kimi-style tiny target's tokenizer class: copied into its model directory and loaded as remote code.

Kimi-K2's real tokenizer is remote code (a tiktoken-based class named in
``tokenizer_config.json``'s ``auto_map``): transformers and vLLM load it only
with ``trust_remote_code``. This class plays that part for the built-in tiny
target. Its byte-level BPE is stored under a file name transformers' own
classes never read (``kimi_tiny_bpe.json``, not ``tokenizer.json``), so without
``trust_remote_code`` there is nothing transformers can load it from, as with
the real checkpoint.

This file runs inside transformers' remote-code loader, so it imports nothing
from eagle3_assets.
"""

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

BPE_FILE = "kimi_tiny_bpe.json"


class KimiTinyTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"vocab_file": BPE_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file=None, **kwargs):
        if vocab_file is None:
            raise ValueError(f"KimiTinyTokenizer needs its {BPE_FILE} beside tokenizer_config.json")
        kwargs.pop("tokenizer_object", None)
        super().__init__(tokenizer_object=Tokenizer.from_file(vocab_file), **kwargs)
