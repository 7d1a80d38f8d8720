"""One layer on the GPU path against the same layer on the CPU path, both judged against the fp64 CPU path.

The GPU path (:func:`kernels.device.gpu_path_on_cpu`) and the CPU path both round in fp32. Where a layer is
ill-conditioned (GKA's regularised solve, kappa up to (1 + a) / a ~ 51 at the default ridge) or a gradient is
nearly zero (a parameter whose terms cancel to rounding level), either path's error against the same layer
in fp64 can exceed the layer's fp32 tolerance on some draws, so two fp32 paths cannot be held to each other at
that tolerance. Each quantity (output, final state, input gradient, every parameter gradient) is held to the
fp64 CPU path instead: the GPU path's error must be within the tolerance, or within ``ROUNDING_RATIO`` times
the fp32 CPU path's own error on the same draw. Both paths round the same computation, so their errors have
the same size: over 37 GKA draws the GPU path's error stayed within 1.12x the CPU path's wherever the latter
exceeded the tolerance. A GPU path that computes something else is off by far more than rounding and fails.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from kernels.device import gpu_path_on_cpu
from tests.kernels.harness import rel_err

ROUNDING_RATIO = 3.0


def run_layer(layer, x: torch.Tensor, dy: torch.Tensor, gpu: bool) -> dict[str, torch.Tensor]:
    """``layer.prefill(x)`` and its backward with upstream ``dy`` on the GPU or the CPU path: the output, the
    input gradient, the final state and every parameter gradient, by name."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with gpu_path_on_cpu() if gpu else contextlib.nullcontext():
        y, state = layer.prefill(x)
        y.backward(dy)
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return {"output": y.detach(), "input gradient": x.grad, **{f"state {k}": v for k, v in state.items()},
            **{f"gradient of {n}": g for n, g in grads.items()}}


def assert_gpu_path_matches(layer, x: torch.Tensor, dy: torch.Tensor, tol: float, label: str) -> None:
    """The fp32 ``layer`` on the GPU path equals it on the CPU path, both against its fp64 copy (above)."""
    cpu, gpu = run_layer(layer, x, dy, gpu=False), run_layer(layer, x, dy, gpu=True)
    exact = run_layer(copy.deepcopy(layer).double(), x.double(), dy.double(), gpu=False)
    assert cpu.keys() == gpu.keys() == exact.keys(), f"{label}: {sorted(cpu)} != {sorted(gpu)}"
    for what in cpu:
        assert gpu[what].shape == exact[what].shape, f"{label}: {what}: shape {tuple(gpu[what].shape)}"
        assert torch.isfinite(gpu[what]).all(), f"{label}: {what}: non-finite values"
        gpu_err, cpu_err = rel_err(gpu[what], exact[what]), rel_err(cpu[what], exact[what])
        assert gpu_err <= max(tol, ROUNDING_RATIO * cpu_err), (
            f"{label}: {what}: GPU path off the fp64 CPU path by {gpu_err:.3e}, more than the tolerance "
            f"{tol:.1e} and {ROUNDING_RATIO:g}x the fp32 CPU path's own error {cpu_err:.3e}")
