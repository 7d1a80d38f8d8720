"""A run stopped from outside: SIGTERM, what ``kill``, Slurm, Kubernetes and most job schedulers send first, ends a
run the way a Ctrl-C does.

Python's own answer to SIGTERM is to end the process at once, without a word: a scheduler's kill left no line
saying where the run stopped, what was saved and how to resume. While a run trains (:func:`zoo.training.loop.train`)
or an ablation drives its cells (:func:`zoo.experiments.ablate.run_ablation`), :func:`terminate_as_interrupt`
turns SIGTERM into :class:`Terminated`, a :class:`KeyboardInterrupt`, so that every place that answers a Ctrl-C
(the loop's line saying where it stopped, the command line's line saying how to resume, the folder lock's release)
answers it the same way. Checkpoints and rows are written atomically (:mod:`zoo.training.checkpoint`,
:mod:`zoo.rows`), so an interrupt at any moment leaves the previous file or the new one. A handler someone else
installed (a Ray worker's, a host program's) or an ignored SIGTERM is left as it is.
"""
from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as a Ctrl-C: whatever handles a Ctrl-C handles it the same way."""


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within the block, a SIGTERM raises :class:`Terminated` where the main thread runs; the process's own answer
    comes back after it. Only Python's default answer is replaced (signals reach the main thread alone, so another
    thread's block changes nothing)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def describe(stop: KeyboardInterrupt) -> str:
    """What stopped a run, in two words."""
    return "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"
