"""kernels.ahead's small pieces: the cores a process may use are shared among the processes of a ``torchrun``
job on this host (``LOCAL_WORLD_SIZE``), never fewer than one; and the tensors of a nested argument are found
at any depth, in lists, tuples and dict values, in order."""
from __future__ import annotations

import os

import torch

from kernels.ahead import available_cores, tensors_in


def _own_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def test_cores_are_shared_among_the_local_processes_of_a_job(monkeypatch):
    cores = _own_cores()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert available_cores() == cores
    for world in (1, 2, 3, cores, 4 * cores + 1):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
        assert available_cores() == max(1, cores // world), world


def test_tensors_are_found_at_any_depth_in_order():
    a, b, c, d = (torch.randn(int(torch.randint(1, 4, ()))) for _ in range(4))
    nested = (a, [1, "text", {"x": b, "y": (c, None)}], {"z": [[d]]}, 2.0)
    found = tensors_in(nested)
    assert len(found) == 4 and all(f is t for f, t in zip(found, (a, b, c, d)))
    assert tensors_in(a)[0] is a and tensors_in("no tensor") == [] and tensors_in({}) == []
