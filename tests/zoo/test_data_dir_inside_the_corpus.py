"""A ``files`` corpus whose glob also covers the prepared-data folder (``path: notes/**/*`` with ``data_dir`` under
``notes``): the token files a run prepares are not text of the corpus, so a second ``zoo data prepare`` (and the
training that follows it) finds the same prepared folder, holding exactly the corpus's documents, instead of
reading the token files as documents and preparing again into a new folder at every run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mixers.options import build_options
from tests.zoo.preparation import in_both_splits, split_documents
from zoo.data import prepare as prep
from zoo.errors import UserError
from zoo.tasks.lm import LanguageModeling

VAL_FRACTION = 0.4


def _random_texts() -> list[str]:
    words = ["state", "mixer", "gate", "decay", "chunk", "é"]
    picks = torch.randint(len(words), (int(torch.randint(5, 10, ())), 30)).tolist()
    return [" ".join(words[i] for i in row) for row in picks]


def _options(path, data_dir) -> LanguageModeling.Options:
    return build_options(LanguageModeling.Options, {"source": "files", "path": str(path), "seq_len": 8,
                                                    "val_fraction": VAL_FRACTION, "data_dir": str(data_dir)}, "")


@pytest.mark.parametrize("data_dir", ["data", "."])
def test_a_corpus_glob_around_the_data_folder_prepares_once_and_reads_only_the_corpus(tmp_path, data_dir):
    corpus = tmp_path / "notes"
    (corpus / "sub").mkdir(parents=True)
    texts = in_both_splits(_random_texts, VAL_FRACTION)
    for i, text in enumerate(texts):
        (corpus / ("sub" if i % 2 else ".") / f"n{i}.txt").write_text(text)
    o = _options(corpus / "**" / "*", corpus / data_dir)
    first, wrote = prep.prepare(o)
    again, wrote_again = prep.prepare(o)
    assert wrote and not wrote_again and again == first
    assert LanguageModeling(o).folder == first  # what training reads
    read = [d for split in prep.SPLITS for d in split_documents(np.fromfile(first / f"{split}.bin", dtype=np.uint16))]
    assert sorted(read) == sorted(t.encode() for t in texts)


def test_a_glob_of_nothing_but_prepared_data_is_refused_naming_the_data_folder(tmp_path):
    corpus = tmp_path / "notes"
    corpus.mkdir()
    for i, text in enumerate(in_both_splits(_random_texts, VAL_FRACTION)):
        (corpus / f"n{i}.txt").write_text(text)
    prepared, _ = prep.prepare(_options(corpus / "*.txt", tmp_path / "data"))
    with pytest.raises(UserError, match="prepared data under .*task.data_dir.*point task.path at the corpus"):
        prep.prepare(_options(prepared / "*", tmp_path / "data"))
