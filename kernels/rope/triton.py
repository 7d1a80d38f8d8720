"""Rotary position embeddings in one Triton kernel forward and one backward (the GPU path), where autograd
through the PyTorch formula launches about fifteen kernels forward and fifteen backward per rotated tensor.

A program takes ``BT`` positions of ``x`` viewed as ``(B, T, G, D)`` (any strides but the last; the ``q | k``
groups of a fused ``q | k | v`` projection are read in place), computes their angles once and rotates every
group at those positions in turn, writing them contiguous. The angles are computed in the kernel:
``base^(-i/h)`` in fp64 from ``log2(base)`` (passed as two fp32 halves) and rounded once to the compute
dtype, then ``theta = p base^(-i/h)`` and its cosine and sine in the compute dtype (fp32; fp64 stays
fp64), as the reference computes them. The backward is the rotation by ``-theta``
(``SIGN = -1``). Groups ``g >= rotated`` are copied as they are. No products for tensor cores.
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from ..common import cdiv, compute_dtype, pow2
from ..launch import launch


@triton.jit
def _rotate(X, Y, n_pos, T, G, rotated, sxb, sxt, sxg, syb, syt, syg, start, log2_base_hi, log2_base_lo,
            SIGN: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, FP64: tl.constexpr):
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)          # (batch, time) rows
    cols = tl.arange(0, BH)
    t = rows % T
    b = rows // T
    mask = (rows < n_pos)[:, None] & (cols < HALF)[None, :]
    x_at = X + (b * sxb + t * sxt)[:, None] + cols[None, :]
    y_at = Y + (b * syb + t * syt)[:, None] + cols[None, :]
    exponent = -(cols.to(tl.float64) / HALF)
    inv_freq = tl.exp2(exponent * log2_base_hi + exponent * log2_base_lo)
    if FP64:
        inv_freq = inv_freq.to(tl.float64)
        pos = (start + t).to(tl.float64)
    else:
        inv_freq = inv_freq.to(tl.float32)
        pos = (start + t).to(tl.float32)
    theta = pos[:, None] * inv_freq[None, :]
    c = tl.cos(theta)
    s = tl.sin(theta) * SIGN
    for g in range(0, rotated):                       # the angles serve every rotated group of the position
        x1 = tl.load(x_at + g * sxg, mask=mask, other=0.0).to(theta.dtype)
        x2 = tl.load(x_at + g * sxg + HALF, mask=mask, other=0.0).to(theta.dtype)
        tl.store(y_at + g * syg, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
        tl.store(y_at + g * syg + HALF, (x1 * s + x2 * c).to(Y.dtype.element_ty), mask=mask)
    for g in range(rotated, G):                       # the rest is copied
        tl.store(y_at + g * syg, tl.load(x_at + g * sxg, mask=mask), mask=mask)
        tl.store(y_at + g * syg + HALF, tl.load(x_at + g * sxg + HALF, mask=mask), mask=mask)


def _split_log2(base: float) -> tuple[float, float]:
    """``log2(base)`` as two fp32 numbers whose sum holds about 48 bits (a kernel's float scalar is fp32)."""
    exact = math.log2(base)
    hi = struct.unpack("f", struct.pack("f", exact))[0]
    return hi, exact - hi


def _rotate_into(x: torch.Tensor, start: int, base: float, rotated: int, sign: int) -> torch.Tensor:
    """Launch :func:`_rotate` over ``x (B, T, G, D)`` into a new contiguous tensor of ``x``'s dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, T, G, D = x.shape
    half = D // 2
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_pos = B * T
    BH = max(2, pow2(half))
    BT = max(1, min(64, 2048 // BH, pow2(n_pos)))
    hi, lo = _split_log2(base)
    launch(_rotate, (cdiv(n_pos, BT),), x, y, n_pos, T, G, rotated, *x.stride()[:3], *y.stride()[:3],
           start, hi, lo, SIGN=sign, HALF=half, BH=BH, BT=BT, FP64=compute_dtype(x.dtype) == torch.float64,
           num_warps=4)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, start: int, base: float, rotated: int):
        ctx.args = (start, base, rotated)
        return _rotate_into(x, start, base, rotated, 1)

    @staticmethod
    def backward(ctx, dy):
        return _rotate_into(dy, *ctx.args, -1), None, None, None


def rotary_triton(x: torch.Tensor, start: int = 0, base: float = 10000.0, rotated: int | None = None):
    """Same contract as :func:`kernels.rope.reference.rotary_reference`."""
    if x.numel() == 0:
        return x.clone()
    return _Rotary.apply(x, int(start), float(base), x.shape[2] if rotated is None else int(rotated))
