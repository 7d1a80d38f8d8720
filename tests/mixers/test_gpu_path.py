"""Every registered mixer computes the same function on the GPU path as on the CPU path.

The GPU path (:func:`kernels.device.gpu_path_on_cpu`: backend ``auto`` picks what it picks on CUDA among
what can take CPU tensors, Triton kernels through the interpreter, the device's chunk sizes, one projection
matmul, fused normalisations and gates, no segments) against the CPU path of the same layer with the same
weights, in fp32 at the default options: the output, the final state, the input gradient and every parameter
gradient. The length is the shortest of a few at which the layer reads something (``dead_at``), kept short
because the interpreter runs the sequential scans one program at a time.

Both paths round in fp32, and for an ill-conditioned layer (GKA's regularised solve, kappa up to
(1 + a) / a ~ 51 at the default ridge) the rounding error of either path, against the same layer in fp64,
can exceed the layer's fp32 tolerance on some draws, so two fp32 paths cannot be held to each other at that
tolerance. Each quantity is instead held to the fp64 CPU path: the GPU path's error must be within the
layer's tolerance, or within three times the CPU path's own error on the same draw (both paths round the
same computation, so their errors have the same size: over 150 GKA draws the ratio stayed below 1.2
wherever the CPU path's error exceeded the tolerance). A GPU path that computes something else fails.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from kernels.backend import triton_usable_for
from kernels.device import gpu_path_on_cpu
from mixers import MIXERS, build_mixer
from tests.kernels.harness import rel_err

pytestmark = pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")
D_MODEL = 32
ROUNDING_RATIO = 3.0


def _run(layer, x, dy, gpu: bool):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with gpu_path_on_cpu() if gpu else contextlib.nullcontext():
        y, state = layer.prefill(x)
        y.backward(dy)
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return {"output": y.detach(), "input gradient": x.grad, **{f"state {k}": v for k, v in state.items()},
            **{f"gradient of {n}": g for n, g in grads.items()}}


@pytest.mark.parametrize("name", MIXERS.names())
def test_gpu_path_equals_cpu_path(name):
    layer = build_mixer(name, D_MODEL, {})
    T = next(t for t in (19, 80) if layer.dead_at(t) is None)
    x, dy = torch.randn(1, T, D_MODEL), torch.randn(1, T, D_MODEL)
    cpu, gpu = _run(layer, x, dy, gpu=False), _run(layer, x, dy, gpu=True)
    exact = _run(copy.deepcopy(layer).double(), x.double(), dy.double(), gpu=False)
    assert cpu.keys() == gpu.keys() == exact.keys()
    tol = max(1e-4, type(layer).contract_fp32_rtol)
    for what in cpu:
        assert gpu[what].shape == exact[what].shape and torch.isfinite(gpu[what]).all(), f"{name}: {what}"
        gpu_err, cpu_err = rel_err(gpu[what], exact[what]), rel_err(cpu[what], exact[what])
        assert gpu_err <= max(tol, ROUNDING_RATIO * cpu_err), (
            f"{name} (T={T}): {what}: GPU path off the fp64 CPU path by {gpu_err:.3e}, more than the tolerance "
            f"{tol:.1e} and {ROUNDING_RATIO:g}x the fp32 CPU path's own error {cpu_err:.3e}")
