"""Count the Triton kernels one forward + backward of a launcher starts, without running them.

Every launch goes through :func:`kernels.launch.launch` (tests/kernels/test_compile.py checks that no launcher
bypasses it). :func:`launches` replaces the ``launch`` a family's ``triton`` module imported by a list of kernel
names and runs the launcher on ``meta`` tensors, so it works on any machine and at any length.
"""
from __future__ import annotations

from kernels.launch import kernel_name


def launches(module, monkeypatch, run, T):
    """The names of the kernels ``module``'s launchers start in one forward + backward of ``run(T)`` (a tuple of
    ``meta`` outputs; the backward is through the sum of them)."""
    names = []
    monkeypatch.setattr(module, "launch", lambda kernel, grid, *args, **kwargs: names.append(kernel_name(kernel)))
    outs = run(T)
    sum(o.float().sum() for o in outs).backward()
    return names
