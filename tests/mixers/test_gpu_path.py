"""Every registered mixer computes the same function on the GPU path as on the CPU path.

The GPU path (:func:`kernels.device.gpu_path_on_cpu`: backend ``auto`` picks what it picks on CUDA among
what can take CPU tensors, Triton kernels through the interpreter, the device's chunk sizes, one projection
matmul, fused normalisations and gates, no segments) against the CPU path of the same layer with the same
weights, in fp32 at the default options: the output, the final state, the input gradient and every parameter
gradient, each judged against the fp64 CPU path (tests/mixers/gpu_path.py says why and how). The length is
the shortest of a few at which the layer reads something (``dead_at``), kept short because the interpreter
runs the sequential scans one program at a time.
"""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_usable_for
from mixers import MIXERS, build_mixer
from tests.mixers.gpu_path import assert_gpu_path_matches

pytestmark = pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")
D_MODEL = 32


@pytest.mark.parametrize("name", MIXERS.names())
def test_gpu_path_equals_cpu_path(name):
    layer = build_mixer(name, D_MODEL, {})
    T = next(t for t in (19, 80) if layer.dead_at(t) is None)
    x, dy = torch.randn(1, T, D_MODEL), torch.randn(1, T, D_MODEL)
    assert_gpu_path_matches(layer, x, dy, max(1e-4, type(layer).contract_fp32_rtol), f"{name} (T={T})")


@pytest.mark.parametrize("name", MIXERS.names())
def test_one_token_of_batch_one_trains_on_the_gpu_path(name):
    """Batch 1 and one token: views of size-1 dimensions carry arbitrary strides (a gradient slot read back through
    one once failed to be recognised and was copied onto itself). GKA's one token is its worst-conditioned case
    (a gate gradient 1e-3 off fp64 in both fp32 paths): tests/mixers/gpu_path.py's second look is measured on it."""
    layer = build_mixer(name, D_MODEL, {})
    x, dy = torch.randn(1, 1, D_MODEL), torch.randn(1, 1, D_MODEL)
    assert_gpu_path_matches(layer, x, dy, max(1e-4, type(layer).contract_fp32_rtol), f"{name} (T=1)")
