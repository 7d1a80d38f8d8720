"""Tokenizers of the language-model task: bytes in, token ids out, and back.

- ``bytes`` (the default, no download): ids 0-255 are the byte values, 256 is EOS (vocabulary 257).
  Any byte string round-trips, valid UTF-8 or not.
- anything else names a Hugging Face tokenizer: a local ``tokenizer.json`` path, or a name on the Hub
  (``gpt2``; needs network once), loaded with ``tokenizers`` (``pip install 'mixer-zoo[lm]'``). Text is
  decoded from UTF-8 with invalid bytes replaced before it is encoded. Its EOS is the first of
  :data:`EOS_NAMES` in its vocabulary. Truncation and padding saved with the tokenizer are turned off: a
  document is encoded whole, without pad tokens.

Bits per byte need the number of bytes each token stands for (:meth:`token_bytes`): one per byte token;
EOS counts as one byte (it stands for the boundary between documents, as a newline would); other special
tokens count zero; a byte-level BPE token counts the bytes its characters map back to; a byte-fallback token
(``<0x41>``) one; any other token the bytes it adds to the text when decoded after another token. That last
rule keeps the space a SentencePiece-style (Metaspace) token opens with, which decoding it alone drops (``▁the``
is four bytes, `` the``); such a tokenizer's phantom space before a document's first word counts too (one byte
per document). Bytes are those of the text the tokenizer reads: an invalid UTF-8 byte, read as U+FFFD, counts
that character's three.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from ..errors import UserError

#: end-of-text tokens looked up in a Hugging Face vocabulary, in this order
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
#: a SentencePiece byte-fallback token: one byte
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class ByteTokenizer:
    """256 byte values plus EOS = 256."""
    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, data: bytes | str) -> list[int]:
        return list(data.encode("utf-8") if isinstance(data, str) else bytes(data))

    def decode(self, ids) -> bytes:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256)

    def token_bytes(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)

    def fingerprint(self) -> str:
        return "bytes"


def byte_level_table() -> dict[str, int]:
    """The printable-character alphabet byte-level BPE (GPT-2) writes each byte as: char -> byte."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from a local ``tokenizer.json`` or the Hub."""

    def __init__(self, name: str):
        try:
            import tokenizers
        except ImportError:
            raise UserError(f"tokenizer {name!r} needs the Hugging Face tokenizers library: "
                            f"pip install 'mixer-zoo[lm]' (or use tokenizer: bytes)") from None
        self.name = name
        if not Path(name).is_file() and (name.endswith(".json") or name.startswith(("/", "./", "../", "~"))):
            raise UserError(f"tokenizer {name!r}: no such file (a relative path is read from the current folder, "
                            f"{os.getcwd()}); give the tokenizer.json's path, or a Hub name")
        try:
            if Path(name).is_file():
                self.tok = tokenizers.Tokenizer.from_file(name)
            else:
                self.tok = tokenizers.Tokenizer.from_pretrained(name)
        except Exception as err:  # noqa: BLE001 - a missing name, no network, a damaged file: one line
            why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if Path(name).is_file():
                raise UserError(f"tokenizer {name!r}: cannot read this file as a tokenizer.json ({why}); give a "
                                f"tokenizers.Tokenizer file") from None
            raise UserError(f"tokenizer {name!r}: cannot load it: the Hugging Face Hub did not give it and it is not "
                            f"in the local cache ({why}); check the name, or, without a network, fetch it once with one "
                            f"(zoo data prepare RECIPE), or give a local tokenizer.json path") from None
        # a tokenizer.json may carry the truncation and padding its model was served with (``max_length`` 128 or
        # 512, padded to it): encoding a document must give all of its tokens and nothing else
        self.tok.no_truncation()
        self.tok.no_padding()
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        found = [vocab[n] for n in EOS_NAMES if n in vocab]
        if not found:
            raise UserError(f"tokenizer {name!r} has no end-of-text token (looked for {', '.join(EOS_NAMES)}); "
                            f"add one to it")
        self.eos_id = found[0]

    def encode(self, data: bytes | str) -> list[int]:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8", errors="replace")
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> bytes:
        return self.tok.decode([int(i) for i in ids]).encode("utf-8")

    def token_bytes(self) -> np.ndarray:
        decoder = (json.loads(self.tok.to_str()).get("decoder") or {}).get("type")
        table = byte_level_table() if decoder == "ByteLevel" else {}
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        decoded = []
        for token, i in self.tok.get_vocab(with_added_tokens=True).items():
            if i == self.eos_id or _BYTE_FALLBACK.fullmatch(token):
                out[i] = 1
            elif i in special:
                out[i] = 0
            elif table and all(c in table for c in token):
                out[i] = len(token)  # byte-level BPE: one character per byte
            else:
                decoded.append(i)
        if decoded:  # the bytes a token adds after another: decoding it alone drops a leading space
            anchor = self._anchor(special)
            alone = len(self.tok.decode([anchor]).encode("utf-8"))
            texts = self.tok.decode_batch([[anchor, i] for i in decoded], skip_special_tokens=False)
            out[decoded] = [len(text.encode("utf-8")) - alone for text in texts]
        return out

    def _anchor(self, special: set) -> int:
        """A token that decodes to one ASCII letter or digit (``a`` where there is one), to decode others after."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        for i in ([vocab["a"]] if "a" in vocab else []) + sorted(vocab.values()):
            if i != self.eos_id and i not in special:
                text = self.tok.decode([i])
                if len(text) == 1 and text.isascii() and text.isalnum():
                    return i
        raise UserError(f"tokenizer {self.name!r}: no token decodes to a single letter or digit, so the bytes each "
                        f"token stands for cannot be counted for bits per byte")

    def fingerprint(self) -> str:
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:   # hashed once: every checkpoint a run writes records it
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]


def make_tokenizer(name: str):
    """``bytes`` or a Hugging Face tokenizer name / ``tokenizer.json`` path."""
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


def token_dtype(vocab_size: int):
    """The smallest unsigned dtype of a token file that holds every id."""
    if vocab_size <= 1 << 16:
        return np.uint16
    if vocab_size <= 1 << 32:
        return np.uint32
    raise UserError(f"a vocabulary of {vocab_size} tokens does not fit a uint32 token file")
