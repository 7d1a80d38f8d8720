"""The property every ``zoo data prepare`` source must have, checked the same way for each: preparing twice
writes the same bytes (and the second time writes nothing), two workers write what one writes, and a run
interrupted after some parts resumes without tokenising those parts again, to the same files. Random corpora
for these tests are drawn with :func:`in_both_splits`, so that no draw leaves a split empty."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from zoo.data import prepare as prep
from zoo.data import sources

#: the byte tokenizer's end-of-document id, which separates the documents of a prepared split
EOS = 256


def split_documents(tokens: np.ndarray) -> list[bytes]:
    """The documents of a prepared byte-level split, in order (each ends with :data:`EOS`)."""
    ends = np.flatnonzero(tokens == EOS)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [bytes(tokens[s:e].astype(np.uint8)) for s, e in zip(starts, ends)]


def in_both_splits(draw: Callable[[], list], val_fraction: float, tries: int = 1000) -> list:
    """``draw()``'s first list of texts (None: a missing text) whose documents fall in both splits at
    ``val_fraction``: a few random documents all land in one split often enough (8 at 0.3: 1 draw in 17) to
    make a test that prepares them fail by chance rather than by a defect."""
    for _ in range(tries):
        texts = draw()
        splits = {sources.split_of(None, t.encode(), val_fraction) for t in texts if t}
        if splits == {"train", "val"}:
            return texts
    raise AssertionError(f"no draw of {tries} put documents in both splits at val_fraction {val_fraction}")


def folder_bytes(where: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(where.iterdir()) if p.is_file()}


def check_deterministic_and_resumable(monkeypatch, options_in: Callable[[str], object], interrupt_at: int) -> Path:
    """Run the checks with ``options_in(folder name)`` (prepare options writing under that name), interrupting
    the third run when its ``interrupt_at``-th part starts. Returns the first run's folder."""
    first, wrote = prep.prepare(options_in("one"))
    again, wrote_again = prep.prepare(options_in("one"))
    workers, _ = prep.prepare(options_in("two"), workers=2)
    assert wrote and not wrote_again and folder_bytes(first) == folder_bytes(again) == folder_bytes(workers)

    calls, real = [], prep._tokenize_part

    def interrupted(job):
        calls.append(job[0])
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(prep, "_tokenize_part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(options_in("three"))
    monkeypatch.setattr(prep, "_tokenize_part", lambda job: (calls.append(job[0]), real(job))[1])
    resumed, _ = prep.prepare(options_in("three"))
    done = interrupt_at - 1  # the parts finished before the interruption are not tokenised again
    assert calls[interrupt_at:] == list(range(done, calls[-1] + 1))
    assert folder_bytes(resumed) == folder_bytes(first)
    return first
