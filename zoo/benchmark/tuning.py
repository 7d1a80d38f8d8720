"""What the GPU tuning sweeps (:mod:`.delta_tune`, :mod:`.launch_tune`) share: a dry run started again under
the Triton interpreter, and calls timed side by side."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import torch

from kernels.backend import triton_interpreting

from .measure import times_ms


def restart_interpreted(module: str, argv) -> int | None:
    """For a dry run on a CPU whose kernels were defined without the interpreter (``module``'s own imports
    define them, and the interpreter is chosen there): the exit status of ``python -m module *argv`` run
    again with ``TRITON_INTERPRET=1``. None where there is nothing to restart (interpreting, or a GPU)."""
    if torch.cuda.is_available() or triton_interpreting():
        return None
    argv = sys.argv[1:] if argv is None else list(argv)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", module, *argv], env=env).returncode


def side_by_side(calls: dict, device: torch.device, warmup: int, repeats: int, rounds: int = 3) -> dict:
    """Median ms of each of ``calls`` (name -> function), timed in ``rounds`` alternations so that a drift of
    the clock or of the card's temperature hits every one of them alike."""
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name] += times_ms(call, device, warmup, repeats)
    return {name: statistics.median(ms) for name, ms in samples.items()}
