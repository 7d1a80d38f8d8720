"""Language modeling on real text: next-token prediction on windows of a tokenised corpus.

The data (:mod:`zoo.data`): a source of documents (``python-docs`` by default, which every Python
installation ships; ``python-stdlib``; ``files``; ``hf``; pre-tokenised ``shards``), a tokenizer
(``bytes`` by default: 256 byte values + EOS), split into train and validation by document. The source
is tokenised once into memory-mapped token files (``zoo data prepare RECIPE``; training prepares a local
source itself when it finds it unprepared). Training draws random windows of ``seq_len + 1`` tokens with
the trainer's seeded generator (:meth:`LanguageModeling.train_data` is a stream); validation reads
``num_test`` fixed, non-overlapping windows of the validation split, the same for every seed.

Only strictly causal layers may be trained on next-token prediction: a layer whose output at ``t`` reads
tokens after ``t`` would see the label. The task refuses them (:meth:`LanguageModeling.check_layers`):
every layer whose mixer says, from its options, that it is not causal (``Mixer.non_causal_reason_for``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from mixers import MIXERS
from mixers.options import opt

from ..data import prepare as prep
from ..data.sources import SOURCES
from ..data.tokenize import make_tokenizer
from ..data.windows import TokenFile, fixed_starts, random_starts
from ..errors import UserError
from .base import TaskData, register_task
from .text import TextTask


class TokenStream:
    """Random training windows of a token file (``draw`` is the streaming form of the task contract)."""

    def __init__(self, tokens: TokenFile, seq_len: int):
        tokens.check_length(seq_len)
        self.tokens, self.seq_len = tokens, seq_len

    def draw(self, n: int, generator: torch.Generator) -> TaskData:
        window = self.tokens.read(random_starts(len(self.tokens), self.seq_len, n, generator), self.seq_len)
        return TaskData(window[:, :-1], window[:, 1:])


@register_task
class LanguageModeling(TextTask):
    name = "lm"
    description = "language modeling on real text (default: Python's own help text, byte tokenizer; no download)"

    @dataclass
    class Options:
        source: str = opt("python-docs", "where documents come from", choices=SOURCES)
        path: str = opt("", "files: a glob of text files (';' between several); shards: the prepared folder; "
                            "python-stdlib: another library root (empty: this Python's)")
        tokenizer: str = opt("bytes", "bytes (256 values + EOS), or a Hugging Face tokenizer name or "
                                      "tokenizer.json path (pip install 'mixer-zoo[lm]')")
        seq_len: int = opt(128, "training window length in tokens", at_least=1, at_most=1 << 22)
        val_fraction: float = opt(0.05, "fraction of documents held out for validation (by document hash; "
                                        "python-stdlib: by file path)",
                                  above=0.0, at_most=0.5)
        num_test: int = opt(64, "validation windows (fixed, non-overlapping; fewer if the split is small)",
                            at_least=1, at_most=1_000_000)
        max_documents: int = opt(0, "read at most this many non-empty documents of the source (0: all)", at_least=0)
        doc_separator: str = opt("", "files: split each file into documents at this string (empty: one "
                                     "document per file)")
        hf_dataset: str = opt("", "hf: dataset name, e.g. HuggingFaceFW/fineweb-edu (or a loader such as json)")
        hf_config: str = opt("", "hf: dataset configuration, e.g. sample-10BT")
        hf_split: str = opt("train", "hf: split to read")
        hf_text_field: str = opt("text", "hf: the field holding the text")
        hf_data_files: str = opt("", "hf: local data files for a loader such as json or text")
        data_dir: str = opt("", "where prepared data lives (default $ZOO_DATA_DIR or ~/.cache/mixer-zoo/data)")

        def __post_init__(self):
            if self.source in ("files", "shards") and not self.path:
                raise ValueError(f"source {self.source!r} needs task.path (files: a glob; shards: a folder)")
            for part in (p.strip() for p in self.path.split(";")) if self.source == "files" else ():
                if part and Path(part).expanduser().is_dir():  # a folder named ``draft [v2]`` too
                    raise ValueError(f"task.path {part!r} is a folder; source 'files' reads files: give a file or a "
                                     f"glob such as {part.rstrip('/')}/*.txt (or {part.rstrip('/')}/**/*.txt)")
            if self.source == "hf" and not self.hf_dataset:
                raise ValueError("source 'hf' needs task.hf_dataset, e.g. HuggingFaceFW/fineweb-edu")

    @cached_property
    def tokenizer(self):
        return make_tokenizer(self.options.tokenizer)

    def tokenizer_fingerprint(self) -> str | None:
        """What a checkpoint records of its tokenizer's contents (None for prepared shards, which carry their own
        ``meta.json``): a tokenizer file replaced under the same path is then refused, not used."""
        return None if self.options.source == "shards" else self.tokenizer.fingerprint()

    @property
    def vocab_size(self) -> int:
        if self.options.source == "shards":
            return self.meta["vocab_size"]
        return self.tokenizer.vocab_size

    def num_examples(self, split: str) -> int:
        return self.options.num_test

    @cached_property
    def folder(self):
        """The prepared data's folder, preparing a local source here if it is not prepared yet."""
        o = self.options
        where = prep.folder(o) if o.source == "shards" else prep.folder(o, self.tokenizer)
        if o.source != "shards" and not (where / prep.META).exists():
            if o.source == "hf":
                raise UserError(f"the Hugging Face source {o.hf_dataset!r} is not prepared yet; run "
                                f"zoo data prepare RECIPE first")
            prep.prepare(o)
        return where

    @cached_property
    def meta(self) -> dict:
        return prep.read_meta(self.folder, self.options)

    def tokens(self, split: str) -> TokenFile:
        return TokenFile(self.folder / f"{split}.bin", self.meta["dtype"], "validation" if split == "val" else split,
                         self.meta["vocab_size"])

    def train_data(self, seed: int) -> TokenStream:
        self.tokens("val").check_length(self.seq_len)  # found before training, not after it
        return TokenStream(self.tokens("train"), self.seq_len)

    def check_length(self, seq_len: int) -> None:
        """Once the data is prepared, the validation split must hold a window of every evaluated length."""
        o = self.options
        where = prep.folder(o) if o.source == "shards" else prep.folder(o, self.tokenizer)
        if (where / prep.META).exists():
            val = self.tokens("val")
            if len(val) < seq_len + 1:
                raise ValueError(f"lm: the validation split has {len(val)} tokens, fewer than one window of "
                                 f"{seq_len} + 1")

    def generate(self, num_examples: int, seq_len: int, generator: torch.Generator) -> TaskData:
        self.tokens("val").check_length(seq_len)  # so zoo check finds a validation split too small, too
        return TokenStream(self.tokens("train"), seq_len).draw(num_examples, generator)

    def make(self, split: str, seed: int, seq_len: int | None = None, num_examples: int | None = None) -> TaskData:
        if split != "test":
            return super().make(split, seed, seq_len, num_examples)
        seq_len = seq_len or self.seq_len
        val = self.tokens("val")
        val.check_length(seq_len)
        window = val.read(fixed_starts(len(val), seq_len, num_examples or self.options.num_test), seq_len)
        return TaskData(window[:, :-1], window[:, 1:])

    def check_layers(self, layers) -> tuple[int, str] | None:
        for i, spec in enumerate(layers):
            reason = MIXERS.get(spec.name).non_causal_reason_for(spec.options)
            if reason is not None:
                return i, f"{spec.name} is not causal ({reason}); next-token training needs a strictly causal layer"
        return None

    def token_bytes(self) -> torch.Tensor:
        if self.options.source == "shards" and self.meta["tokenizer"] == "bytes":
            return torch.ones(self.vocab_size, dtype=torch.long)
        return torch.from_numpy(self.tokenizer.token_bytes())

    def data_record(self) -> dict:
        return {"data_source": self.meta.get("source", self.options.source),
                "data_source_hash": str(self.meta.get("source_hash", ""))[:16],
                "data_train_tokens": self.meta["tokens"]["train"], "data_val_tokens": self.meta["tokens"]["val"],
                **({"data_python": self.meta["python"]} if "python" in self.meta else {})}
