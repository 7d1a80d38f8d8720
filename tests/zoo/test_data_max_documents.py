"""``max_documents`` counts the documents prepared, alike for every source: the first N non-empty documents. An
``hf`` source counted its records instead (a record whose text is null or empty is left out, yet used up the
bound), so a bound of N prepared fewer than N documents from a dataset with missing texts; and it asked the stream
for one record more than it needed."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch

from mixers.options import build_options
from tests.zoo.preparation import split_documents
from zoo.data import prepare as prep
from zoo.data import sources
from zoo.errors import UserError
from zoo.tasks.lm import LanguageModeling


def options(tmp_path, **values):
    return build_options(LanguageModeling.Options, {"val_fraction": 0.3, "seq_len": 16, "num_test": 2,
                                                    "data_dir": str(tmp_path / "data"), **values}, "")


def texts_with_gaps(rng, count):
    """``count`` texts, about a third of them missing (None) or empty."""
    words = ["state", "mixer", "token", "decay", "gate", "key", "value", "query"]
    return [None if r < 0.2 else "" if r < 0.35 else " ".join(rng.choice(words, 12)) + f" {i}"
            for i, r in enumerate(rng.random(count))]


def streamed(monkeypatch, records, asked):
    """A ``datasets`` stand-in streaming ``records``; ``asked`` collects the index of every record handed out."""
    def load_dataset(name, config=None, split="train", streaming=False, **kwargs):
        def stream():
            for i, record in enumerate(records):
                asked.append(i)
                yield record
        return stream()
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_a_streamed_hf_source_gives_its_first_n_documents_with_text(tmp_path, monkeypatch):
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    texts = texts_with_gaps(rng, 60)
    kept = [t for t in texts if t]
    n = 10
    last = texts.index(kept[n - 1])
    records = [{"text": t} for t in texts[:last + 1]] + [{"text": 7}]   # a record after the n-th is never read
    asked = []
    streamed(monkeypatch, records, asked)
    o = options(tmp_path, source="hf", hf_dataset="org/set", max_documents=n)
    assert list(sources.documents(o)) == [t.encode() for t in kept[:n]]
    assert asked == list(range(last + 1))
    # the bound counts documents, so it is said in the prepared data's description (and so its folder's key)
    assert sources.describe(o).endswith(f", first {n} non-empty documents")
    assert "documents" not in sources.describe(options(tmp_path, source="hf", hf_dataset="org/set"))
    with pytest.raises(UserError, match="holds int"):   # unbounded, the stream is read to that record
        list(sources.documents(options(tmp_path, source="hf", hf_dataset="org/set")))


@pytest.mark.parametrize("bound", [1, 5, 64, 65])   # 64 documents make one part of the preparation
def test_a_bound_gives_that_many_documents_when_the_source_holds_them(tmp_path, monkeypatch, bound):
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    texts = texts_with_gaps(rng, 150)
    streamed(monkeypatch, [{"text": t} for t in texts], [])
    got = list(sources.documents(options(tmp_path, source="hf", hf_dataset="org/set", max_documents=bound)))
    assert got == [t.encode() for t in texts if t][:bound]


def test_a_files_source_counts_its_documents_the_same_way(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"")                        # an empty file: no document
    (corpus / "b.txt").write_bytes(b"one\n\n\n\ntwo\n\n")    # empty pieces between separators: none either
    (corpus / "c.txt").write_bytes(b"three\n\nfour")
    o = options(tmp_path, source="files", path=str(corpus / "*.txt"), doc_separator="\n\n", max_documents=3)
    assert list(sources.documents(o)) == [b"one", b"two", b"three"]


def test_a_local_hf_dataset_prepares_its_first_n_documents_with_text(tmp_path):
    pytest.importorskip("datasets")   # the lm extra: the json loader reads the local file (nothing downloaded)
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    texts = texts_with_gaps(rng, 120)   # about 78 with text
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    kept = [t.encode() for t in texts if t]
    n = 40
    o = options(tmp_path, source="hf", hf_dataset="json", hf_data_files=str(data), max_documents=n)
    where, _ = prep.prepare(o)
    meta = prep.read_meta(where, o)
    assert meta["documents"]["train"] + meta["documents"]["val"] == n
    prepared = [doc for split in ("train", "val")
                for doc in split_documents(np.fromfile(where / f"{split}.bin", dtype=np.uint16))]
    assert sorted(prepared) == sorted(kept[:n])
