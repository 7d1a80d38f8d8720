"""The SwiGLU kernel (kernels.swiglu.triton) against the fp64 PyTorch formula with an upstream gradient that is a
column block of a wider gradient (rows farther apart than the output's width), as when the output is
concatenated with another tensor."""
from __future__ import annotations

import torch

from kernels.swiglu import swiglu, swiglu_reference
from tests.kernels.harness import assert_rel_close, needs_triton

pytestmark = needs_triton


def _value_and_grad(fn, h, other, weight):
    h = h.detach().clone().requires_grad_()
    y = fn(h)
    (torch.cat([y, other.to(y.dtype)], -1) * weight.to(y.dtype)).sum().backward()   # dy: a column block of dW
    return y.detach(), h.grad


def test_a_column_block_upstream_gradient_is_read_by_its_row_stride():
    rows, F = 7, 12
    h, other = torch.randn(rows, 2 * F), torch.randn(rows, 5)
    weight = torch.randn(rows, F + 5)
    got = _value_and_grad(lambda t: swiglu(t, backend="triton"), h, other, weight)
    want = _value_and_grad(swiglu_reference, h.double(), other.double(), weight.double())
    for name, a, b in zip(("value", "grad"), got, want):
        assert_rel_close(a, b, 1e-6, name)
