"""An ``hf`` source built from local files (``hf_data_files``, or a local dataset folder) is prepared again when
those files change, as a ``files`` corpus is: the prepared splits always hold the documents the files hold now.
A record whose text is missing adds no document, and a text field that holds no text is refused."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from mixers.options import build_options
from tests.zoo.preparation import in_both_splits, split_documents
from zoo.data import prepare as prep
from zoo.data import sources
from zoo.errors import UserError
from zoo.tasks.lm import LanguageModeling


def _fake_datasets(monkeypatch):
    """A ``datasets`` stand-in whose json loader reads the local files when it streams them (nothing downloaded)."""
    def load_dataset(name, config=None, split="train", streaming=False, data_files=None):
        files = [data_files] if data_files else sorted(str(p) for p in Path(name).glob("*.jsonl"))
        return (json.loads(line) for f in files for line in open(f) if line.strip())

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def _write(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _texts(rng, count):
    words = ["state", "mixer", "token", "decay", "gate", "key", "value", "query"]
    return [" ".join(rng.choice(words, int(rng.integers(10, 40)))) + f" {i}" for i in range(count)]


def _prepared_documents(o) -> list[bytes]:
    where, _ = prep.prepare(o)
    return sorted(doc for split in ("train", "val")
                  for doc in split_documents(np.fromfile(where / f"{split}.bin", dtype=np.uint16)))


@pytest.mark.parametrize("how", ["data_files", "dataset_folder"])
def test_an_edited_local_file_of_an_hf_source_is_prepared_again(tmp_path, monkeypatch, how):
    _fake_datasets(monkeypatch)
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    (tmp_path / "set").mkdir()
    data = tmp_path / "set" / "d.jsonl"
    # the prepared data inside the dataset's own folder is not part of the dataset
    values = {"source": "hf", "val_fraction": 0.3, "data_dir": str(tmp_path / "set" / "prepared")}
    values.update({"hf_dataset": "json", "hf_data_files": str(data)} if how == "data_files" else
                  {"hf_dataset": str(tmp_path / "set")})
    o = build_options(LanguageModeling.Options, values, "")
    first = in_both_splits(lambda: _texts(rng, int(rng.integers(20, 40))), 0.3)
    _write(data, first)
    assert _prepared_documents(o) == sorted(t.encode() for t in first)
    assert prep.prepare(o)[1] is False  # unchanged files: the prepared folder is found, nothing written
    # other documents, and more of them
    edited = in_both_splits(lambda: _texts(rng, len(first) + int(rng.integers(1, 10))), 0.3)
    _write(data, edited)
    assert _prepared_documents(o) == sorted(t.encode() for t in edited)
    task = LanguageModeling(o)  # what training reads is the edited data too
    assert task.meta["documents"]["train"] + task.meta["documents"]["val"] == len(edited)


def test_records_whose_text_is_missing_add_no_document_and_a_field_of_non_text_is_refused(tmp_path, monkeypatch):
    _fake_datasets(monkeypatch)
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    texts = [t if rng.random() < 0.7 else None for t in _texts(rng, int(rng.integers(20, 40)))]
    texts[int(rng.integers(len(texts)))] = None
    data = tmp_path / "d.jsonl"
    _write(data, texts)
    o = build_options(LanguageModeling.Options, {"source": "hf", "hf_dataset": "json", "hf_data_files": str(data),
                                                 "val_fraction": 0.3, "data_dir": str(tmp_path / "data")}, "")
    assert list(sources.documents(o)) == [t.encode() for t in texts if t is not None]
    _write(data, [texts[0] or "text", ["a", "list"]])
    with pytest.raises(UserError, match="holds list, not text"):
        list(sources.documents(o))
