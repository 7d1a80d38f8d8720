"""A corpus in a folder whose name holds glob characters (``notes [v2]``, spaces, ``*``): the part of
``task.path`` that exists on disk is that folder, not a glob class, so ``zoo data prepare`` reads every file
under it into the split the hash rule gives it; and such a folder given as ``task.path`` itself is refused as a
folder, with the glob to give instead."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from mixers.options import build_options
from tests.zoo.preparation import in_both_splits, split_documents
from zoo.cli import main as zoo_main
from zoo.data import prepare as prep
from zoo.tasks.lm import LanguageModeling

VAL_FRACTION = 0.4


def _is_validation(document: bytes) -> bool:
    """The split rule written out: the first 8 bytes of the document's SHA-256, as a fraction of 2^64."""
    return int.from_bytes(hashlib.sha256(document).digest()[:8], "big") / 2.0 ** 64 < VAL_FRACTION


def _random_texts() -> list[str]:
    words = ["gate", "decay", "key", "value", "chunk", "scan", "é", "π"]
    picks = torch.randint(len(words), (int(torch.randint(6, 12, ())), 40)).tolist()
    return [" ".join(words[i] for i in row) for row in picks]


def _options(path: str, data_dir) -> LanguageModeling.Options:
    return build_options(LanguageModeling.Options, {"source": "files", "path": path, "val_fraction": VAL_FRACTION,
                                                    "seq_len": 8, "data_dir": str(data_dir)}, "")


@pytest.mark.parametrize("name", ["notes [v2]", "draft *final* [a-z] notes", "[x]"])
def test_a_folder_whose_name_holds_glob_characters_is_read_whole_into_the_splits_the_hash_gives(tmp_path, name):
    corpus = tmp_path / name / "sub dir"
    corpus.mkdir(parents=True)
    texts = in_both_splits(_random_texts, VAL_FRACTION)
    for i, text in enumerate(texts):
        (corpus / f"note {i}.txt").write_text(text)
    (corpus / "ignored.md").write_text("not a .txt file")
    where, wrote = prep.prepare(_options(str(tmp_path / name / "**" / "*.txt"), tmp_path / "data"))
    assert wrote
    read = {split: split_documents(np.fromfile(where / f"{split}.bin", dtype=np.uint16)) for split in prep.SPLITS}
    documents = [t.encode() for t in texts]
    assert sorted(read["val"]) == sorted(d for d in documents if _is_validation(d))
    assert sorted(read["train"]) == sorted(d for d in documents if not _is_validation(d))


def test_a_folder_whose_name_holds_a_glob_class_is_refused_as_a_folder_with_the_glob_to_give(tmp_path, capsys):
    folder = tmp_path / f"notes [{int(torch.randint(100, ()))}]"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{d_model: 16, layers: [gla]}}\ntask: {{name: lm, source: files, path: '{folder}', "
                      f"data_dir: '{tmp_path / 'data'}'}}\n")
    assert zoo_main(["data", "prepare", str(recipe)]) != 0
    err = capsys.readouterr().err
    assert "is a folder" in err and f"{folder}/*.txt" in err and "Traceback" not in err, err
