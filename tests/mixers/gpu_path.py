"""One layer on the GPU path against the same layer on the CPU path, both judged against the fp64 CPU path.

The GPU path (:func:`kernels.device.gpu_path_on_cpu`) and the CPU path both round in fp32. Where a layer is
ill-conditioned (GKA's regularised solve, kappa up to (1 + a) / a ~ 51 at the default ridge, then a per-head
RMSNorm that amplifies errors on tokens with a small output) or a gradient is nearly zero (a parameter whose
terms cancel to rounding level), either path's error against the same layer in fp64 can exceed the layer's
fp32 tolerance on some draws, so two fp32 paths cannot be held to each other at that tolerance.

Each quantity (output, final state, input gradient, every parameter gradient) is held to the fp64 CPU path
instead: the GPU path's error must be within the tolerance, or within ``ROUNDING_RATIO`` times the largest
error of the fp32 CPU path over the input and ``ROUNDING_SAMPLES`` copies of it perturbed by one rounding
(relative noise of 2^-24): what fp32 rounding costs at this point of this layer. One sample is not enough: on
one GKA draw the CPU path's gradient errors ranged from 5e-5 to 1.7e-3 over eight such perturbations, and the
GPU path's (1.1e-3) was 6x the unperturbed CPU run's. Over 100 fresh GKA draws the GPU path's error stayed
below 0.71x the larger of the tolerance and the CPU path's largest error, a quarter of what the check allows.

The GPU path's own error is one draw from the same heavy tail: on one GKA draw at T = 1 its alpha-gate
gradient was 3.4e-3 off fp64 on the input and 2.6e-4..4.4e-3 on eight copies perturbed by one rounding (median
of the nine 1.4e-3; the CPU path's largest 1.8e-3). Judged by that single draw, one-token GKA reached 0.62 of
the bound in 100 fresh seeds (99th percentile 0.52), so a rare draw fails by chance. A quantity outside the
bound on the input is therefore looked at again over the same perturbed copies (``second_look``): its median
error over the input and the copies, against the same bound. The median of nine is not moved by one tail draw;
on the ten seeds of those 100 with the largest single-draw ratio it was at most 0.39 of the bound (median
0.18). A GPU path that computes something else is off by far more than rounding on every copy, and fails both
looks.

A quantity that is exactly zero in fp64 has no relative error: one-token DeltaProduct's gate gradients are zero
(the gate only decays the zero initial state), and the GPU path's kernels leave residues of about 1e-8 of the
input gradient's size where the terms cancel only to rounding. Such a quantity's size is measured against the
scale of its pass instead (:func:`quantity_error`).
"""
from __future__ import annotations

import contextlib
import copy
import statistics

import torch

from kernels.device import gpu_path_on_cpu
from tests.kernels.harness import rel_err

ROUNDING_RATIO = 3.0
ROUNDING_SAMPLES = 8
FP32_UNIT_ROUNDOFF = 2.0 ** -24


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
    exact = run_layer(copy.deepcopy(layer).double(), x.double(), dy.double(), gpu=False)
    gpu = run_layer(layer, x, dy, gpu=True)
    copies = rounding_copies(x)
    rounding = {what: max(errors) for what, errors in path_errors(layer, copies, dy, exact, gpu=False).items()}
    assert gpu.keys() == exact.keys(), f"{label}: {sorted(gpu)} != {sorted(exact)}"
    bound = {what: max(tol, ROUNDING_RATIO * rounding[what]) for what in gpu}
    outside = {}
    for what in gpu:
        assert gpu[what].shape == exact[what].shape, f"{label}: {what}: shape {tuple(gpu[what].shape)}"
        assert torch.isfinite(gpu[what]).all(), f"{label}: {what}: non-finite values"
        gpu_err = quantity_error(what, gpu[what], exact)
        if gpu_err > bound[what]:
            outside[what] = gpu_err
    if outside:
        second_look(layer, copies, dy, exact, outside, bound, rounding, label)


def second_look(layer, copies, dy, exact, outside: dict[str, float], bound, rounding, label: str) -> None:
    """The quantities ``outside`` the bound on the input, judged by the median of the GPU path's errors over the
    input and its perturbed ``copies`` (the module's docstring says why): one tail draw does not move it, a
    GPU path that computes something else is off on every copy."""
    errors = path_errors(layer, copies[1:], dy, exact, gpu=True)
    for what, first in outside.items():
        median = statistics.median([first, *errors[what]])
        assert median <= bound[what], (
            f"{label}: {what}: GPU path off the fp64 CPU path by {first:.3e} on the input and by {median:.3e} "
            f"(median) over it and {len(copies) - 1} copies perturbed by one rounding, more than the tolerance "
            f"and {ROUNDING_RATIO:g}x the fp32 CPU path's largest error {rounding[what]:.3e} (bound {bound[what]:.3e})")


def quantity_error(what: str, value: torch.Tensor, exact: dict[str, torch.Tensor]) -> float:
    """``value``'s relative error against ``exact[what]``; for a quantity that is exactly zero in fp64 (at one token
    a gate only decays the zero initial state: its gradient's terms cancel exactly), its size against the scale of
    the pass that computes it, the input gradient's norm for a gradient and the output's otherwise (fp32 leaves
    residues of about 1e-8 of it where the terms cancel only to rounding)."""
    truth = exact[what]
    if truth.abs().max() > 0:
        return rel_err(value, truth)
    scale = exact["input gradient" if what.startswith("gradient") else "output"].norm().clamp_min(1e-30)
    return (value.detach().double().norm() / scale).item()


def rounding_copies(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` and ``ROUNDING_SAMPLES`` copies of it perturbed by relative noise of one fp32 rounding."""
    return [x] + [x * (1 + FP32_UNIT_ROUNDOFF * torch.randn_like(x)) for _ in range(ROUNDING_SAMPLES)]


def path_errors(layer, inputs, dy, exact, gpu: bool) -> dict[str, list[float]]:
    """Per quantity, the fp32 path's relative error against ``exact`` on each of ``inputs``."""
    errors: dict[str, list[float]] = {}
    for xs in inputs:
        for what, value in run_layer(layer, xs, dy, gpu=gpu).items():
            errors.setdefault(what, []).append(quantity_error(what, value, exact))
    return errors


def fp32_rounding_errors(layer, x, dy, exact) -> dict[str, float]:
    """Per quantity, the largest error against ``exact`` of the fp32 CPU path on ``x`` and on
    ``ROUNDING_SAMPLES`` copies of ``x`` perturbed by relative noise of one fp32 rounding."""
    return {what: max(errors) for what, errors in path_errors(layer, rounding_copies(x), dy, exact, gpu=False).items()}
