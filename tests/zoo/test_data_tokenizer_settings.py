"""A Hugging Face ``tokenizer.json`` saved with truncation or padding turned on (as the tokenizers of many served
models are) still encodes every document whole and without pad tokens, in ``encode`` and in the prepared token
files. A tokenizer file named by another spelling of its path (relative, absolute) reads the folder it
prepared."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mixers.options import build_options
from tests.zoo.local_tokenizer import TEXT, bpe_tokenizer
from tests.zoo.preparation import in_both_splits
from zoo.data import prepare as prep
from zoo.data.tokenize import HFTokenizer
from zoo.errors import UserError
from zoo.tasks.lm import LanguageModeling

WORDS = ["the", "state", "of", "mixer", "scan", "key", "decays", "gate", "opens", "chunk", "π", "é", ";", "."]


def _texts(rng, count):
    return [" ".join(rng.choice(WORDS, int(rng.integers(40, 120)))) for _ in range(count)]


def _saved_with(tmp_path, setting: str, length: int) -> tuple[str, HFTokenizer]:
    """The path of a tokenizer.json saved with ``setting`` on, and the plain tokenizer it was made from."""
    plain = bpe_tokenizer(tmp_path / "plain.json")
    tok = HFTokenizer(str(tmp_path / "plain.json")).tok
    if setting == "truncation":
        tok.enable_truncation(max_length=length)
    else:
        tok.enable_padding(length=length, pad_id=0, pad_token="<|endoftext|>")
    path = tmp_path / f"{setting}.json"
    tok.save(str(path))
    return str(path), plain


@pytest.mark.parametrize("setting", ["truncation", "padding"])
def test_a_saved_truncation_or_padding_does_not_change_the_tokens_of_a_document(tmp_path, setting):
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    path, plain = _saved_with(tmp_path, setting, int(rng.integers(4, 24)) if setting == "truncation" else 600)
    tok = HFTokenizer(path)
    bytes_of = tok.token_bytes()
    for text in _texts(rng, 5) + [TEXT]:
        ids = tok.encode(text)
        assert ids == plain.tok.encode(text, add_special_tokens=False).ids  # the tokens of the unsaved tokenizer
        assert tok.decode(ids) == text.encode()  # the whole text, no pad token
        assert int(bytes_of[ids].sum()) == len(text.encode())


def test_a_corpus_prepared_with_a_truncating_tokenizer_holds_every_document_whole(tmp_path):
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    path, plain = _saved_with(tmp_path, "truncation", int(rng.integers(4, 24)))
    texts = in_both_splits(lambda: _texts(rng, 12), 0.3)
    (tmp_path / "corpus.txt").write_text("\n\n\n".join(texts))
    o = build_options(LanguageModeling.Options, {
        "source": "files", "path": str(tmp_path / "corpus.txt"), "doc_separator": "\n\n\n", "tokenizer": path,
        "val_fraction": 0.3, "data_dir": str(tmp_path / "data")}, "")
    where, _ = prep.prepare(o)
    eos = plain.eos_id
    found = []
    for split in ("train", "val"):
        tokens = np.fromfile(where / f"{split}.bin", dtype=np.uint16).astype(np.int64)
        ends = np.flatnonzero(tokens == eos)
        starts = np.concatenate([[0], ends[:-1] + 1])
        found += [plain.tok.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends)]
    assert sorted(found) == sorted(texts)


def test_a_tokenizer_file_named_by_another_path_reads_the_folder_it_prepared(tmp_path, monkeypatch):
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    bpe_tokenizer(tmp_path / "tok.json")
    texts = in_both_splits(lambda: _texts(rng, 8), 0.3)
    (tmp_path / "corpus.txt").write_text("\n\n\n".join(texts))
    monkeypatch.chdir(tmp_path)

    def options(tokenizer):
        return build_options(LanguageModeling.Options, {
            "source": "files", "path": str(tmp_path / "corpus.txt"), "doc_separator": "\n\n\n",
            "tokenizer": tokenizer, "val_fraction": 0.3, "data_dir": str(tmp_path / "data")}, "")

    where, written = prep.prepare(options("./tok.json"))
    assert written
    again, written = prep.prepare(options(str(tmp_path / "tok.json")))
    assert again == where and not written
    meta = prep.read_meta(where, options(str(tmp_path / "tok.json")))
    assert meta["tokenizer"] == "./tok.json"
    bpe_tokenizer(tmp_path / "other.json", TEXT + " another text entirely")
    with pytest.raises(Exception, match="tokenised with './tok.json'"):
        prep.read_meta(where, options(str(tmp_path / "other.json")))


def test_a_hub_tokenizer_out_of_reach_and_a_damaged_file_are_named_apart(tmp_path, monkeypatch):
    """Offline, a Hub name not in the local cache is refused saying so and how to get it (fetch once with a network,
    or a local tokenizer.json), not "give a Hub name" (one was given); a file that is no tokenizer says that."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = f"no-such-org-{int(torch.randint(10**9, ()))}/tokenizer"
    with pytest.raises(UserError, match=r"Hub did not give it and it is not in the local cache .*local tokenizer.json"):
        HFTokenizer(name)
    damaged = tmp_path / "tokenizer.json"
    damaged.write_text("{not json")
    with pytest.raises(UserError, match=r"cannot read this file as a tokenizer.json"):
        HFTokenizer(str(damaged))
