"""The tokenizer a run trained with, as a ``transformers`` fast tokenizer (``tokenizer.json``).

- ``bytes``: a byte-level BPE model with no merges, whose 256 tokens are the byte values (token id = byte
  value, through the byte-to-character alphabet of byte-level BPE) and whose end-of-text token
  ``<|endoftext|>`` is id 256, as the zoo's byte tokenizer. The text ``<|endoftext|>`` inside an input is
  encoded as its bytes, as the zoo does, not as the special token.
- a Hugging Face tokenizer (a Hub name or a ``tokenizer.json``): the same tokenizer, with its post-processor
  removed, since the zoo encodes without special tokens (no BOS) in training, scoring and generation.

Either way the end-of-text token is the zoo's EOS, so ``generate`` stops where ``zoo generate`` stops and an
empty context is scored after EOS, as the zoo's lm-eval adapter does.
"""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from transformers import PreTrainedTokenizerFast

from ..data.tokenize import ByteTokenizer, HFTokenizer, byte_level_table

EOS_TEXT = "<|endoftext|>"


def byte_tokenizer() -> tokenizers.Tokenizer:
    vocab = {char: byte for char, byte in byte_level_table().items()}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([EOS_TEXT])
    return tok


def without_post_processor(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    data = json.loads(tok.to_str())
    data["post_processor"] = None
    return tokenizers.Tokenizer.from_str(json.dumps(data))


def transformers_tokenizer(zoo_tokenizer) -> PreTrainedTokenizerFast:
    """A fast tokenizer that encodes text to the ids ``zoo_tokenizer`` (the task's) gives it."""
    if isinstance(zoo_tokenizer, ByteTokenizer):
        tok, split_special = byte_tokenizer(), True
    elif isinstance(zoo_tokenizer, HFTokenizer):
        tok, split_special = without_post_processor(zoo_tokenizer.tok), False
    else:
        raise TypeError(f"no transformers form of the tokenizer {type(zoo_tokenizer).__name__}")
    eos = tok.id_to_token(zoo_tokenizer.eos_id)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos,
                                   split_special_tokens=split_special, clean_up_tokenization_spaces=False)


def save(zoo_tokenizer, folder: Path) -> None:
    transformers_tokenizer(zoo_tokenizer).save_pretrained(str(folder))
