"""Windows of a memory-mapped token file: the seeded random windows training draws, and the fixed
windows validation reads.

A window of length ``L`` is ``L + 1`` consecutive tokens: the inputs are its first ``L``, the labels its
last ``L`` (every position supervised). Windows run across document boundaries, which the EOS token
marks. The token file is never read into memory: each draw reads only its windows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import UserError


class TokenFile:
    """A flat ``uint16``/``uint32`` token file, memory-mapped. With ``vocab_size``, every window read is checked to
    hold only ids below it (a folder prepared elsewhere, ``source: shards``, is not scanned up front: an id out of
    the vocabulary would otherwise fail inside the embedding, on a GPU as an unrecoverable device assert)."""

    def __init__(self, path: Path, dtype: str, split: str, vocab_size: int | None = None):
        self.path, self.split, self.vocab_size = path, split, vocab_size
        size = path.stat().st_size // np.dtype(dtype).itemsize
        self.tokens = np.memmap(path, dtype=dtype, mode="r", shape=(size,)) if size else np.zeros(0, dtype)

    def __len__(self) -> int:
        return len(self.tokens)

    def check_length(self, seq_len: int) -> None:
        if len(self) < seq_len + 1:
            raise UserError(f"the {self.split} split has {len(self)} tokens, fewer than one window of seq_len + 1 = "
                            f"{seq_len + 1}; lower task.seq_len (or eval.seq_lens), or use a larger corpus "
                            f"or val_fraction")

    def read(self, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``(len(starts), seq_len + 1)`` int64 tokens."""
        rows = [np.asarray(self.tokens[s: s + seq_len + 1], dtype=np.int64) for s in starts.tolist()]
        if not rows:
            return torch.zeros(0, seq_len + 1, dtype=torch.long)
        windows = np.stack(rows)
        if self.vocab_size is not None and windows.max() >= self.vocab_size:
            row, col = np.unravel_index(int(windows.argmax()), windows.shape)
            raise UserError(f"{self.path}: token {int(starts[row]) + int(col)} is id {int(windows.max())}, not below "
                            f"the vocabulary size {self.vocab_size} of its meta.json; fix vocab_size there or "
                            f"tokenise the data again")
        return torch.from_numpy(windows)


def random_starts(num_tokens: int, seq_len: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` window starts drawn uniformly with ``generator`` (same generator state: same windows)."""
    return torch.randint(0, num_tokens - seq_len, (n,), generator=generator)


def fixed_starts(num_tokens: int, seq_len: int, limit: int) -> torch.Tensor:
    """Up to ``limit`` non-overlapping windows spread evenly over the file (validation: always the same).

    The file holds ``fit`` back-to-back windows; ``count`` of them are read, window ``i`` being the
    ``floor(i * fit / count)``-th, so the first is at the start and the last within ``fit / count`` windows of
    the end (a whole-number stride ``fit // count`` would leave up to half the file unread).
    """
    fit = num_tokens // (seq_len + 1)
    count = min(fit, limit)
    return torch.arange(count) * fit // max(count, 1) * (seq_len + 1)
