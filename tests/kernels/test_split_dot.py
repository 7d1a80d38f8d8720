"""kernels.split_dot: the products of a 16-bit input tile with an fp32 state tile keep about 22 significant bits
of the state in fp16 (``s = scale (hi + lo)``), against the 11 of a plain cast, and a state far above fp16's
range does not overflow (the power-of-two scale); fp32 inputs multiply exactly in fp32. Checked against fp64
products of the same inputs, under the interpreter (fp16 and fp32 only: bf16 arithmetic is wrong there) or on
a GPU."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.split_dot import dot_state_x, dot_x_state
from tests.kernels.harness import DEVICE, needs_triton

pytestmark = needs_triton

N = 16      # tl.dot needs tiles of at least 16 in every dimension


@triton.jit
def _x_state(x_ptr, s_ptr, out_ptr, B: tl.constexpr):
    r = tl.arange(0, B)
    at = r[:, None] * B + r[None, :]
    tl.store(out_ptr + at, dot_x_state(tl.load(x_ptr + at), tl.load(s_ptr + at)))


@triton.jit
def _state_x(s_ptr, x_ptr, out_ptr, B: tl.constexpr):
    r = tl.arange(0, B)
    at = r[:, None] * B + r[None, :]
    tl.store(out_ptr + at, dot_state_x(tl.load(s_ptr + at), tl.load(x_ptr + at)))


def _kernels():
    return _x_state, _state_x


def _relative(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("magnitude", [1.0, 1e-3, 3e6])
def test_fp16_products_keep_the_state_to_about_22_bits(magnitude):
    x_state, state_x = _kernels()
    x = torch.randn(N, N, device=DEVICE).half()
    s = torch.randn(N, N, device=DEVICE) * magnitude
    for kernel, args, want in ((x_state, (x, s), x.double() @ s.double()), (state_x, (s, x), s.double() @ x.double())):
        out = torch.empty(N, N, device=DEVICE)
        kernel[(1,)](*args, out, B=N)
        assert torch.isfinite(out).all(), (kernel, magnitude)
        # a plain cast of s to fp16 costs ~2^-12 relative (or overflows at 3e6); the split keeps ~2^-22
        assert _relative(out, want) < 2.0 ** -18, (kernel, magnitude, _relative(out, want))
        if magnitude == 1.0:     # the bound tells the two apart
            plain = x.double() @ s.half().double() if kernel is x_state else s.half().double() @ x.double()
            assert _relative(plain, want) > 2.0 ** -16


def test_fp32_inputs_multiply_exactly_in_fp32():
    x_state, state_x = _kernels()
    x, s = torch.randn(N, N, device=DEVICE), torch.randn(N, N, device=DEVICE)
    for kernel, args, want in ((x_state, (x, s), x.double() @ s.double()), (state_x, (s, x), s.double() @ x.double())):
        out = torch.empty(N, N, device=DEVICE)
        kernel[(1,)](*args, out, B=N)
        assert _relative(out, want) < 2.0 ** -20        # fp32 rounding of 16-term sums, not tf32's 2^-11
