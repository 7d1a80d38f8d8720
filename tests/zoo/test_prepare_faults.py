"""``zoo data prepare`` under concurrency and interruption (several processes preparing one folder at once, as
every rank of ``torchrun`` does with a local source it finds unprepared; a run stopped while worker processes
tokenise, or while it writes the token files), the metadata of a shards folder, and a library tree whose file
names are not UTF-8."""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil

import numpy as np
import pytest
import torch

from mixers.options import build_options
from tests.zoo.preparation import folder_bytes, split_documents
from tests.zoo.test_lm import options, random_corpus
from zoo.data import prepare as prep
from zoo.data import sources
from zoo.errors import UserError
from zoo.tasks.lm import LanguageModeling


def _prepare_in_child(o, start, results) -> None:
    start.wait()
    try:
        prep.prepare(o)
        results.put("ok")
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which asserts on it
        results.put(f"{type(err).__name__}: {err}")


def test_processes_preparing_one_folder_at_once_all_succeed_with_the_files_one_process_writes(tmp_path, monkeypatch):
    corpus = random_corpus(tmp_path / "corpus", n_files=16)
    monkeypatch.setattr(prep, "PART_DOCUMENTS", 2)  # many parts: the processes overlap for long
    alone, _ = prep.prepare(options(tmp_path, corpus, data_dir=str(tmp_path / "alone")))
    o = options(tmp_path, corpus, data_dir=str(tmp_path / "shared"))
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(3), ctx.Queue()
    children = [ctx.Process(target=_prepare_in_child, args=(o, start, results)) for _ in range(3)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join()
    assert outcomes == ["ok"] * 3
    assert folder_bytes(prep.folder(o)) == folder_bytes(alone)
    assert not (prep.folder(o) / "parts").exists()


def test_an_interrupted_run_with_workers_stops_reading_the_source(tmp_path, monkeypatch):
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    total, read = 20_000, []

    def documents(_o):
        for i in range(total):
            read.append(i)
            yield None, bytes(rng.integers(97, 123, int(rng.integers(20, 60))).astype(np.uint8))

    writes, real_write = [], prep._write_atomic

    def interrupted_write(path, data):
        writes.append(path)
        if len(writes) == 7:  # the third part's first file
            raise KeyboardInterrupt
        real_write(path, data)

    monkeypatch.setattr(prep, "PART_DOCUMENTS", 2)
    monkeypatch.setattr(prep.sources, "keyed_documents", documents)
    monkeypatch.setattr(prep, "_write_atomic", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(options(tmp_path, source="python-docs"), workers=2)
    assert len(read) < total // 2  # not the whole corpus tokenised (and thrown away) before the interrupt returns


def test_a_run_interrupted_while_writing_the_token_files_leaves_no_temporary_file(tmp_path, monkeypatch):
    corpus = random_corpus(tmp_path / "corpus")
    alone, _ = prep.prepare(options(tmp_path, corpus, data_dir=str(tmp_path / "alone")))
    o = options(tmp_path, corpus, data_dir=str(tmp_path / "resumed"))
    copies, real_copy = [], shutil.copyfileobj

    def interrupted_copy(src, dst, *args):
        copies.append(src)
        if len(copies) == 2:
            raise KeyboardInterrupt
        real_copy(src, dst, *args)

    monkeypatch.setattr(prep.shutil, "copyfileobj", interrupted_copy)
    monkeypatch.setattr(prep.os, "getpid", lambda: 1)  # the process that was stopped; the resumed one is another
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(o)
    monkeypatch.undo()
    where, wrote = prep.prepare(o)
    assert wrote and sorted(p.name for p in where.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert folder_bytes(where) == folder_bytes(alone)


@pytest.mark.parametrize("broken", [{"tokens": {"train": 10}}, {"tokens": 20}, {"vocab_size": "257"},
                                    {"eos_id": None}, {"eos_id": 257}])
def test_a_hand_written_shards_metadata_with_a_wrong_field_is_refused_in_one_line(tmp_path, broken):
    files = options(tmp_path)
    where, _ = prep.prepare(files)
    meta = json.loads((where / "meta.json").read_text())
    (where / "meta.json").write_text(json.dumps({**meta, **broken}))
    with pytest.raises(UserError, match=f"{where / 'meta.json'}: (vocab_size and eos_id|eos_id 257)"):
        prep.read_meta(where, options(tmp_path, source="shards", path=str(where)))


def test_a_library_tree_with_a_file_name_that_is_not_utf8_is_prepared_and_split_on_the_names_bytes(tmp_path):
    rng = np.random.default_rng(int(torch.randint(1 << 30, ())))
    top = tmp_path / "tree"
    top.mkdir()
    names = [b"caf\xe9_%d.py" % i for i in range(8)] + [b"mod_%d.py" % i for i in range(8)]  # Latin-1 names too
    texts = {name: b"x = %d\n" % rng.integers(1 << 62) for name in names}
    for name, text in texts.items():
        with open(os.path.join(os.fsencode(top), name), "wb") as fh:
            fh.write(text)
    o = build_options(LanguageModeling.Options, {"source": "python-stdlib", "path": str(top), "val_fraction": 0.5,
                                                 "data_dir": str(tmp_path / "data")}, "")
    where, _ = prep.prepare(o)
    val = set(split_documents(np.fromfile(where / "val.bin", dtype=np.uint16)))
    assert val == {text for name, text in texts.items() if sources.is_validation(name, 0.5)}
