"""The torch thread count for the length of a call: a recipe's ``train.threads`` (or a command's ``--threads``)
applies to its own run and the caller's count comes back after it, so a notebook that trains one recipe does not
keep that recipe's count for everything it runs next."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """Run the body with ``threads`` torch threads (``None`` or 0: the process's own count), then restore the
    count from before."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
