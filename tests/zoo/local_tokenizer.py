"""A byte-level BPE tokenizer trained in a test on a few sentences (the ``tokenizers`` package, nothing
downloaded): for the tests where merged tokens of several bytes matter."""
from __future__ import annotations

import pytest

from zoo.data.tokenize import HFTokenizer

TEXT = "the state of the mixer is the state of the scan; the key decays and the gate opens. " * 6


def bpe_tokenizer(path, text: str = TEXT) -> HFTokenizer:
    """A BPE tokenizer of up to 300 tokens trained on ``text``, saved at ``path`` and loaded as the zoo loads one."""
    tokenizers = pytest.importorskip("tokenizers")  # the lm extra; also in the test extra
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(path))
    return HFTokenizer(str(path))
