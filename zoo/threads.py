"""The torch thread count for the length of a call: a recipe's ``train.threads`` (or a command's ``--threads``)
applies to its own run and the caller's count comes back after it, so a notebook that trains one recipe does not
keep that recipe's count for everything it runs next."""
from __future__ import annotations

import contextlib

import torch

from .errors import UserError

#: the most torch threads a recipe's ``train.threads`` or a command's ``--threads`` takes: torch cannot take a count
#: past 2**63 at all, and thousands of threads on a machine's few cores stall every kernel
MAX_THREADS = 1024


def refuse_thread_count(flag: str, threads: int | None) -> None:
    """Refuse a command's ``--threads`` over :data:`MAX_THREADS` in one line, before anything runs."""
    if threads is not None and threads > MAX_THREADS:
        raise UserError(f"{flag} {threads}: at most {MAX_THREADS} threads; give the number of cores this run may use")


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
