"""A token folder prepared elsewhere (``source: shards``) whose files hold an id at or above its meta.json's
vocabulary size: training stops at the first window that reads it, in one line naming the file, the token's
position and the fix (the id used to reach the embedding: an IndexError on a CPU, a device assert on a GPU),
and a folder whose ids all fit trains."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import zoo
from zoo.errors import UserError


def shards(folder, vocab: int, bad_at: int | None):
    folder.mkdir()
    train = np.random.default_rng(int(torch.randint(2 ** 31, ()))).integers(0, vocab, 4000).astype(np.uint16)
    if bad_at is not None:
        train[bad_at:] = vocab  # the rest of the file: every window from here on reads it
    val = np.random.default_rng(0).integers(0, vocab, 600).astype(np.uint16)
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "eos_id": 0, "dtype": "uint16",
                                                  "tokenizer": "bytes", "tokens": {"train": 4000, "val": 600}}))
    return folder


def recipe(folder):
    return zoo.load({"model": {"d_model": 16, "layers": ["gla"]},
                     "task": {"name": "lm", "source": "shards", "path": str(folder), "seq_len": 32, "num_test": 2},
                     "train": {"steps": 3, "batch_size": 2, "warmup_steps": 0, "threads": 1}})


def test_an_id_outside_the_vocabulary_is_named_with_its_file_and_position(tmp_path):
    vocab = int(torch.randint(40, 200, ()))
    folder = shards(tmp_path / "bad", vocab, bad_at=100)
    with pytest.raises(UserError, match=rf"train\.bin: token \d+ is id {vocab}, not below the vocabulary size "
                                        rf"{vocab} of its meta\.json"):
        zoo.train(recipe(folder), progress=False)


def test_ids_inside_the_vocabulary_train(tmp_path):
    """Uniform random ids: three steps leave the validation loss near that of a uniform guess, ln(vocab)."""
    metrics = zoo.train(recipe(shards(tmp_path / "good", 64, bad_at=None)), progress=False).metrics
    assert metrics["steps"] == 3 and abs(metrics["test_loss"] - math.log(64)) < 0.2, metrics
