"""Rotary position embeddings' Triton kernel (kernels.rope.triton) on layouts the basic tests leave out, against
the fp64 PyTorch formula: a heads-first tensor viewed as ``(B, T, G, D)`` (group and time strides swapped
against the output's) and a tensor whose last axis is strided, forward and backward (the upstream gradient of
the second is strided along its last axis too)."""
from __future__ import annotations

import torch

from kernels.rope import rotary, rotary_reference
from tests.kernels.harness import assert_rel_close, needs_triton

pytestmark = needs_triton


def _value_and_grad(fn, x, weight, last_axis_strided_grad):
    """``fn(x)`` and the gradient of ``sum(fn(x) W)``; with ``last_axis_strided_grad`` the loss reads the output
    with its last two axes swapped, so that the upstream gradient is strided along its last axis."""
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    if last_axis_strided_grad:
        (y.transpose(-1, -2) * weight.transpose(-1, -2).contiguous().to(y.dtype)).sum().backward()
    else:
        (y * weight.to(y.dtype)).sum().backward()
    return y.detach(), x.grad


def _check(x, start, rotated, last_axis_strided_grad):
    weight = torch.randn(x.shape)
    got = _value_and_grad(lambda t: rotary(t, start=start, rotated=rotated, backend="triton"), x, weight,
                          last_axis_strided_grad)
    want = _value_and_grad(lambda t: rotary_reference(t, start=start, rotated=rotated), x.double(), weight.double(),
                           last_axis_strided_grad)
    for name, a, b in zip(("value", "grad"), got, want):
        assert_rel_close(a, b, 1e-6, name)


def test_a_heads_first_tensor_is_read_by_its_strides():
    B, G, T, D = 2, 3, 5, 8
    x = torch.randn(B, G, T, D).transpose(1, 2)       # (B, T, G, D), groups T D apart, positions D apart
    assert x.stride(2) != D
    _check(x, start=3, rotated=2, last_axis_strided_grad=False)


def test_a_strided_last_axis_is_read_by_its_strides():
    B, T, G, D = 1, 6, 2, 8
    x = torch.randn(B, T, G, 2 * D)[..., ::2]          # every other column
    assert x.stride(-1) == 2
    _check(x, start=5, rotated=1, last_axis_strided_grad=True)
