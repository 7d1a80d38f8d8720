"""Tensor-core products of an input tile with an fp32 state tile (used by the block scans and the slot memory).

A scan's state (a product of transitions, an adjoint) stays fp32, but with bf16/fp16 inputs its products
should still run on tensor cores, which take 16-bit operands and accumulate in fp32. :func:`dot_x_state`
(``x @ s``) and :func:`dot_state_x` (``s @ x``) feed the fp32 tile ``s`` as the sum of two 16-bit tiles,
``s = scale (hi + lo)`` with ``hi = round16(s / scale)`` and ``lo = round16(s / scale - hi)``: two products,
fp32 accumulation. The input tile ``x`` is exact in its own type, so the only rounding is that of ``s``:
``lo`` keeps the bits ``hi`` drops, about 16 significant bits of ``s`` in bf16 (8 + 8) and 22 in fp16
(11 + 11), against 8 or 11 for a plain cast. ``scale`` is 1 for bf16 (fp32's exponent range) and, for fp16,
the power of two at or above ``max |s|`` over the tile, so that ``hi`` cannot overflow fp16's 65504; entries
below ``2^-24 scale`` then flush to zero, an absolute error of at most ``2^-25 max |s|``.

fp32 inputs multiply in exact fp32 (``input_precision="ieee"``), never in tf32.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dot_x_state", "dot_state_x"]


@triton.jit
def _split16(s, DT: tl.constexpr):
    if DT == tl.float16:
        mx = tl.max(tl.max(tl.abs(s), axis=1), axis=0)
        scale = tl.where(mx > 0, tl.exp2(tl.ceil(tl.log2(tl.maximum(mx, 1e-30)))), 1.0)
        s = s / scale
    else:
        scale = 1.0
    hi = s.to(DT)
    lo = (s - hi.to(tl.float32)).to(DT)
    return hi, lo, scale


@triton.jit
def dot_x_state(x, s):
    """``x @ s``: ``x`` an input tile (fp32, bf16 or fp16), ``s`` an fp32 tile; fp32 result."""
    if x.dtype == tl.float32:
        return tl.dot(x, s, input_precision="ieee")
    hi, lo, scale = _split16(s, x.dtype)
    return tl.dot(x, lo, acc=tl.dot(x, hi)) * scale


@triton.jit
def dot_state_x(s, x):
    """``s @ x``: ``s`` an fp32 tile, ``x`` an input tile (fp32, bf16 or fp16); fp32 result."""
    if x.dtype == tl.float32:
        return tl.dot(s, x, input_precision="ieee")
    hi, lo, scale = _split16(s, x.dtype)
    return tl.dot(lo, x, acc=tl.dot(hi, x)) * scale
