"""Chunk lengths follow the device: a mixer whose ``chunk_size`` is a compute knob leaves it unset by default
and takes the device plan's length at forward time, while its recipes keep their identity.

- Every registered mixer with a ``chunk_size`` option that does not change its output declares it with
  :func:`mixers.options.chunk_size_opt` (unset by default, a kernel family named); a mixer whose chunk size is
  semantics keeps a fixed default.
- The plain (hashed) form of an unset chunk size is the CPU plan's length: the same plain form, and so the
  same recipe hash, as the value written out, which is what the option's default was before it followed the
  device (recorded rows keep their keys).
- :func:`mixers.options.chunk_size_for` gives the set value, else the plan's length for the tensor.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.device import CPU, GPU, gpu_path_on_cpu
from mixers import MIXERS
from mixers.options import build_options, chunk_size_for, plain_options

CHUNKED = [n for n in MIXERS.names() if "chunk_size" in {f.name for f in dataclasses.fields(MIXERS.get(n).Options)}]


def _field(name):
    return next(f for f in dataclasses.fields(MIXERS.get(name).Options) if f.name == "chunk_size")


@pytest.mark.parametrize("name", CHUNKED)
def test_compute_knob_chunk_sizes_follow_the_device(name):
    cls, field = MIXERS.get(name), _field(name)
    family = field.metadata.get("device_chunk")
    if cls.chunk_size_changes_output:
        assert family is None and isinstance(field.default, int), f"{name}: a semantic chunk size keeps its default"
        return
    assert family is not None and field.default is None, f"{name}: declare chunk_size with chunk_size_opt(family, ...)"
    unset = plain_options(build_options(cls.Options, {}))
    written = plain_options(build_options(cls.Options, {"chunk_size": CPU.chunk_size(family)}))
    assert unset == written and unset["chunk_size"] == CPU.chunk_size(family)


def test_chunk_size_for_reads_the_plan():
    x = torch.zeros(1)
    assert chunk_size_for(x, "delta", None) == CPU.chunk_size("delta")
    assert chunk_size_for(x, "delta", 7) == 7
    with gpu_path_on_cpu():
        assert chunk_size_for(x, "delta", None) == GPU.chunk_size("delta")
        assert chunk_size_for(x, "delta", 7) == 7
