"""The training windows a language-model run draws from its token file (zoo.tasks.lm.TokenStream): each is
``seq_len + 1`` consecutive tokens split into inputs and next-token labels, and every start from the first
token to the last one that leaves room for a whole window is drawn, uniformly, so the file's last token is a
label as often as any other. The validation windows it is scored on (``LanguageModeling.make("test", ...)``)
are whole window slots of the validation split, split the same way, distinct, and the same for every seed;
both are checked against the token file read with NumPy."""
import math
from collections import Counter

import numpy as np
import torch

from zoo.data.windows import TokenFile
from zoo.tasks.lm import LanguageModeling, TokenStream

from .test_lm import options

DRAWS = 6000


def test_training_windows_are_consecutive_and_every_start_is_drawn_uniformly(tmp_path):
    seq_len = int(torch.randint(2, 6, ()))
    starts = int(torch.randint(2, 6, ()))  # how many whole windows the file can start
    num_tokens = seq_len + starts
    path = tmp_path / "train.bin"
    np.arange(num_tokens, dtype=np.uint16).tofile(path)  # token i is i: a window names its start
    stream = TokenStream(TokenFile(path, "uint16", "train"), seq_len)
    data = stream.draw(DRAWS, torch.Generator().manual_seed(int(torch.randint(1 << 30, ()))))
    assert data.inputs.shape == data.labels.shape == (DRAWS, seq_len)
    first = data.inputs[:, 0]
    assert torch.equal(data.inputs, first[:, None] + torch.arange(seq_len))
    assert torch.equal(data.labels, data.inputs + 1)
    counts = torch.bincount(first, minlength=starts)
    assert len(counts) == starts  # no window starts past the last whole one
    p = 1 / starts
    spread = math.sqrt(DRAWS * p * (1 - p))
    for start, count in enumerate(counts.tolist()):
        assert abs(count - DRAWS * p) <= 5 * spread, (start, count)
    assert int(data.labels.max()) == num_tokens - 1


def _check_windows(val: np.ndarray, data, seq_len: int) -> None:
    """Each row is a whole window slot of ``val``, and no slot is used twice. The text repeats, so two slots can
    hold the same tokens: rows are distinct slots when no window's tokens appear in more rows than slots."""
    inputs, labels = data.inputs.numpy(), data.labels.numpy()
    assert inputs.shape == labels.shape and inputs.shape[1] == seq_len
    rows, slots = Counter(), {}
    for x, y in zip(inputs, labels):
        window = np.concatenate([x[:1], y])
        assert np.array_equal(x[1:], y[:-1])  # each label is the next input
        key = window.tobytes()
        rows[key] += 1
        slots[key] = sum(np.array_equal(val[s:s + seq_len + 1], window)
                         for s in range(0, len(val) - seq_len, seq_len + 1))
        assert slots[key], "a validation row that is not a whole window slot of the split"
    assert all(rows[key] <= slots[key] for key in rows), "two validation rows are the same window slot"


def test_validation_rows_are_next_token_windows_of_the_validation_split(tmp_path):
    task = LanguageModeling(options(tmp_path, seq_len=int(torch.randint(8, 24, ()))))
    val = np.fromfile(task.folder / "val.bin", dtype=task.meta["dtype"]).astype(np.int64)
    seed = int(torch.randint(1 << 20, ()))
    data = task.make("test", seed)
    _check_windows(val, data, task.seq_len)
    assert torch.equal(data.inputs, task.make("test", seed + 1).inputs)  # the same windows for every seed
    longer = task.seq_len + int(torch.randint(1, 8, ()))
    _check_windows(val, task.make("test", seed, seq_len=longer), longer)
