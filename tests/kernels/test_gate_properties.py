"""The gate kernels (kernels.gate.triton) on what the basic tests leave out, against the PyTorch formulas run
in fp64: more rows than one program takes (the per-head parameter gradients summed over several programs'
partial sums), the step size's cap met exactly (its gradient passes at the cap), and an upstream gradient
whose heads are strided (read in place)."""
from __future__ import annotations

import pytest
import torch

from kernels.gate import (
    log_decay,
    log_decay_reference,
    scaled_sigmoid,
    scaled_sigmoid_reference,
    step_size,
    step_size_reference,
)
from kernels.gate.triton import _blocks
from tests.kernels.harness import assert_rel_close, needs_triton, value_and_grads

pytestmark = needs_triton


def _compare(fn, ref, inputs, upstream, tol):
    got = value_and_grads(fn, inputs, upstream)
    want = value_and_grads(ref, [x.double() for x in inputs], upstream.double())
    for i, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(a, b, tol, "value" if i == 0 else f"grad of input {i - 1}")


def test_parameter_gradients_sum_over_several_programs():
    """300 rows of 3 heads, over 128 rows a program: d A_log and d dt_bias add every program's share. A
    positive upstream gradient makes every per-row term of a head the same sign (no cancellation)."""
    B, T, H = 2, 150, 3
    BR, _ = _blocks(H, B * T)
    assert B * T > 2 * BR
    raw, A_log, dt_bias = torch.randn(B, T, H) * 3, torch.randn(H), torch.randn(H) - 2
    dg = torch.rand(B, T, H) + 0.1
    _compare(lambda r, a, b: log_decay(r, a, b, backend="triton"), log_decay_reference, [raw, A_log, dt_bias], dg,
             1e-5)
    _compare(lambda r, b: step_size(r, b, 4.0, backend="triton"), lambda r, b: step_size_reference(r, b, 4.0),
             [raw, dt_bias], dg, 1e-5)


def test_step_size_gradient_passes_at_the_cap():
    """softplus(30) is 30 in fp32 and fp64 alike: with ``dt_max = 30`` the clamp is met exactly, and the gradient
    of ``raw`` there is ``sigmoid(30) ddt`` (``clamp`` passes it at its bound); above the cap it is 0."""
    raw = torch.tensor([[29.0, 30.0, 31.0]])
    dt_bias = torch.zeros(3)
    ddt = torch.randn(1, 3)
    _compare(lambda r, b: step_size(r, b, 30.0, backend="triton"), lambda r, b: step_size_reference(r, b, 30.0),
             [raw, dt_bias], ddt, 1e-6)
    draw, = torch.autograd.grad(step_size(raw.requires_grad_(), dt_bias, 30.0, backend="triton"), raw, ddt)
    assert draw[0, 1] != 0 and draw[0, 2] == 0


def _transposed_loss_grads(fn, inputs, weight):
    """Gradients of ``sum(y^T W)`` for ``y = fn(*inputs)`` of shape ``(1, T, H)``: the upstream gradient is
    ``W (1, H, T)`` transposed, a view whose heads are ``T`` apart."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    y = fn(*xs)
    (y.transpose(1, 2) * weight.to(y.dtype)).sum().backward()
    return [y.detach()] + [x.grad for x in xs]


@pytest.mark.parametrize("op", ["log_decay", "step_size", "scaled_sigmoid"])
def test_a_strided_upstream_gradient_is_read_by_its_strides(op):
    T, H = 20, 4
    raw, A_log, dt_bias = torch.randn(1, T, H) * 3, torch.randn(H), torch.randn(H)
    if op == "log_decay":
        inputs, fn, ref = [raw, A_log, dt_bias], lambda *a: log_decay(*a, backend="triton"), log_decay_reference
    elif op == "step_size":
        inputs, fn = [raw, dt_bias], lambda r, b: step_size(r, b, 2.0, backend="triton")
        ref = lambda r, b: step_size_reference(r, b, 2.0)  # noqa: E731
    else:
        inputs, fn = [raw], lambda r: scaled_sigmoid(r, 2.0, backend="triton")
        ref = lambda r: scaled_sigmoid_reference(r, 2.0)  # noqa: E731
    weight = torch.rand(1, H, T) + 0.1      # positive: the per-head sums do not cancel
    got = _transposed_loss_grads(fn, inputs, weight)
    want = _transposed_loss_grads(ref, [x.double() for x in inputs], weight.double())
    for i, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(a, b, 1e-5, "value" if i == 0 else f"grad of input {i - 1}")
