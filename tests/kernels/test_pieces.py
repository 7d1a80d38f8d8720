"""kernels.pieces: fp32 tiles multiplied on 16-bit operands as sums of pieces, against fp64 products.

In fp16 (``u`` = 2^-11) one piece leaves the rounding of the operand (~u), two pieces ~u^2 and three the
fp32 product; :func:`mm_rows`, :func:`mm_tn` and :func:`state_pieces` scale rows, columns or the whole tile
by powers of two first, so operands far above fp16's 65504 stay finite and as accurate. fp32 operands
multiply exactly in fp32. Under the interpreter (fp16 and fp32 only: bf16 arithmetic is wrong there) or on
a GPU.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.pieces import OPERAND_CODES, mm, mm_acc, mm_rows, mm_tn, pieces, state_pieces
from tests.kernels.harness import DEVICE, needs_triton

pytestmark = needs_triton

N = 16      # tl.dot needs tiles of at least 16 in every dimension
FP16 = OPERAND_CODES["float16"]


@triton.jit
def _mm(a_ptr, b_ptr, out_ptr, B: tl.constexpr, OP: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr,
        ROWS: tl.constexpr):
    r = tl.arange(0, B)
    at = r[:, None] * B + r[None, :]
    a, b = tl.load(a_ptr + at), tl.load(b_ptr + at)
    b1, b2, b3 = pieces(b, OP, PB)
    if ROWS:
        out = mm_rows(a, b1, b2, b3, OP, PA, PB)
    else:
        out = mm(a, b1, b2, b3, OP, PA, PB)
    tl.store(out_ptr + at, out)


@triton.jit
def _tn(a_ptr, b_ptr, out_ptr, B: tl.constexpr, OP: tl.constexpr, P: tl.constexpr):
    r = tl.arange(0, B)
    at = r[:, None] * B + r[None, :]
    tl.store(out_ptr + at, mm_tn(tl.load(a_ptr + at), tl.load(b_ptr + at), OP, P))


@triton.jit
def _acc_state(acc_ptr, a_ptr, s_ptr, out_ptr, B: tl.constexpr, OP: tl.constexpr, P: tl.constexpr):
    r = tl.arange(0, B)
    at = r[:, None] * B + r[None, :]
    s1, s2, s3, ss = state_pieces(tl.load(s_ptr + at), OP, P)
    tl.store(out_ptr + at, mm_acc(tl.load(acc_ptr + at), tl.load(a_ptr + at), s1, s2, s3, ss, OP, P, P))


def _relative(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def _run(kernel, *inputs, **constexprs):
    out = torch.empty(N, N, device=DEVICE)
    kernel[(1,)](*inputs, out, B=N, **constexprs)
    return out


#: fp16 error bounds by number of pieces: one keeps the operand's rounding, two its square, three fp32's product
BOUND = {1: (2.0 ** -14, 2.0 ** -9), 2: (0.0, 2.0 ** -18), 3: (0.0, 2.0 ** -19)}


@pytest.mark.parametrize("P", [1, 2, 3])
def test_more_pieces_leave_less_of_the_fp16_rounding(P):
    a, b = torch.randn(N, N, device=DEVICE), torch.randn(N, N, device=DEVICE)
    err = _relative(_run(_mm, a, b, OP=FP16, PA=P, PB=P, ROWS=False), a.double() @ b.double())
    low, high = BOUND[P]
    assert low < err < high, (P, err)


def test_fp32_operands_multiply_exactly_in_fp32():
    a, b = torch.randn(N, N, device=DEVICE), torch.randn(N, N, device=DEVICE)
    out = _run(_mm, a, b, OP=OPERAND_CODES["float32"], PA=1, PB=1, ROWS=False)
    assert _relative(out, a.double() @ b.double()) < 2.0 ** -20


def test_rows_far_above_fp16_range_are_scaled_out_of_the_product():
    rows = torch.exp(torch.rand(N, 1, device=DEVICE) * 30 - 10)     # row sizes from 5e-5 to 2e8
    a, b = torch.randn(N, N, device=DEVICE) * rows, torch.randn(N, N, device=DEVICE)
    out = _run(_mm, a, b, OP=FP16, PA=2, PB=2, ROWS=True)
    want = a.double() @ b.double()
    assert torch.isfinite(out).all()
    per_row = ((out.double() - want).norm(dim=1) / want.norm(dim=1)).max().item()
    assert per_row < 2.0 ** -18, per_row      # every row as accurate as an unscaled one, however large or small


@pytest.mark.parametrize("P", [2, 3])
def test_transposed_product_scales_columns_of_both_operands(P):
    a = torch.randn(N, N, device=DEVICE) * torch.exp(torch.rand(1, N, device=DEVICE) * 24 - 6)
    b = torch.randn(N, N, device=DEVICE) * torch.exp(torch.rand(1, N, device=DEVICE) * 24 - 6)
    out = _run(_tn, a, b, OP=FP16, P=P)
    want = a.double().T @ b.double()
    assert torch.isfinite(out).all()
    scale = a.double().norm(dim=0)[:, None] * b.double().norm(dim=0)[None, :]
    assert ((out.double() - want).abs() / scale).max().item() < 2.0 ** -18


def test_a_state_above_fp16_range_accumulates_onto_acc():
    acc, a = torch.randn(N, N, device=DEVICE), torch.randn(N, N, device=DEVICE)
    s = torch.randn(N, N, device=DEVICE) * 3e6
    out = _run(_acc_state, acc, a, s, OP=FP16, P=2)
    want = acc.double() + a.double() @ s.double()
    assert torch.isfinite(out).all() and _relative(out, want) < 2.0 ** -18
