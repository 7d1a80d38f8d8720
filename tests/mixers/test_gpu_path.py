"""Every registered mixer computes the same function on the GPU path as on the CPU path.

The GPU path (:func:`kernels.device.gpu_path_on_cpu`: backend ``auto`` picks what it picks on CUDA among
what can take CPU tensors, Triton kernels through the interpreter, the device's chunk sizes, one projection
matmul, fused normalisations and gates, no segments) against the CPU path of the same layer with the same
weights, in fp32 at the default options: the output, the final state, the input gradient and every parameter
gradient. The length is the shortest of a few at which the layer reads something (``dead_at``), kept short
because the interpreter runs the sequential scans one program at a time.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels.backend import triton_usable_for
from kernels.device import gpu_path_on_cpu
from mixers import MIXERS, build_mixer
from tests.kernels.harness import assert_rel_close

pytestmark = pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")
D_MODEL = 32


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
    assert cpu.keys() == gpu.keys()
    tol = max(1e-4, type(layer).contract_fp32_rtol)
    for what in cpu:
        assert_rel_close(gpu[what], cpu[what], tol, f"{name} (T={T}): {what}")
